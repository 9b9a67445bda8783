"""Resume at any iteration continues bitwise under every 2-rank layout: drawn, not replayed at one stop point.

tests/e2e/test_resume_search.py searches the switches of one process; this draws the layout too (DDP, FSDP, SDP,
OSS, ZeRO-1/2/3, ZeRO-2 with CPU offload, TP 2, PP 2, EP 2 with MoE) with the optimizer, fp16 loss scaling (not
under DeepSpeed, which refuses fp16 on the CPU), dropout, DataLoader workers, accumulation, the stop iteration and
the architecture (GPT-2's or Llama's).
Every draw trains three runs (uninterrupted; stopped there with a checkpoint; resumed with --load) in one torchrun
launch. The draws come from a fixed seed, so CI sees the same ones; RESUME_SEARCH_LAYOUTS_SEED and
RESUME_SEARCH_LAYOUTS_EXAMPLES search elsewhere and wider."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tests.launch import ARCHITECTURES, TINY_GPT_SHAPE, read_grad_norms, read_losses, torchrun

RUNS = Path(__file__).with_name("pretrain_runs.py")
ITERATIONS = 6
BASE = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--eval-iters", "0", "--log-interval", "100", "--lr", "1e-3",
        "--lr-warmup-iters", "2", "--train-iters", str(ITERATIONS)]
LAYOUTS = {
    "ddp": [],
    "fsdp": ["--fsdp-memory-optimization"],
    "sdp": ["--oss-sdp-memory-optimization"],
    "oss": ["--oss-memory-optimization"],
    "zero1": ["--zero-1-memory-optimization"],
    "zero2": ["--zero-2-memory-optimization"],
    "zero3": ["--zero-3-memory-optimization"],
    "zero2_offload": ["--zero-2-memory-optimization", "--cpu-offload"],  # DeepSpeedCPUAdam
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "ep2": ["--num-experts", "2", "--expert-model-parallel-size", "2", "--moe-loss-coeff", "0.01"],
}
DEEPSPEED = ("zero1", "zero2", "zero3", "zero2_offload")
DTENSORS = ("fsdp", "sdp", "tp2")  # refused with Adafactor (rule adafactor-plain-tensors)
OPTIMIZERS = {"adamw": [], "sgd": ["--optimizer", "sgd", "--sgd-momentum", "0.9"],
              "adafactor": ["--optimizer", "adafactor"]}
FP16 = ["--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "2", "--loss-scale-window", "2"]
# CI's seed: its four draws are EP 2 (SGD), ZeRO-3 (Llama, dropout and workers), FSDP in fp16 stopped at iteration 1
# (saved before any step) and PP 2 (Adafactor); both architectures, three optimizers, four stop points.
SEED = int(os.environ.get("RESUME_SEARCH_LAYOUTS_SEED", "14"))
EXAMPLES = int(os.environ.get("RESUME_SEARCH_LAYOUTS_EXAMPLES", "4"))


def draw(rng: random.Random) -> dict:
    layout = rng.choice(sorted(LAYOUTS))
    return {
        "layout": layout,
        "optimizer": "adamw" if layout in DEEPSPEED else rng.choice(
            [name for name in sorted(OPTIMIZERS) if not (name == "adafactor" and layout in DTENSORS)]),
        "fp16": layout not in DEEPSPEED and rng.random() < 0.5,
        "dropout": rng.choice(["0", "0.1"]),
        "workers": rng.choice(["0", "2"]),
        "global_batch": rng.choice(["4", "8"]),
        "stop": rng.randint(1, ITERATIONS - 1),
        "architecture": rng.choice(sorted(ARCHITECTURES)),
    }


def flags_of(c: dict) -> list[str]:
    return [*BASE, *LAYOUTS[c["layout"]], *OPTIMIZERS[c["optimizer"]], *(FP16 if c["fp16"] else []),
            "--hidden-dropout", c["dropout"], "--attention-dropout", c["dropout"], "--num-workers", c["workers"],
            "--global-batch-size", c["global_batch"], *ARCHITECTURES[c["architecture"]]]


def draws() -> list[dict]:
    """Distinct draws (layout first: every layout before any repeats, when there are enough examples)."""
    rng = random.Random(SEED)
    chosen: list[dict] = []
    while len(chosen) < EXAMPLES:
        candidate = draw(rng)
        if len({c["layout"] for c in chosen} | {candidate["layout"]}) > len(chosen) or len(chosen) >= len(LAYOUTS):
            chosen.append(candidate)
    return chosen


@pytest.fixture(scope="module")
def searched(tmp_path_factory, demo_data) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("resume_layouts")
    examples, runs = draws(), []
    for index, c in enumerate(examples):
        flags, save = flags_of(c), out / f"{index}_ck"
        runs.append(flags + ["--loss-log-file", str(out / f"{index}_straight.txt")])
        resumed = ["--loss-log-file", str(out / f"{index}_resumed.txt"), "--save", str(save)]
        runs.append(flags + resumed + ["--exit-interval", str(c["stop"])])
        runs.append(flags + resumed + ["--load", str(save)])
    (out / "runs.json").write_text(json.dumps(runs))
    torchrun(2, RUNS, [str(out / "runs.json")], timeout=1500, warm=True)
    return out, examples


@pytest.mark.slow
@pytest.mark.parametrize("index", range(EXAMPLES))
def test_resume_at_the_drawn_iteration_continues_bitwise(searched, index):
    out, examples = searched
    c = examples[index]
    straight, resumed = out / f"{index}_straight.txt", out / f"{index}_resumed.txt"
    expected, got = read_losses(straight), read_losses(resumed)
    assert sorted(got) == sorted(expected) == list(range(1, ITERATIONS + 1)), c
    later = range(c["stop"] + 1, ITERATIONS + 1)
    assert [got[i] for i in later] == [expected[i] for i in later], c
    norms, expected_norms = read_grad_norms(resumed), read_grad_norms(straight)
    assert {i: norms.get(i) for i in later} == {i: expected_norms.get(i) for i in later}, c
