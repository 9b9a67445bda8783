"""The README's commands, run in the README's order by a newcomer in a fresh folder that holds the checkout; then
the runs that save a checkpoint a second time in the same folder, as a user reruns a block: each finds its own
finished checkpoint and says it has nothing to do (the other commands only read or overwrite their outputs). The
reruns share one warm torchrun launch per number of ranks (rerun() says why).

What a test may change, and nothing else: training runs get the tiny GPT shape and a few iterations (the
README's own sizes are what `rapidtrain plan` lines and the demo test check), the files the README takes the
user to have are written here (docs.jsonl with vocab.json/merges.txt, a local Llama folder for /models/llama,
prompts.jsonl), and commands that cannot run on this machine are skipped with their reason (printed)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rapidtrain.train.demo_end import DEMO_PROMPT
from tests.compat.run_launch_scripts import results
from tests.launch import REPO, TINY_GPT_SHAPE, child_env, free_port, pretrain, read_losses, warm_agent

SKIPPED = {  # first words of a command → why it does not run here
    "bash scripts/demo.sh": "the main job itself, shortened: test_the_demo_learns_and_prints_what_the_readme_shows",
    "bash scripts/test.sh": "the suite that runs this test",
    "source .venv/bin/activate": "the test puts .venv/bin first on PATH instead",
    "wandb sync": "uploading needs a W&B login and the network",
    "mlflow ui": "a server the user opens in a browser",
    "sbatch": "no Slurm here (tests/e2e/test_slurm_sbatch.py runs the sbatch script with a stand-in srun)",
    "python -m pytest tests/gpu": "needs a CUDA device",
    "python bench/gpu_throughput.py": "needs a CUDA device",
}
RUNNER = REPO / "tests" / "compat" / "run_launch_scripts.py"  # several runs on one launch's ranks
CHECKOUT = ("rapidtrain", "scripts", "templates", "examples", "bench", "setup.py", "pyproject.toml")


def readme_commands() -> list[str]:
    """Every command of the README's ```bash blocks, in order: comments dropped, continuation lines joined."""
    commands, inside, pending = [], False, ""
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash" and not inside
            continue
        if not inside:
            continue
        text = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        pending += text[:-1] + " " if text.endswith("\\") else text
        if not text.endswith("\\"):
            if pending.strip():
                commands.append(" ".join(pending.split()))
            pending = ""
    return commands


def skip_reason(command: str) -> str | None:
    return next((why for start, why in SKIPPED.items() if command.startswith(start)), None)


def shrunk(command: str, llama: Path) -> str:
    """The README's command with a training run's work made tiny (same flags otherwise)."""
    command = re.sub(r"\s*\[[^]]*\]", "", command)  # optional flags in brackets: left out, as a reader would
    command = command.replace("/models/llama", str(llama))
    words = shlex.split(command)
    trains = any(w.endswith("pretrain.py") for w in words) or (words[0] == "rapidtrain" and "--task" in words)
    if trains and "--profile" not in words:
        words = with_value(words, "--train-iters", "3")
    elif trains:  # the traced window moved to the start (steps [2, 3), step 1 the profiler's warm-up), and 4 iterations
        words = with_value(with_value(with_value(words, "--train-iters", "4"), "--profile-step-start", "2"),
                           "--profile-step-end", "3")
    if trains and "--pretrained-model-name-or-path" not in words and "--num-layers" not in words:
        words += [*TINY_GPT_SHAPE, "--num-workers", "0", "--eval-iters", "1"]
    return shlex.join(with_value(words, "--epochs", "1"))


def with_value(words: list[str], flag: str, value: str) -> list[str]:
    return [value if before == flag else word for before, word in zip(["", *words[:-1]], words, strict=True)]


def user_inputs(folder: Path) -> Path:
    """What the README takes the user to have: documents as JSON lines with a GPT-2 BPE vocabulary, prompts, and
    a Hugging Face Llama folder (with its tokenizer) for the continued-pretraining block."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = [f"The history of {topic} begins with a for statement number {i}." for i, topic in
             enumerate(["Python", "loops", "classes", "modules", "files", "errors"] * 20)]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    (folder / "prompts.jsonl").write_text('{"prompt": "The history of"}\n{"prompt": "A for statement"}\n')
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(folder))  # vocab.json, merges.txt
    llama = folder / "hf-llama"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>")
    tokenizer.save_pretrained(llama)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(llama)
    return llama


def run(command: str, folder: Path) -> subprocess.CompletedProcess:
    port = str(free_port())
    env = child_env({"MASTER_PORT": port, "PET_MASTER_PORT": port, "WANDB_SILENT": "true"}, nproc=4)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    return subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished, waited-for children (each command's whole tree)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def native_bf16() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def refused_bf16_here(command: str, result: subprocess.CompletedProcess) -> bool:
    """--bf16 on a CPU without native bf16 is refused by name (the README says where it runs)."""
    return "--bf16" in command.split() and not native_bf16() and result.returncode == 2 and "--bf16" in result.stderr


@pytest.mark.slow
def test_readme_commands_run_in_order_and_saving_runs_run_twice(tmp_path):
    commands = readme_commands()
    assert len(commands) >= 20 and any("pretrain.py" in c for c in commands)
    for name in CHECKOUT:
        (tmp_path / name).symlink_to(REPO / name)
    llama = user_inputs(tmp_path)
    ran = []
    for command in commands:
        if why := skip_reason(command):
            print(f"skipped: {command[:60]} ({why})")
            continue
        started, cpu = time.perf_counter(), children_cpu_seconds()
        result = run(shrunk(command, llama), tmp_path)
        print(f"{time.perf_counter() - started:5.1f} s {children_cpu_seconds() - cpu:5.1f} CPU-s  {command[:100]}")
        assert result.returncode == 0 or refused_bf16_here(command, result), (
            f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        assert "Traceback" not in result.stderr, f"{command}\n{result.stderr[-3000:]}"
        ran.append(command)
    assert (tmp_path / "checkpoints" / "gpt" / "latest_checkpointed_iteration.txt").exists()
    if native_bf16():  # else generate's --bf16 is refused
        assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2  # one completion per prompt
    saving = [command for command in ran if "--save" in command.split()]
    assert len(saving) >= 4
    again = rerun(saving, llama, tmp_path)
    for number, command in enumerate(saving):
        status, output = again.get(f"again-{number}", (None, ""))
        assert status == 0 and "nothing to do" in output, f"again: {command}\n{output[-3000:]}"


def rerun(commands: list[str], llama: Path, folder: Path) -> dict[str, tuple[int, str]]:
    """The saving commands run again in the same folder, on one warm torchrun launch per number of ranks
    (tests/launch.py) that runs them one after another (tests/compat/run_launch_scripts.py): what a rerun proves is
    what it finds in its --save folder, not how its processes start, which the first pass did as written. Each
    command keeps its flags and environment (WANDB_MODE=...); each run's output is returned by its id."""
    by_ranks: dict[int, list[dict]] = {}
    environment: dict[str, str] = {}
    for number, command in enumerate(commands):
        words = shlex.split(shrunk(command, llama))
        while "=" in words[0]:  # VARIABLE=value before the command
            name, _, value = words.pop(0).partition("=")
            environment[name] = value
        assert words[0] == "torchrun" and words[3] == "rapidtrain/pretrain.py", command  # what folds here
        by_ranks.setdefault(int(words[2]), []).append({"id": f"again-{number}", "entry": "pretrain",
                                                         "argv": words[4:]})
    found: dict[str, tuple[int, str]] = {}
    for ranks, runs in by_ranks.items():
        path = folder / f"again-{ranks}.json"
        path.write_text(json.dumps(runs))
        command = [*warm_agent([str(path)]), f"--nproc-per-node={ranks}", f"--master-port={free_port()}",
                   "--run-path", "--start-method", "fork", str(RUNNER), str(path)]
        result = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=900,
                                env=child_env({"PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", **environment},
                                              nproc=ranks))
        found.update(results(result.stdout))
        assert result.returncode == 0, f"{runs}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return found


def demo_block() -> list[str]:
    """The README's example of what `bash scripts/demo.sh` prints (the block under "What the demo prints"), without
    its "..." lines of left-out output."""
    section = (REPO / "README.md").read_text().split("### What the demo prints", 1)[1]
    block = section.split("```\n", 2)[1]
    return [line for line in block.splitlines() if line.strip() not in ("", "...")]


NUMBER = r"-?[\d.,]+(?:E[-+]\d+)?"


def shown_as(line: str) -> re.Pattern:
    """A README line as a pattern of what the demo prints: its numbers may differ (another run, another machine),
    "..." stands for output left out, and a sample's text for any continuation of the prompt."""
    line = " ".join(line.split())
    if line.startswith(DEMO_PROMPT):
        return re.compile(re.escape(DEMO_PROMPT) + ".*")
    pieces = []
    for part in line.split("..."):
        pieces.append("".join(NUMBER if re.fullmatch(NUMBER, word) else re.escape(word)
                              for word in re.split(f"({NUMBER})", part)))
    pattern = ".*".join(pieces)
    # Whether the loss is under the baseline and the target reached depends on the length of training: a shortened
    # run says the same line with the other words.
    pattern = pattern.replace(re.escape("nats under"), "nats (?:under|above)")
    verdict = pattern.find(re.escape("; the demo's target"))
    return re.compile(pattern[:verdict] + ";.*" if verdict >= 0 else pattern)


@pytest.mark.slow
def test_the_demo_learns_and_prints_what_the_readme_shows(tmp_path, demo_data):
    """scripts/demo.sh's run (its flags, the demo's model and schedule) cut to 60 iterations: the loss falls clearly
    from ln(vocabulary), and the run ends as the README shows: the loss against the unigram baseline, a greedy and a
    sampled continuation, the loss curve (a PNG) and where the files are. The whole demo's target is measured in
    docs/first-hour.md, not here (it takes minutes)."""
    from rapidtrain.data.demo import TOKENIZER_VOCAB_SIZE, unigram_entropy

    demo_sh = (REPO / "scripts" / "demo.sh").read_text()
    flags = [flag for flag in ("--mixed-precision",) if flag in demo_sh]
    # Relative to the checkout, as demo.sh writes them (runs/ is ignored by git), and removed after.
    losses_file, run = tmp_path / "losses.txt", Path("runs") / f"demo-test-{os.getpid()}"
    try:
        result = pretrain(1, [*flags, "--save", str(run / "checkpoint"), "--tensorboard-dir", str(run / "logs"),
                              "--train-iters", "60", "--eval-interval", "30", "--log-interval", "30",
                              "--loss-log-file", str(losses_file)], timeout=1500)
        curve = REPO / run / "logs" / "loss_curve.png"
        drawn = "matplotlib is not installed" not in result.stdout
        assert not drawn or (curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(curve) in result.stdout)
    finally:
        shutil.rmtree(REPO / run, ignore_errors=True)
        with contextlib.suppress(OSError):  # runs/ itself, unless something else is in it
            (REPO / "runs").rmdir()
    losses = read_losses(losses_file)
    assert abs(losses[1] - math.log(TOKENIZER_VOCAB_SIZE)) < 1.0  # starts near ln(vocab)
    assert sum(losses[i] for i in range(51, 61)) / 10 < losses[1] - 1.0  # and clearly learns
    printed = [" ".join(line.split()) for line in result.stdout.splitlines()]
    for line in demo_block():
        pattern = shown_as(line)
        assert any(pattern.fullmatch(out) for out in printed), f"README {line!r} not printed:\n{result.stdout[-4000:]}"
    entropy = unigram_entropy(demo_data.data_prefix)
    assert f"under the corpus's unigram entropy of {entropy:.2f}" in result.stdout or \
        f"above the corpus's unigram entropy of {entropy:.2f}" in result.stdout


def test_the_readme_shows_the_demo_models_plan_line(capsys):
    """The README's model line is the plan's for the demo's defaults (the shortened run above only checks its form)."""
    from rapidtrain.cli import plan_command

    assert plan_command(["--mixed-precision"]) == 0
    planned = capsys.readouterr().out
    shown = [line for line in demo_block() if line.strip().startswith("model: ")]
    assert shown and all(line in planned for line in shown)
