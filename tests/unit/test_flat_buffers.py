"""The one-process step on flat buffers (optim/flat_buffers.py) through the real TorchRunner: torch's fused AdamW's
numbers, checkpoints in the per-parameter format (loadable both ways), and the plan's word on when it runs."""

from __future__ import annotations

import copy

import pytest
import torch

from rapidtrain.config.settings import Precision
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from rapidtrain.optim.flat_buffers import ROW, FlatAdam
from rapidtrain.optim.optimizers import OptimizerSettings, build_optimizer, runs_on_flat_buffers
from rapidtrain.parallel.low_precision_weights import LowPrecisionWeights
from rapidtrain.parallel.runner import TorchRunner, squared_norm

CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                     vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
SETTINGS = OptimizerSettings(name="adamw", lr=1e-2, weight_decay=0.1)


def runner_for(model: torch.nn.Module, flat: bool, dtype: str = "fp32", clip: float = 0.0) -> TorchRunner:
    optimizer, _ = build_optimizer(model, SETTINGS, "cpu")  # two groups: decay and no decay
    runner = TorchRunner(module=model, optimizer=optimizer, precision=Precision(dtype, "none", ""), device_type="cpu",
                         clip_grad=clip, flat=FlatAdam(optimizer) if flat else None)
    if dtype == "bf16":
        runner.after_update.append(
            LowPrecisionWeights(model, flat_master=runner.flat.params if runner.flat else None).refresh)
    return runner


def train(runner: TorchRunner, steps: int, seed: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`steps` steps of two accumulated micro-batches: each step's loss and gradient norm."""
    generator = torch.Generator().manual_seed(seed)
    losses, norms = [], []
    for _ in range(steps):
        total = torch.zeros(())
        for index in range(2):
            tokens, labels = (torch.randint(0, 128, (2, 16), generator=generator) for _ in range(2))
            with runner.micro_batch(is_last=index == 1):
                loss = runner.module(tokens, labels=labels).float().mean() / 2
            runner.backward(loss)
            total += loss.detach()
        outcome = runner.step()
        runner.zero_grad()
        runner.parameters_updated()
        losses.append(total)
        norms.append(outcome.grad_norm)
    return losses, norms


def moments(runner: TorchRunner) -> list[torch.Tensor]:
    state = runner.optimizer.state
    return [state[p][key] for p in runner.parameters for key in ("exp_avg", "exp_avg_sq", "step")]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_flat_step_trains_bitwise_as_torch_fused_adamw(dtype):
    """Without clipping (the norm is the one thing summed differently): losses, weights and moments bitwise equal
    after three steps of two accumulated micro-batches, in fp32 and with the bf16 copies over the flat buffer."""
    model = build_model(CONFIG, seed=1)
    reference = runner_for(copy.deepcopy(model), flat=False, dtype=dtype)
    runner = runner_for(model, flat=True, dtype=dtype)
    expected_losses, expected_norms = train(reference, 3)
    losses, norms = train(runner, 3)
    assert torch.equal(torch.stack(losses), torch.stack(expected_losses))
    for name, p in runner.module.state_dict().items():
        assert torch.equal(p, reference.module.state_dict()[name]), name
    assert all(torch.equal(a, b) for a, b in zip(moments(runner), moments(reference), strict=True))
    assert torch.allclose(torch.stack(norms), torch.stack(expected_norms), rtol=1e-6, atol=0)
    flat = runner.flat
    assert flat is not None and flat.ready()  # gradients stayed the buffer's views, zeroed in place
    assert all(p.data_ptr() == v.data_ptr() for p, v in zip(flat.parameters, flat.param_views, strict=True))
    assert all(runner.optimizer.state[p]["exp_avg"] is v for p, v in zip(flat.parameters, flat.exp_avg_views,
                                                                          strict=True))
    padding = torch.ones_like(flat.params, dtype=torch.bool)
    for view in flat.param_views:
        offset = (view.data_ptr() - flat.params.data_ptr()) // 4
        padding[offset:offset + view.numel()] = False
    assert padding.any() and not flat.params[padding].any() and not flat.exp_avg_sqs[padding].any()


def test_flat_norm_and_clipping_match_the_per_parameter_ones():
    """The gradient norm over the buffer's rows is the per-parameter fp64 sum within float rounding, and clipping
    scales every gradient by max_norm / norm."""
    model = build_model(CONFIG, seed=1)
    runner = runner_for(model, flat=True, clip=1e-3)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    runner.backward(runner.module(tokens, labels=tokens).mean())
    flat = runner.flat
    assert flat is not None and flat.grads.numel() % ROW == 0
    grads = [p.grad.clone() for p in runner.parameters]
    expected = squared_norm(grads).sqrt()
    norm = flat.grad_norm()
    assert norm.dtype == torch.float64 and abs(norm.item() - expected.item()) < 1e-7 * expected.item()
    flat.clip(1e-3, norm)
    scale = 1e-3 / (norm.float() + 1e-6)
    assert all(torch.equal(p.grad, g * scale) for p, g in zip(runner.parameters, grads, strict=True))


def test_checkpoints_keep_the_per_parameter_format_both_ways():
    """A flat runner's optimizer state is torch's per-parameter one (the saved format), and a state saved by the
    per-parameter step loads into the flat one (and back): training continues bitwise as without flat buffers."""
    model = build_model(CONFIG, seed=1)
    before = runner_for(copy.deepcopy(model), flat=False)
    train(before, 2)
    saved = copy.deepcopy(before.state_dict())
    flat_runner = runner_for(build_model(CONFIG, seed=7), flat=True)
    flat_runner.load_state_dict(copy.deepcopy(saved))
    plain_runner = runner_for(build_model(CONFIG, seed=7), flat=False)
    plain_runner.load_state_dict(copy.deepcopy(saved))
    flat_losses, _ = train(flat_runner, 2, seed=9)
    plain_losses, _ = train(plain_runner, 2, seed=9)
    assert torch.equal(torch.stack(flat_losses), torch.stack(plain_losses))
    flat_state = flat_runner.state_dict()
    for key, value in plain_runner.state_dict()["optimizer"]["state"].items():
        for name, tensor in value.items():
            assert torch.equal(flat_state["optimizer"]["state"][key][name], tensor), (key, name)
    back = runner_for(build_model(CONFIG, seed=11), flat=False)
    back.load_state_dict(copy.deepcopy(flat_state))  # what a flat run saved, read by a per-parameter step
    assert torch.equal(torch.stack(train(back, 1, seed=13)[0]), torch.stack(train(plain_runner, 1, seed=13)[0]))


def test_the_plan_says_when_the_step_runs_on_flat_buffers():
    """torch's fused AdamW/Adam in one process on the built-in dense model without loss scaling; not DDP, not
    DeepSpeed, not Muon or SGD, not under fp16 loss scaling."""
    def runs(settings: OptimizerSettings = SETTINGS, **overrides: bool) -> bool:
        where = {"one_process": True, "builtin_dense_model": True, "loss_scaling": False, "own_engine": False}
        return runs_on_flat_buffers(settings, "cpu", **(where | overrides))

    assert runs() and runs(OptimizerSettings(name="adam")) and runs(OptimizerSettings(name="apex_adam"))
    assert not runs(one_process=False) and not runs(builtin_dense_model=False)
    assert not runs(loss_scaling=True) and not runs(own_engine=True)
    assert not runs(OptimizerSettings(name="sgd")) and not runs(OptimizerSettings(name="muon"))
