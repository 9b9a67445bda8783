"""CPU allocator tuning: the Engine keeps freed tensor memory in the heap on CPU, so training steps stop
faulting the same pages in again; `--no-cpu-allocator-tuning` leaves glibc as it is.

Page faults are counted by the kernel (getrusage), not timed, so the comparison is not at the mercy of a
shared machine's load. Each case runs in its own process: mallopt settings cannot be undone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rapidtrain.config import arguments, plan
from rapidtrain.config.settings import RunContext
from rapidtrain.core.cpu_allocator import glibc_version

REPO = Path(__file__).resolve().parents[2]

# Ten training steps of a small GPT (logits and their gradients are ~16 MiB, like a real step's largest
# blocks); prints the minor page faults of each step.
STEPS = """
import json, resource, sys, torch
from rapidtrain.train.engine import Engine
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
Engine(argv=["--train-iters", "1", "--lr", "1e-4", *sys.argv[1:]])
model = build_model(ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128,
                                max_position_embeddings=128, vocab_size=8064), seed=1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
tokens = torch.randint(0, 8064, (4, 128))
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(tokens, labels=tokens).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def faults_per_step(*flags: str) -> list[int]:
    result = subprocess.run(
        [sys.executable, "-c", STEPS, *flags], capture_output=True, text=True, cwd=REPO, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(glibc_version() is None, reason="the tuning is glibc's mallopt")
def test_tuned_steps_fault_far_fewer_pages_than_glibc_defaults():
    tuned = faults_per_step()
    untouched = faults_per_step("--no-cpu-allocator-tuning")
    # The first step faults everything in either way; after it, glibc's defaults unmap and re-fault the
    # large blocks (~60,000–100,000 faults over nine steps here), the tuned heap reuses them (~3,000–10,000).
    assert tuned[0] > 1000 and untouched[0] > 1000
    assert sum(tuned[1:]) * 3 < sum(untouched[1:]), (tuned, untouched)


def test_the_plan_names_the_allocator_on_cpu_only():
    def engines(argv: list[str], device: str) -> dict[str, str]:
        args = arguments.parse_args(["--train-iters", "10", "--lr", "1e-4", *argv])
        resolved = plan.from_args(args, RunContext(1, device))  # type: ignore[arg-type]
        return {choice.switch: choice.engine for choice in resolved.engines}

    on_cpu = engines([], "cpu")
    if glibc_version():
        assert on_cpu["CPU allocator"].startswith("glibc malloc keeps freed blocks")
    else:
        assert "CPU allocator" not in on_cpu
    assert "CPU allocator" not in engines(["--no-cpu-allocator-tuning"], "cpu")
    assert "CPU allocator" not in engines([], "cuda")


def test_the_engine_acts_on_the_plans_switch():
    """The Engine tunes the allocator when the plan's switch says so (it reads the plan, not the flags)."""
    def switch(argv: list[str], device: str) -> bool:
        args = arguments.parse_args(["--train-iters", "10", "--lr", "1e-4", *argv])
        return plan.from_args(args, RunContext(1, device)).switches.cpu_allocator_tuning  # type: ignore[arg-type]

    assert switch([], "cpu") and not switch(["--no-cpu-allocator-tuning"], "cpu") and not switch([], "cuda")
