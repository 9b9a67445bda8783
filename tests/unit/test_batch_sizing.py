"""--auto-micro-batch-size fits the micro batch into --memory-budget-gb and keeps the global batch; the plan warns
about sizes that are not multiples of 8 (64 on Ampere or newer GPUs) under fp16/bf16."""

from __future__ import annotations

import pytest

from rapidtrain.config import rules
from rapidtrain.config.arguments import parse_args
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import DeviceCapability, RunContext
from rapidtrain.train.engine import Engine

BASE = ["--train-iters", "10", "--lr", "1e-3", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--global-batch-size", "32"]


def plan_for(flags: list[str], ctx: RunContext | None = None):
    ctx = ctx or RunContext()
    args = parse_args(BASE + flags)
    rules.validate(args, ctx)
    return from_args(args, ctx)


def test_auto_micro_batch_size_takes_the_largest_divisor_that_fits_and_keeps_the_global_batch():
    plain = plan_for(["--micro-batch-size", "16"])
    state = plain.memory.total_bytes
    from rapidtrain.config.memory import activation_bytes_per_sample

    per_sample = activation_bytes_per_sample(plain.model, plain.precision, plain.switches.recompute)
    budget_gb = (state + 5.5 * per_sample) / 2**30  # micro 5 would fit, but 32 % 5 != 0: the largest divisor is 4
    plan = plan_for(["--micro-batch-size", "16", "--auto-micro-batch-size", "--memory-budget-gb", f"{budget_gb:.6f}"])
    assert plan.batches.micro_batch_size == 4
    assert plan.batches.accumulation_steps == 8
    assert plan.batches.global_batch_size == plain.batches.global_batch_size == 32
    assert plan.data.micro_batch_size == 4  # what the samplers read
    assert "micro batch: --auto-micro-batch-size: 4, the largest divisor of 32" in describe_plan(plan)
    # Full recompute keeps a layer's input instead of ~17 activations: the estimate counts it.
    recomputed = plan_for(["--recompute-granularity", "full"])
    assert activation_bytes_per_sample(plain.model, plain.precision, recomputed.switches.recompute) < per_sample


def test_without_a_global_batch_flag_the_implied_one_is_kept():
    args = parse_args([*BASE[:-2], "--micro-batch-size", "8", "--auto-micro-batch-size", "--memory-budget-gb", "0.02"])
    plan = from_args(args, RunContext())
    assert plan.batches.micro_batch_size < 8
    assert plan.batches.micro_batch_size * plan.batches.accumulation_steps == plan.batches.global_batch_size == 8


def test_the_chosen_micro_batch_reaches_the_run():
    engine = Engine(argv=BASE + ["--micro-batch-size", "8", "--auto-micro-batch-size", "--memory-budget-gb", "0.02"])
    batches = engine.plan.batches
    assert batches.micro_batch_size < 8 and batches.micro_batch_size * batches.accumulation_steps == 32
    assert engine.plan.data.micro_batch_size == batches.micro_batch_size


def test_the_activation_estimate_is_near_the_measured_bytes():
    import torch

    from rapidtrain.config.memory import activation_bytes_per_sample
    from rapidtrain.models import build_model
    from rapidtrain.parallel.recompute import count_saved_activations

    plan = plan_for([])
    model = build_model(plan.model, seed=0)
    tokens = torch.randint(0, plan.model.vocab_size, (2, plan.model.seq_length + 1))
    with count_saved_activations(model.parameters()) as kept:
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    estimate = 2 * activation_bytes_per_sample(plan.model, plan.precision, plan.switches.recompute)
    assert 0.7 < kept["bytes"] / estimate < 1.3, (kept["bytes"], estimate)


@pytest.mark.parametrize("flags, words", [
    (["--auto-micro-batch-size"], "give a positive budget"),
    (["--memory-budget-gb", "1"], "does nothing alone"),
    (["--auto-micro-batch-size", "--memory-budget-gb", "0.001"], "the global batch cannot be kept"),
])
def test_auto_micro_batch_size_problems_are_refused(flags, words):
    with pytest.raises(rules.FlagConflict) as refused:
        plan_for(flags)
    assert words in str(refused.value)


def test_sizes_not_multiples_of_8_or_64_are_warned_under_half_precision():
    odd = ["--hidden-size", "100", "--bf16", "--micro-batch-size", "4", "--seq-length", "63"]
    cpu = plan_for(odd)
    assert any("--hidden-size 100" in w and "multiple of 8" in w for w in cpu.warnings)
    assert any("--seq-length 63" in w and "--micro-batch-size 4 × --seq-length 63 = 252" in w for w in cpu.warnings)
    # A micro batch of 1 is no reason to warn: the matmuls' rows are micro batch × sequence length.
    assert not plan_for(["--bf16", "--micro-batch-size", "1"]).warnings
    ampere = RunContext(1, "cuda", capability=DeviceCapability("NVIDIA A100", True))
    args = parse_args(BASE + ["--bf16", "--micro-batch-size", "1", "--seq-length", "72"])
    warned = from_args(args, ampere).warnings
    assert any("multiple of 64" in w and "--hidden-size 64" not in w and "--seq-length 72" in w for w in warned)
    assert not [w for w in plan_for([]).warnings if "multiple of" in w]  # fp32: no warning
