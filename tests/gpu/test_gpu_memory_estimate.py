"""The plan's peak memory per rank against what a real one-GPU run allocates (torch.cuda.max_memory_allocated, the
log line's "peak memory"), in the modes a GPU user trains in, at a size where the model's tensors dominate the
allocator's own (GPT-2 small's shape, 124M parameters at vocabulary 50k; here the demo corpus's vocabulary):
within ±15%, as the CPU test (tests/distributed/test_memory_estimate.py) holds every layout to.

On the GPU this also checks what the CPU test cannot see: the temporaries inside an operator and the allocator's
rounding, with CUDA's large blocks of the chunked loss."""

from __future__ import annotations

import dataclasses
import re

import pytest

from rapidtrain.config import rules
from rapidtrain.config.arguments import parse_args
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext
from tests.gpu.test_gpu_modes import log_lines, torchrun_pretrain

GPT2_SMALL = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "1024",
              "--max-position-embeddings", "1024", "--micro-batch-size", "8", "--global-batch-size", "8",
              "--train-iters", "4", "--lr", "1e-4", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0"]
MODES = {
    "fp32": [],
    "bf16": ["--bf16"],  # autocast over fp32 weights: 16-bit copies of every matrix
    "bf16_recompute": ["--bf16", "--recompute-activations"],
    "bf16_full_recompute": ["--bf16", "--recompute-granularity", "full", "--recompute-method", "uniform"],
    "zero2_bf16": ["--bf16", "--zero-2-memory-optimization"],  # DeepSpeed's 16-bit weights: no copies
    # The default 2^32 scale overflows the first steps, which are skipped before the optimizer allocates its state.
    "fp16": ["--fp16", "--initial-loss-scale", "65536"],
}


def measured_peak_bytes(stdout: str) -> float:
    peaks = [float(m.group(1)) for line in log_lines(stdout) if (m := re.search(r"peak memory \(MB\): ([\d.]+)", line))]
    assert peaks, stdout[-3000:]
    return max(peaks) * 2**20


@pytest.mark.parametrize("mode", list(MODES))
def test_peak_memory_on_one_gpu_is_estimated_within_15_percent(mode, demo_data):
    flags = GPT2_SMALL + MODES[mode]
    run = torchrun_pretrain(flags)
    ctx = dataclasses.replace(RunContext.detect(), world_size=1)  # the run is one process, whatever the GPUs
    args = parse_args(flags)
    rules.validate(args, ctx)
    memory = from_args(args, ctx).memory
    assert memory is not None
    measured = measured_peak_bytes(run.stdout)
    mib = 2**20
    detail = (mode, f"measured {measured / mib:.0f} MiB", f"estimate {memory.peak_bytes_per_rank / mib:.0f} MiB",
              f"states {memory.stage_state_bytes[0] / mib:.0f}",
              f"activations {memory.stage_activation_bytes[0] / mib:.0f}")
    assert measured == pytest.approx(memory.peak_bytes_per_rank, rel=0.15), detail
