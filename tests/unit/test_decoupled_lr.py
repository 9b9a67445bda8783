"""Megatron-Core's --decoupled-lr / --decoupled-min-lr: the word embedding and the output layer get their own peak
and floor in the same schedule; and --calculate-per-token-loss, which holds a forward step to per-token sums. One
process here; tests/distributed/test_per_token_loss.py runs both under DDP, FSDP2, DeepSpeed ZeRO-2 and pipelining."""

from __future__ import annotations

import math

import pytest
import torch

from rapidtrain.config.arguments import parse_args
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.flag_surface import FlagRefused
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext
from rapidtrain.core.errors import UserError
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from rapidtrain.optim.lr_schedule import LRScheduler, LRScheduleSettings
from rapidtrain.optim.optimizers import is_embedding_or_output, param_groups
from rapidtrain.parallel.apply import check_decoupled_lr
from rapidtrain.train.engine import Engine
from rapidtrain.train.trainer import Trainer

CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                     vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0, tie_embeddings=False)
SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--untie-embeddings-and-output-weights"]


def test_embedding_and_output_form_groups_with_their_own_peak_and_floor():
    model = build_model(CONFIG)
    groups = param_groups(model, 0.1, decoupled=(5e-3, 2e-4))
    names = {id(p): n for n, p in model.named_parameters()}
    own = [g for g in groups if "max_lr" in g]
    assert [(g["max_lr"], g["min_lr"], g["weight_decay"]) for g in own] == [(5e-3, 2e-4, 0.1)]
    assert sorted(names[id(p)] for p in own[0]["params"]) == ["embedding.word_embeddings.weight", "output.weight"]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    # Without the flag: Megatron's two weight-decay groups, exactly as before.
    plain = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in plain] == [0.1, 0.0] and all("max_lr" not in g for g in plain)
    # Wrapper prefixes (DDP, torch.compile, activation checkpointing) do not hide them; BERT's decoder counts.
    assert is_embedding_or_output("module._orig_mod.output.weight")
    assert is_embedding_or_output("lm_head.output.weight") and not is_embedding_or_output("lm_head.output.bias")
    assert not is_embedding_or_output("embedding.position_embeddings.weight")


def test_a_model_without_those_layers_or_with_its_own_optimizer_is_refused_by_name():
    with pytest.raises(UserError, match="--decoupled-lr: this model has no word embedding"):
        check_decoupled_lr(torch.nn.Linear(3, 3), None)
    model = build_model(CONFIG)
    with pytest.raises(UserError, match="--decoupled-lr: the optimizer passed to Engine.compose"):
        check_decoupled_lr(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _cosine(peak: float, floor: float, samples: float, warmup: float, horizon: float) -> float:
    if samples <= warmup:
        return peak * samples / warmup
    ratio = (samples - warmup) / (horizon - warmup)
    return floor + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (peak - floor)


def test_both_groups_follow_the_same_warmup_and_decay_between_their_own_rates():
    """Warm-up 2 iterations, cosine decay over 10, global batch 4: each step's rates against the formula."""
    weight, embedding = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([{"params": [weight]}, {"params": [embedding], "max_lr": 4e-3, "min_lr": 4e-4}],
                                lr=0.0)
    scheduler = LRScheduler(optimizer, LRScheduleSettings(lr=1e-3, min_lr=1e-5, decay_style="cosine",
                                                          decay_samples=40, warmup_samples=8))
    for step in range(1, 8):
        scheduler.step(4)
        samples = 4 * step
        assert optimizer.param_groups[0]["lr"] == pytest.approx(_cosine(1e-3, 1e-5, samples, 8, 40), rel=1e-12)
        assert optimizer.param_groups[1]["lr"] == pytest.approx(_cosine(4e-3, 4e-4, samples, 8, 40), rel=1e-12)
    assert optimizer.param_groups[1]["lr"] > 4e-4 * 1.01  # not at the floor yet: the decay's shape was compared


def build_plan(args):
    return from_args(args, RunContext())


def test_the_plan_names_the_rates_and_refuses_a_floor_above_the_peak():
    text = describe_plan(build_plan(parse_args([*SHAPE, "--train-iters", "10", "--lr", "1e-3", "--min-lr", "1e-4",
                                                "--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4"])))
    assert "word embedding and output layer lr 5.0E-03 → min 5.0E-04 (--decoupled-lr" in text
    plan = build_plan(parse_args([*SHAPE, "--train-iters", "10", "--min-lr", "1e-4", "--decoupled-lr", "5e-3"]))
    assert plan.optimizer.decoupled == (5e-3, 1e-4)  # the floor defaults to --min-lr, as in Megatron-Core
    with pytest.raises(FlagRefused, match="--decoupled-lr 0.001 is below --decoupled-min-lr 0.002"):
        parse_args(["--decoupled-lr", "1e-3", "--decoupled-min-lr", "2e-3"])
    notes = "\n".join(parse_args(["--decoupled-min-lr", "1e-4"]).compat_notes)
    assert "--decoupled-min-lr 0.0001: no effect here" in notes


class MeanLossTrainer(Trainer):
    """A user's forward step that returns a mean loss (Megatron's older form)."""

    def run_forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        losses = model(batch["tokens"], labels=batch["labels"])
        return (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum(), {}


def _batches(count: int) -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 64, (count, 17), generator=torch.Generator().manual_seed(3))
    return [{"tokens": tokens[i:i + 1, :-1], "labels": tokens[i:i + 1, 1:], "loss_mask": torch.ones(1, 16)}
            for i in range(count)]


def test_an_engine_gives_the_embedding_its_own_rate_and_per_token_loss_refuses_a_mean():
    engine = Engine(argv=[*SHAPE, "--train-iters", "4", "--lr", "1e-3", "--min-lr", "0", "--decoupled-lr", "3e-3",
                          "--lr-decay-style", "linear", "--micro-batch-size", "1", "--global-batch-size", "2",
                          "--calculate-per-token-loss"])
    trainer = MeanLossTrainer(engine)
    trainer.model, optimizer, scheduler, *_ = engine.compose(build_model(CONFIG, seed=5))
    rates = sorted((g.get("max_lr", 0.0), g["lr"]) for g in optimizer.param_groups)
    assert rates[-1] == (3e-3, pytest.approx(3e-3)) and rates[0] == (0.0, pytest.approx(1e-3))
    with pytest.raises(UserError, match="--calculate-per-token-loss: the forward step returned a mean loss"):
        trainer.train_step(_batches(2))
    assert all(p.grad is None or not p.grad.any() for p in trainer.model.parameters())  # nothing half-accumulated
