"""--auto-micro-batch-size fits the micro batch into --memory-budget-gb and keeps the global batch; the plan warns
about sizes that are not multiples of 8 (64 on Ampere or newer GPUs) under fp16/bf16."""

from __future__ import annotations

import dataclasses

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


def activations_of(plan, micro: int = 1, chunked: bool = False) -> float:
    """`chunked`: the run's chunked head and loss (the measuring hooks below keep models on the plain path)."""
    from rapidtrain.config.memory import activation_context, with_peak

    act = activation_context(plan.model, plan.precision, plan.layout, plan.switches, "cpu")
    return with_peak(plan.memory, plan.model, micro, 1, plan.layout, plan.switches.recompute,
                     dataclasses.replace(act, chunked_loss=chunked)).stage_activation_bytes[0]


def test_auto_micro_batch_size_takes_the_largest_divisor_that_fits_and_keeps_the_global_batch():
    # bf16: the chunked loss keeps its 16-bit logits at every micro batch, so activations grow linearly with it (in
    # fp32 it keeps the logits only while one chunk holds them all, which a larger micro batch passes).
    plain = plan_for(["--micro-batch-size", "16", "--bf16"])
    state = plain.memory.total_bytes
    per_sample = activations_of(plain, chunked=True)
    budget_gb = (state + 5.5 * per_sample) / 2**30  # micro 5 would fit, but 32 % 5 != 0: the largest divisor is 4
    plan = plan_for(["--micro-batch-size", "16", "--bf16", "--auto-micro-batch-size", "--memory-budget-gb",
                     f"{budget_gb:.6f}"])
    assert plan.batches.micro_batch_size == 4
    assert plan.batches.accumulation_steps == 8
    assert plan.batches.global_batch_size == plain.batches.global_batch_size == 32
    assert plan.data.micro_batch_size == 4  # what the samplers read
    assert "micro batch: --auto-micro-batch-size: 4, the largest divisor of 32" in describe_plan(plan)
    # Full recompute keeps a layer's input instead of ~17 activations: the estimate counts it.
    assert activations_of(plan_for(["--recompute-granularity", "full", "--bf16"]), chunked=True) < per_sample


def test_auto_micro_batch_size_counts_tensor_and_sequence_parallelism():
    """GPT-3 175B at TP 8 × PP 16 on 80 GB GPUs (Korthikanti et al.'s setting) fits: each rank keeps 1/8 of the
    activations, and the first stage keeps the pipeline depth's 16 micro-batches of its 6 layers."""
    gpt3 = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size",
            "16", "--global-batch-size", "1536", "--bf16", "--recompute-activations", "--micro-batch-size", "4",
            "--auto-micro-batch-size", "--memory-budget-gb", "80"]
    a100 = RunContext(1024, "cuda", capability=DeviceCapability("NVIDIA A100-SXM4-80GB", True))
    args = parse_args([*BASE[:6], *gpt3, "--sequence-parallel"])
    rules.validate(args, a100)
    with_sp = from_args(args, a100)
    assert with_sp.batches.micro_batch_size >= 1
    first, last = with_sp.memory.stage_activation_bytes[0], with_sp.memory.stage_activation_bytes[-1]
    # Stage 0: 96 layers' worth (16 micro-batches × 6 layers) of 34·s·b·h/t + 4·s·b·h bytes (Korthikanti et al.'s
    # 34/t, with the two norms' inputs in fp32, autocast's residual stream, and the attention's and MLP's 16-bit
    # inputs whole: DTensor's linears save the all-gathered input, where Megatron gathers it again in backward), plus
    # the embedding's share, plus autocast's bf16 copies of its 6 layers' fp32 matrices (12·h² each, split by t; one
    # copy for all micro-batches: Megatron keeps bf16 weights and has none), and backward's working set in one layer
    # (under 1% here).
    s, h, b = 2048, 12288, with_sp.batches.micro_batch_size
    copies = 6 * 12 * h * h / 8 * 2
    assert first == pytest.approx(96 * (34 / 8 + 4) * s * b * h + copies, rel=0.02)
    # one micro-batch in flight on the last stage (plus the loss's log-softmax), beside the same weight copies
    assert last - copies < (first - copies) / 8
    without_sp = from_args(parse_args([*BASE[:6], *gpt3]), a100)  # the norms' inputs and masks replicated
    assert without_sp.batches.micro_batch_size <= with_sp.batches.micro_batch_size


# BASE's model (2 layers, hidden 64, seq 64, the demo tokenizer's vocabulary padded to 2,048) peaks at 12.0 MiB per
# rank with micro batch 4 and 20.0 MiB with 8 (the plan's estimate): a budget of 15.4 MiB takes 4 of a wanted 8.
BELOW_MICRO_8 = ["--memory-budget-gb", "0.015"]


def test_without_a_global_batch_flag_the_implied_one_is_kept():
    args = parse_args([*BASE[:-2], "--micro-batch-size", "8", "--auto-micro-batch-size", *BELOW_MICRO_8])
    plan = from_args(args, RunContext())
    assert plan.batches.micro_batch_size < 8
    assert plan.batches.micro_batch_size * plan.batches.accumulation_steps == plan.batches.global_batch_size == 8


def test_the_chosen_micro_batch_reaches_the_run():
    engine = Engine(argv=BASE + ["--micro-batch-size", "8", "--auto-micro-batch-size", *BELOW_MICRO_8])
    batches = engine.plan.batches
    assert batches.micro_batch_size < 8 and batches.micro_batch_size * batches.accumulation_steps == 32
    assert engine.plan.data.micro_batch_size == batches.micro_batch_size


@pytest.mark.parametrize("flags", [[], ["--hidden-dropout", "0", "--attention-dropout", "0"],
                                   ["--recompute-granularity", "full"], ["--recompute-activations"]])
def test_the_activation_estimate_is_near_the_measured_bytes(flags):
    """Measured: the storages the forward pass creates that are still alive before backward (what autograd and a
    checkpointed region keep), parameters excluded; two samples."""
    import torch

    from rapidtrain.models import build_model
    from rapidtrain.parallel.recompute import apply_recompute, count_saved_activations
    from rapidtrain.parallel.transforms import transformer_blocks

    plan = plan_for(flags)
    model = build_model(plan.model, seed=0)
    if plan.switches.recompute.enabled:
        apply_recompute(model, transformer_blocks(model), plan.switches.recompute)
    tokens = torch.randint(0, plan.model.vocab_size, (2, plan.model.seq_length + 1))
    with count_saved_activations(model.parameters()) as kept:
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    # The estimate counts the peak at the loss's backward: three fp32 [tokens, vocabulary] tensors, of which forward
    # keeps one (the log-softmax; the measuring hooks keep the model on the plain path).
    estimate = activations_of(plan, micro=2) - 2 * (2 * plan.model.seq_length * plan.model.vocab_size * 4)
    assert 0.85 < kept["bytes"] / estimate < 1.15, (kept["bytes"], estimate)


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
