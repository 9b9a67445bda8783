"""The main job end to end: real torchrun, the demo corpus, exact resume, clean stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from tests.launch import PRETRAIN, REPO, TINY_GPT_SHAPE, child_env, free_port, pretrain, read_losses, torchrun

TINY = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--global-batch-size", "4", "--num-workers", "0",
        "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3", "--lr-warmup-iters", "1",
        "--lr-decay-style", "cosine"]


PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}
RUNS = REPO / "tests" / "distributed" / "pretrain_runs.py"


def test_resume_continues_with_identical_losses(tmp_path, demo_data):
    """Interrupted at iteration 4 and resumed with --load in a new process: iterations 5..8 print bitwise the same
    losses, in fp32 and in bf16.

    Dropout stays on (0.1), so the RNG state must be restored too, and accumulation is 2 micro-batches. Two torchrun
    launches (pretrain_runs.py, ranks forked warm) instead of six: the uninterrupted and the stopped runs of both
    precisions in the first, the resumed ones in the second, so each resume still starts in a fresh process.
    """

    def log(precision: str, name: str) -> list[str]:
        return ["--loss-log-file", str(tmp_path / f"{precision}_{name}.txt")]

    def run_all(runs: list[list[str]]) -> str:
        (tmp_path / "runs.json").write_text(json.dumps(runs))
        return torchrun(1, RUNS, [str(tmp_path / "runs.json")], warm=True).stdout

    eight = {name: TINY + flags + ["--train-iters", "8"] for name, flags in PRECISIONS.items()}
    first = run_all([eight[name] + log(name, "full") for name in PRECISIONS]
                    + [eight[name] + log(name, "resumed") + ["--exit-interval", "4", "--save", str(tmp_path / name)]
                       for name in PRECISIONS])
    assert first.count("exiting at iteration 4") == len(PRECISIONS)
    second = run_all([eight[name] + log(name, "resumed") + ["--load", str(tmp_path / name)] for name in PRECISIONS])
    assert second.count("loaded checkpoint") == len(PRECISIONS)
    for name in PRECISIONS:
        assert (tmp_path / name / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
        expected, got = read_losses(tmp_path / f"{name}_full.txt"), read_losses(tmp_path / f"{name}_resumed.txt")
        assert sorted(got) == list(range(1, 9)), name
        assert [got[i] for i in range(5, 9)] == [expected[i] for i in range(5, 9)], name


def test_loading_a_checkpoint_of_another_model_is_refused(tmp_path, demo_data):
    pretrain(1, TINY + ["--train-iters", "3", "--save", str(tmp_path / "ck")], warm=True)
    wider = [a if a != "64" else "128" for a in TINY]  # hidden 128 (and seq 128)
    result = pretrain(1, wider + ["--train-iters", "4", "--load", str(tmp_path / "ck")], check=False, warm=True)
    assert result.returncode != 0
    assert "--hidden-size (checkpoint 64, now 128)" in result.stdout + result.stderr


def test_sigterm_saves_then_exits_cleanly(tmp_path, demo_data):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}",
               str(PRETRAIN), *TINY, "--train-iters", "100000", "--save", str(tmp_path / "ck")]
    process = subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    # Wait for training to be under way (a log line), then ask it to stop as a scheduler would.
    output = ""
    for line in process.stdout:
        output += line
        if "iteration        3/" in line:
            break
    os.kill(process.pid, signal.SIGTERM)
    output += process.communicate(timeout=300)[0]
    iteration = int((tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text())
    assert iteration >= 3
    assert (tmp_path / "ck" / f"iter_{iteration:07d}" / ".metadata").exists()
    assert "saved checkpoint" in output


def test_non_finite_loss_stops_with_the_iteration_and_saves_nothing(tmp_path, demo_data):
    result = pretrain(1, TINY + ["--train-iters", "6", "--lr", "1e30", "--clip-grad", "0", "--save",
                                 str(tmp_path / "ck"), "--save-interval", "100"], check=False)
    assert result.returncode != 0
    assert "stops before the optimizer step" in result.stdout + result.stderr
    assert not (tmp_path / "ck" / "latest_checkpointed_iteration.txt").exists()


def test_rapidtrain_command_starts_torchrun_itself(tmp_path, demo_data):
    losses_file = tmp_path / "losses.txt"
    result = subprocess.run([os.path.join(sys.prefix, "bin", "rapidtrain"), *TINY, "--train-iters", "2",
                             "--nproc-per-node", "2", "--loss-log-file", str(losses_file)],
                            capture_output=True, text=True, cwd=REPO, timeout=600,
                            env=child_env({"MASTER_PORT": str(free_port())}, nproc=2))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world 2 = data 2 × tensor 1 × pipeline 1" in result.stdout
    assert sorted(read_losses(losses_file)) == [1, 2]


def test_gpt_launch_script_runs_and_resumes_from_its_own_save(tmp_path, demo_data):
    env = child_env({"NPROC": "1", "TRAIN_ITERS": "3", "NUM_LAYERS": "2", "HIDDEN": "64", "HEADS": "4", "SEQ": "64",
                      "MICRO": "2", "LOG_INTERVAL": "1", "EVAL_INTERVAL": "3", "EVAL_ITERS": "1", "SAVE_INTERVAL": "2",
                      "SAVE": str(tmp_path / "gpt"), "EXTRA": "--num-workers 0", "MASTER_PORT": str(free_port())})
    result = subprocess.run(["bash", "scripts/pretrain_gpt.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "iteration        3/       3" in result.stdout
    assert (tmp_path / "gpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_all_launch_scripts_parse():
    for script in sorted((REPO / "scripts").glob("*.sh")):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script


def test_a_run_with_loader_workers_and_evaluations_exits(tmp_path, demo_data):
    """The evaluation loaders' persistent workers ignore SIGTERM; they are stopped when training ends, or
    multiprocessing's exit handler (terminate with SIGTERM, then join) waits on them forever."""
    flags = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--num-workers", "2", "--train-iters", "4",
             "--eval-interval", "2", "--eval-iters", "1", "--lr", "1e-3", "--log-interval", "2"]
    run = pretrain(1, flags, timeout=300)
    assert "validation loss at iteration 4" in run.stdout and "test loss at iteration 4" in run.stdout
