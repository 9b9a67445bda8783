"""SIGTERM always ends in a complete checkpoint and exit 0, wherever it is sent: to the `rapidtrain` launcher, to
the torchrun it starts, to the launcher's process group, once or twice (the second during the final save), in
pretraining and fine-tuning (the black-box command and a Finetuner script), with the default 2 DataLoader workers
per rank and dropout on. A SIGKILLed launcher or torchrun leaves no rank training on: the ranks save and exit.
A run resumed from a SIGTERM checkpoint gives the uninterrupted run's losses bitwise.

Real processes throughout: each launch is its own session (so the test can signal its group), the test waits for
a log line showing training has started before it signals, and every wait is bounded. No process may outlive
the case: the process tree seen at the signal is followed to its end (ranks live in their own sessions).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rapidtrain.checkpoint.checkpointer import latest_iteration, verify_checkpoint
from rapidtrain.tasks import toy
from tests.launch import PRETRAIN, REPO, TINY_GPT_SHAPE, child_env, free_port, pretrain, read_losses, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

STARTED = re.compile(r"iteration\s+1/")  # the first log line (--log-interval 1)
STOPPING = re.compile(r"exiting at iteration\s+(\d+)")
WAIT = 600  # seconds any one wait may take on a slow shared machine; never a timing assertion
TRAIN_ITERS = 40  # far more than a stop needs, so a signalled run never just finishes
PRETRAIN_FLAGS = [*TINY_GPT_SHAPE, "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--micro-batch-size",
                  "2", "--global-batch-size", "8", "--lr", "1e-3", "--lr-warmup-iters", "2", "--train-iters",
                  str(TRAIN_ITERS), "--log-interval", "1", "--eval-iters", "0",
                  "--num-workers", "2"]  # workers given: a CPU run on indexed data makes its batches in-process


def processes_under(pid: int) -> set[int]:
    """`pid` and every live descendant (from /proc; zombies excluded)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = {pid} & set(parents), [pid]
    while frontier:
        parent = frontier.pop()
        children = {child for child, p in parents.items() if p == parent}
        found |= children
        frontier += children
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Launch:
    """One training started the way a user starts it, in its own session, its output in `log`."""

    def __init__(self, command: list[str], log: Path, nproc: int = 2) -> None:
        self.log = log
        self.output = log.open("w")
        self.process = subprocess.Popen(command, stdout=self.output, stderr=subprocess.STDOUT, cwd=REPO,
                                        env=child_env({"PYTHONUNBUFFERED": "1"}, nproc), start_new_session=True)
        self.tree: set[int] = set()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: re.Pattern) -> re.Match:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            found = pattern.search(self.text())
            if found:
                return found
            if self.process.poll() is not None:
                pytest.fail(f"ended ({self.process.returncode}) before {pattern.pattern!r}:\n{self.text()[-4000:]}")
            time.sleep(0.2)
        pytest.fail(f"no {pattern.pattern!r} within {WAIT} s:\n{self.text()[-4000:]}")

    def started(self) -> None:
        """Training runs: remember every process of the launch, DataLoader workers included."""
        self.wait_for(STARTED)
        self.tree = processes_under(self.process.pid)

    def child(self, pid: int | None = None) -> int:
        """The one child of `pid` (default: the launcher's torchrun)."""
        parent = self.process.pid if pid is None else pid
        children = [p for p in processes_under(parent) if p != parent and _parent_of(p) == parent]
        assert len(children) == 1, f"expected one child of {parent}, found {children}"
        return children[0]

    def finish(self) -> int:
        """The launch's exit status, once it and every process it had have ended."""
        try:
            status = self.process.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {WAIT} s after the signal:\n{self.text()[-4000:]}")
        deadline = time.monotonic() + WAIT
        while any(alive(p) for p in self.tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(p for p in self.tree if alive(p))
        if left:
            self.kill()
            pytest.fail(f"processes {left} outlived the launch:\n{self.text()[-4000:]}")
        self.output.close()
        return status

    def kill(self) -> None:
        for pid in self.tree | processes_under(self.process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


@pytest.fixture
def launches():
    """Every launch of a test; whatever is still running at its end (a failed case) is killed."""
    started: list[Launch] = []
    yield started
    for launch in started:
        if launch.process.poll() is None or any(alive(p) for p in launch.tree):
            launch.kill()
        launch.output.close()


def rapidtrain(args: list[str], log: Path, launches: list[Launch]) -> Launch:
    launch = Launch([sys.executable, "-m", "rapidtrain.cli", "--nproc-per-node", "2", *args], log)
    launches.append(launch)
    return launch


def plain_torchrun(script: Path, args: list[str], log: Path, launches: list[Launch],
                   torchrun_flags: list[str]) -> Launch:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
               *torchrun_flags, str(script), *args]
    launch = Launch(command, log)
    launches.append(launch)
    return launch


def assert_complete_checkpoint(save: Path, log: str) -> int:
    """The latest checkpoint is the one the stop announced, whole (every file matches its manifest), nothing
    half-written left beside it, and no DataLoader worker died."""
    iteration = latest_iteration(save)
    stopped = STOPPING.search(log)
    assert stopped and iteration == int(stopped.group(1)) < TRAIN_ITERS, log[-4000:]
    assert verify_checkpoint(save / f"iter_{iteration:07d}")
    assert not list(save.glob("*.tmp"))
    assert "killed by signal" not in log and "Traceback" not in log, log[-4000:]
    return iteration


def signal_launch(launch: Launch, target: str, count: int = 1) -> None:
    """Send SIGTERM `count` times to `target`: the launcher, its torchrun, or the launcher's process group. A
    second one is sent once the ranks announced the stop, so it lands in (or right at) the final save;
    count 0 means again and again until the launcher has exited (a scheduler that insists)."""
    pid = launch.child() if target == "torchrun" else launch.process.pid

    def send() -> None:
        with contextlib.suppress(ProcessLookupError):
            if target == "group":
                os.killpg(pid, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGTERM)

    if count == 0:
        deadline = time.monotonic() + WAIT
        while launch.process.poll() is None and time.monotonic() < deadline:
            send()
            time.sleep(0.05)  # pacing, not a timing assertion
        return
    for n in range(count):
        if n:
            launch.wait_for(STOPPING)
        send()


# ---- pretraining through the launcher ----


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, demo_data) -> dict[int, float]:
    """The reference: the same training on 2 ranks (rapidtrain/pretrain.py, the same flags, 2 loader workers per
    rank), never signalled. It is only the losses to compare with, so it runs on a warm torchrun launch
    (tests/launch.py): the ranks forked from an agent that has imported the training stack, not started afresh as the
    signalled launches' are."""
    out = tmp_path_factory.mktemp("uninterrupted")
    pretrain(2, [*PRETRAIN_FLAGS, "--loss-log-file", str(out / "losses.txt")], warm=True, timeout=WAIT)
    losses = read_losses(out / "losses.txt")
    assert sorted(losses) == list(range(1, TRAIN_ITERS + 1))
    return losses


# Two SIGTERMs to the launcher: test_resume_after_sigterm_gives_the_uninterrupted_losses (a complete checkpoint,
# then the resume).
@pytest.mark.parametrize("target, count", [("launcher", 1), ("torchrun", 1), ("group", 1), ("group", 0)])
def test_sigterm_to_the_launch_saves_and_exits_0(target, count, tmp_path, launches, demo_data):
    save = tmp_path / "ck"
    launch = rapidtrain(PRETRAIN_FLAGS + ["--save", str(save)], tmp_path / "log.txt", launches)
    launch.started()
    signal_launch(launch, target, count)
    assert launch.finish() == 0, launch.text()[-4000:]
    assert "2 loader workers per rank" in launch.text()
    assert_complete_checkpoint(save, launch.text())


def test_resume_after_sigterm_gives_the_uninterrupted_losses(uninterrupted, tmp_path, launches, demo_data):
    """Dropout on, 2 workers: stopped by SIGTERM (twice), resumed with --load, iterations after the stop are
    bitwise the uninterrupted run's."""
    save, losses = tmp_path / "ck", tmp_path / "losses.txt"
    flags = PRETRAIN_FLAGS + ["--save", str(save), "--loss-log-file", str(losses)]
    stopped = rapidtrain(flags, tmp_path / "stopped.txt", launches)
    stopped.started()
    signal_launch(stopped, "launcher", 2)
    assert stopped.finish() == 0
    at = assert_complete_checkpoint(save, stopped.text())
    resumed = rapidtrain(flags + ["--load", str(save)], tmp_path / "resumed.txt", launches)
    assert resumed.finish() == 0, resumed.text()[-4000:]
    assert f"loaded checkpoint from {save} at iteration {at}" in resumed.text()
    after = read_losses(losses)
    assert sorted(after) == list(range(1, TRAIN_ITERS + 1))
    assert [after[i] for i in range(at + 1, TRAIN_ITERS + 1)] == [uninterrupted[i] for i in
                                                                  range(at + 1, TRAIN_ITERS + 1)]


def test_sigterm_during_setup_trains_one_iteration_and_saves(tmp_path, demo_data):
    """The handler exists from the trainer's construction: a SIGTERM before the data and model are set up is
    kept, and the run saves after its first iteration instead of dying with nothing."""
    from rapidtrain.pretrain import ENTRY, MegatronPreTrainer
    from rapidtrain.train.engine import Engine

    save = tmp_path / "ck"
    flags = [*PRETRAIN_FLAGS, "--num-workers", "0", "--save", str(save)]
    trainer = MegatronPreTrainer(Engine(argv=flags, entry=ENTRY))
    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, while the trainer is being set up
    trainer.train()
    trainer.engine.shutdown()
    assert latest_iteration(save) == 1 and verify_checkpoint(save / "iter_0000001")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the stopped trainer keeps its handler until exit


@pytest.mark.parametrize("flags, status, said", [
    (["--exit-signal-handler"], 0, STOPPING),  # stops cleanly at the end of the iteration, nothing to save
    ([], 128 + signal.SIGTERM, re.compile(r"the ranks ended on SIGTERM without saving")),  # Megatron's default
])
def test_sigterm_without_save(flags, status, said, tmp_path, launches, demo_data):
    launch = rapidtrain(PRETRAIN_FLAGS + flags, tmp_path / "log.txt", launches)
    launch.started()
    signal_launch(launch, "launcher")
    assert launch.finish() == status, launch.text()[-4000:]
    assert said.search(launch.text()) and "Traceback" not in launch.text(), launch.text()[-4000:]


@pytest.mark.parametrize("victim", ["launcher", "torchrun"])
def test_sigkilled_parent_leaves_no_rank_training(victim, tmp_path, launches, demo_data):
    """SIGKILL cannot be caught; the kernel's parent-death signal tells the child (torchrun, or the ranks) to
    stop: the ranks save and exit, and no process of the launch is left."""
    save = tmp_path / "ck"
    launch = rapidtrain(PRETRAIN_FLAGS + ["--save", str(save)], tmp_path / "log.txt", launches)
    launch.started()
    os.kill(launch.process.pid if victim == "launcher" else launch.child(), signal.SIGKILL)
    launch.finish()  # waits for every process of the launch; the launcher's own status says it was killed
    assert_complete_checkpoint(save, launch.text())


# ---- pretraining under a torchrun the user starts ----


def test_sigterm_to_plain_torchrun_saves(tmp_path, launches, demo_data):
    """`torchrun rapidtrain/pretrain.py`: torchrun sends SIGTERM to each rank's process group (the rank and its
    DataLoader workers); the workers leave it to the rank, which saves and exits 0. torchrun itself then
    reports the signal with its own traceback and status 1: that part is torchrun's, so the ranks' own output
    (--tee into --log-dir) is what is checked."""
    save, logs = tmp_path / "ck", tmp_path / "ranks"
    launch = plain_torchrun(PRETRAIN, PRETRAIN_FLAGS + ["--save", str(save)], tmp_path / "log.txt", launches,
                            ["--log-dir", str(logs), "--tee", "3"])
    launch.started()
    os.kill(launch.process.pid, signal.SIGTERM)
    launch.finish()
    ranks = sorted(logs.rglob("std*.log"))
    assert len(ranks) == 4, ranks  # stdout and stderr of 2 ranks
    assert_complete_checkpoint(save, "\n".join(path.read_text() for path in ranks))


# ---- fine-tuning: the black-box command and a Finetuner script ----


@pytest.fixture(scope="module")
def tiny_task(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """A tiny classification model (dropout 0.1) and its data: .jsonl for the black-box command, and the GLUE
    .tsv that the Finetuner template reads in a folder of its own."""
    root = tmp_path_factory.mktemp("task")
    model, data = toy.make_task("sequence_classification", root, train=200, dev=16)
    tsv = root / "tsv" / data.name
    tsv.mkdir(parents=True)
    for split in ("train", "dev"):
        records = [json.loads(line) for line in (data / f"{split}.jsonl").read_text().splitlines()]
        (tsv / f"{split}.tsv").write_text(
            "sentence\tlabel\n" + "".join(f"{r['sentence']}\t{r['label']}\n" for r in records))
    return {"black-box": (model, data), "finetuner-script": (model, tsv)}


def finetune_flags(model: Path, data: Path, save: Path) -> list[str]:
    return ["--task", "sequence_classification", "--pretrained-model-name-or-path", str(model), "--data-dir",
            str(data.parent), "--data-name", data.name, "--micro-batch-size", "2", "--global-batch-size", "4",
            "--seq-length", "32", "--lr", "1e-4", "--epochs", "2", "--log-interval", "1", "--save", str(save)]


def finetune_stopped_by_sigterm(launch: Launch, target: str, save: Path) -> int:
    """Signal a fine-tuning launch once training runs; it saves a complete checkpoint where it says it stops and
    exits 0, its 2 loader workers per rank gone with it. Returns the iteration it saved."""
    launch.started()
    signal_launch(launch, target)
    assert launch.finish() == 0, launch.text()[-4000:]
    assert "2 loader workers per rank" in launch.text()
    stopped = STOPPING.search(launch.text())
    assert stopped, launch.text()[-4000:]
    iteration = latest_iteration(save)
    assert iteration == int(stopped.group(1)) and verify_checkpoint(save / f"iter_{iteration:07d}")
    assert "killed by signal" not in launch.text() and "Traceback" not in launch.text()
    return iteration


# The black-box command signalled at the launcher: test_finetune_resume_after_sigterm_gives_the_uninterrupted_losses
# (its stopped run, with the same checks, then the resume).
def test_sigterm_while_finetuning_a_finetuner_script_saves_and_exits_0(tiny_task, tmp_path, launches):
    model, data = tiny_task["finetuner-script"]
    save = tmp_path / "ck"
    flags = ["--user-script", str(REPO / "templates" / "finetuner_template.py"), *finetune_flags(model, data, save)]
    finetune_stopped_by_sigterm(rapidtrain(flags, tmp_path / "log.txt", launches), "group", save)


def test_finetune_resume_after_sigterm_gives_the_uninterrupted_losses(tiny_task, tmp_path, launches):
    """The black-box command on 2 ranks, dropout on, 2 workers: stopped mid-epoch by one SIGTERM to the launcher
    (a complete checkpoint, exit 0), resumed with --load; every iteration after the stop is bitwise the
    uninterrupted run's."""
    model, data = tiny_task["black-box"]
    straight = tmp_path / "straight.txt"
    # The reference is only losses to compare with: the command's program (rapidtrain/finetune.py, the same flags)
    # on a warm torchrun launch of 2 ranks (tests/launch.py), as the pretraining reference above.
    torchrun(2, REPO / "rapidtrain" / "finetune.py",
             finetune_flags(model, data, tmp_path / "straight_ck") + ["--loss-log-file", str(straight)], warm=True,
             timeout=WAIT)
    save, losses = tmp_path / "ck", tmp_path / "losses.txt"
    flags = finetune_flags(model, data, save) + ["--loss-log-file", str(losses)]
    at = finetune_stopped_by_sigterm(rapidtrain(flags, tmp_path / "stopped.txt", launches), "launcher", save)
    resumed = rapidtrain(flags + ["--load", str(save)], tmp_path / "resumed.txt", launches)
    assert resumed.finish() == 0, resumed.text()[-4000:]
    expected, after = read_losses(straight), read_losses(losses)
    assert sorted(after) == sorted(expected) and at < max(expected)
    assert [after[i] for i in sorted(after) if i > at] == [expected[i] for i in sorted(expected) if i > at]
