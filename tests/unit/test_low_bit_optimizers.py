"""8-bit and 4-bit AdamW and every optimizer's state: the library the plan picks per layout (bitsandbytes for plain
tensors, torchao for DTensors), refusals that say why, and state bytes per parameter measured on real optimizers
after one step against the plan's estimate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rapidtrain.config import arguments, rules
from rapidtrain.config.memory import optimizer_state_bytes_per_parameter
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from rapidtrain.optim import optimizers
from rapidtrain.optim.optimizers import OptimizerSettings, OptimizerUnavailable, build_optimizer, resolve_optimizer
from rapidtrain.optim.state_bytes import measured_state_bytes, optimizer_state_bytes

# Hidden 64: the matrices pass the 4096-element threshold of block-wise 8-bit state, norms and biases do not.
CONFIG = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=128,
                     hidden_dropout=0.0, attention_dropout=0.0)


def one_step(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
    optimizer, _ = build_optimizer(model, settings, "cpu")
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length), generator=torch.Generator().manual_seed(0))
    model(tokens, labels=tokens).float().mean().backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize(
    "name, low, high",
    [
        ("adamw", 8.0, 8.01),  # two fp32 moments (and a 4-byte step per tensor)
        ("apex_lamb", 8.0, 8.01),  # rapidtrain's LAMB keeps apex's fp32 moments
        ("sgd", 4.0, 4.0),  # the momentum buffer
        ("adafactor", 0.05, 0.5),  # row and column means of each matrix; full variance of vectors only
        ("adamw_8bit", 2.0, 2.6),  # uint8 moments + a scale per 256 elements; small tensors stay fp32
    ],
)
def test_state_bytes_after_one_step_equal_the_plans_estimate(name, low, high):
    model = build_model(CONFIG, seed=1)
    settings = OptimizerSettings(name=name, lr=1e-3)
    optimizer = one_step(model, settings)
    parameters = sum(p.numel() for p in model.parameters())
    measured = measured_state_bytes(optimizer) / parameters
    assert measured == pytest.approx(optimizer_state_bytes_per_parameter(CONFIG, settings, "cpu"), rel=1e-12)
    assert low <= measured <= high


@pytest.mark.slow  # torchao compiles its step once per parameter shape (seconds each on CPU)
def test_torchao_4bit_state_bytes_equal_the_estimate():
    torch.manual_seed(0)
    model = nn.Linear(64, 128)  # weight quantised (8192 elements), bias kept in fp32
    settings = OptimizerSettings(name="adamw_4bit", lr=1e-3)
    optimizer, description = build_optimizer(model, settings, "cpu")
    assert description.startswith("torchao AdamW4bit")
    model(torch.randn(4, 64)).square().mean().backward()
    optimizer.step()
    estimate = optimizer_state_bytes("torchao_4bit", [(128, 64), (128,)])
    assert measured_state_bytes(optimizer) == estimate
    # 4-bit moments: 2 × 0.5 bytes + scales and maps, against AdamW's 8.
    assert estimate / (128 * 64 + 128) < 1.5


def test_adamw_8bit_trains_like_adamw_on_one_step():
    """The 8-bit moments quantise Adam's state, not its update rule: after one step (m = (1-β1)·g, v = (1-β2)·g²,
    both exactly representable up to the block scale) the weights move as AdamW's do, to quantisation error."""
    reference, low_bit = build_model(CONFIG, seed=1), build_model(CONFIG, seed=1)
    one_step(reference, OptimizerSettings(name="adamw", lr=1e-3))
    one_step(low_bit, OptimizerSettings(name="adamw_8bit", lr=1e-3))
    start = build_model(CONFIG, seed=1)
    for (name, a), b, s in zip(reference.named_parameters(), low_bit.parameters(), start.parameters(), strict=True):
        moved = (a - s).abs().max()
        assert (a - b).abs().max() <= 0.05 * moved + 1e-7, name


def plan_for(flags: list[str], world: int = 1, device: str = "cpu"):
    args = arguments.parse_args(["--train-iters", "10", "--lr", "1e-4", *flags])
    ctx = RunContext(world, device)  # type: ignore[arg-type]
    rules.validate(args, ctx)
    return from_args(args, ctx)


@pytest.mark.parametrize(
    "flags, world, library",
    [
        ([], 1, "bitsandbytes AdamW8bit"),
        ([], 2, "bitsandbytes AdamW8bit"),  # DDP
        (["--oss-memory-optimization"], 2, "bitsandbytes AdamW8bit"),
        (["--zero-2-memory-optimization"], 2, "bitsandbytes AdamW8bit"),  # DeepSpeed's flat fp32 partitions
        (["--fsdp-memory-optimization"], 2, "torchao AdamW8bit"),
        (["--oss-sdp-memory-optimization"], 2, "torchao AdamW8bit"),
        (["--tensor-model-parallel-size", "2"], 2, "torchao AdamW8bit"),
        (["--pipeline-model-parallel-size", "2", "--num-layers", "2"], 4, "bitsandbytes AdamW8bit"),  # DDP per stage
        (["--pipeline-model-parallel-size", "2", "--num-layers", "2", "--tensor-model-parallel-size", "2"], 8,
         "torchao AdamW8bit"),  # replicate beside TP
        (["--pipeline-model-parallel-size", "2", "--num-layers", "2"], 2, "bitsandbytes AdamW8bit"),  # no DP
    ],
)
def test_adamw_8bit_library_follows_the_layout(flags, world, library):
    plan = plan_for(["--optimizer", "adamw_8bit", *flags], world)
    assert plan.engine_for("optimizer").engine.startswith(library)
    assert plan.optimizer.dtensor_parameters == library.startswith("torchao")
    # The plan's settings build what the plan says (the same resolution).
    assert resolve_optimizer(plan.optimizer, "cpu").description == plan.engine_for("optimizer").engine


def test_paged_adamw_8bit_is_refused_on_cpu_and_served_by_bitsandbytes_on_cuda():
    with pytest.raises(rules.FlagConflict) as refused:
        plan_for(["--optimizer", "paged_adamw_8bit"])
    assert "CUDA unified memory" in str(refused.value) and "--optimizer adamw_8bit" in str(refused.value)
    assert plan_for(["--optimizer", "paged_adamw_8bit"], device="cuda").engine_for("optimizer").engine.startswith(
        "bitsandbytes PagedAdamW8bit")
    with pytest.raises(rules.FlagConflict, match="bitsandbytes' kernels take plain tensors"):
        plan_for(["--optimizer", "paged_adamw_8bit", "--fsdp-memory-optimization"], 2, "cuda")


def test_without_either_library_adamw_8bit_is_refused_with_the_reasons(monkeypatch):
    # Stand-in for a machine where neither package is installed (both are here).
    monkeypatch.setattr(optimizers, "_version", lambda package: None)
    with pytest.raises(rules.FlagConflict) as refused:
        plan_for(["--optimizer", "adamw_8bit"])
    message = str(refused.value)
    assert "bitsandbytes is not installed" in message and "torchao is not installed" in message
    with pytest.raises(OptimizerUnavailable, match="--optimizer adamw_8bit"):
        build_optimizer(nn.Linear(2, 2), OptimizerSettings(name="adamw_8bit"), "cpu")


def test_without_bitsandbytes_torchao_serves_plain_tensors(monkeypatch):
    real = optimizers._version
    monkeypatch.setattr(optimizers, "_version", lambda package: None if package == "bitsandbytes" else real(package))
    assert plan_for(["--optimizer", "adamw_8bit"]).engine_for("optimizer").engine.startswith("torchao AdamW8bit")


def test_plan_counts_adafactor_factored_state_not_zero():
    adafactor = plan_for(["--optimizer", "adafactor"]).memory
    adamw = plan_for(["--optimizer", "adamw"]).memory
    eight_bit = plan_for(["--optimizer", "adamw_8bit"]).memory
    assert 0 < adafactor.optimizer_bytes < 0.1 * adamw.optimizer_bytes
    assert 0.25 * adamw.optimizer_bytes < eight_bit.optimizer_bytes < 0.3 * adamw.optimizer_bytes
