"""Megatron's dynamic loss scaling on CPU: backoff, hysteresis, growth, unscaling, the cross-rank flag."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rapidtrain.optim.grad_scaler import LossScaler, LossScaleSettings
from tests.launch import spawn_ranks


def scaler(**settings):
    return LossScaler(LossScaleSettings(**settings))


def test_defaults_are_megatrons():
    settings = LossScaleSettings()
    assert (settings.initial_loss_scale, settings.min_loss_scale) == (2.0**32, 1.0)
    assert (settings.loss_scale_window, settings.hysteresis) == (1000, 2)
    assert (settings.growth_factor, settings.backoff_factor) == (2.0, 0.5)
    assert LossScaler().loss_scale == 4294967296.0


def test_scale_multiplies_the_loss():
    s = scaler(initial_loss_scale=1024.0)
    assert s.scale(torch.tensor(0.5)).item() == 512.0


def test_hysteresis_delays_the_first_backoff():
    s = scaler(initial_loss_scale=2.0**16, hysteresis=2)
    s.update(found_inf=True)
    assert s.loss_scale == 2.0**16  # one overflow is absorbed by hysteresis
    s.update(found_inf=True)
    assert s.loss_scale == 2.0**15
    s.update(found_inf=True)  # hysteresis spent: every further overflow halves
    assert s.loss_scale == 2.0**14
    s.update(found_inf=False)  # a clean step does not restore hysteresis (Megatron's code)
    s.update(found_inf=True)
    assert s.loss_scale == 2.0**13


def test_backoff_stops_at_the_minimum_scale():
    s = scaler(initial_loss_scale=8.0, min_loss_scale=2.0, hysteresis=1)
    for expected in (4.0, 2.0, 2.0):
        s.update(found_inf=True)
        assert s.loss_scale == expected


def test_growth_after_a_window_of_clean_steps_restores_hysteresis():
    s = scaler(initial_loss_scale=64.0, loss_scale_window=3, hysteresis=2)
    s.update(found_inf=True)  # uses one unit of hysteresis and resets the growth count
    for _ in range(2):
        s.update(found_inf=False)
    assert s.loss_scale == 64.0
    s.update(found_inf=False)  # third clean step in a row
    assert s.loss_scale == 128.0
    assert s.state_dict() == {"scale": 128.0, "growth_tracker": 0, "hysteresis_tracker": 2}
    s.update(found_inf=True)
    assert s.loss_scale == 128.0  # hysteresis was restored, so this overflow is absorbed again


def test_an_overflow_restarts_the_growth_window():
    s = scaler(initial_loss_scale=64.0, loss_scale_window=3, hysteresis=5)
    s.update(found_inf=False)
    s.update(found_inf=False)
    s.update(found_inf=True)
    s.update(found_inf=False)
    s.update(found_inf=False)
    assert s.loss_scale == 64.0
    s.update(found_inf=False)
    assert s.loss_scale == 128.0


def test_unscale_divides_gradients_and_finds_inf_and_nan():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    s = scaler(initial_loss_scale=1024.0)
    s.scale(model(torch.tensor([[1.0, 2.0]])).sum()).backward()
    assert model.weight.grad.tolist() == [[1024.0, 2048.0]]
    assert s.unscale_and_check(optimizer) is False
    assert model.weight.grad.tolist() == [[1.0, 2.0]]
    assert model.bias.grad.tolist() == [1.0]

    model.bias.grad = torch.tensor([float("inf")])
    assert s.unscale_and_check(model.parameters()) is True
    model.bias.grad = torch.tensor([float("nan")])
    assert s.unscale_and_check([model.weight, model.bias]) is True


def test_fp16_gradients_are_refused():
    param = nn.Parameter(torch.ones(2, dtype=torch.float16))
    param.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        LossScaler().unscale_and_check([param])


def test_constant_scale_never_changes():
    s = scaler(loss_scale=128.0)
    assert not s.dynamic
    for found_inf in (True, True, True, False):
        s.update(found_inf)
    assert s.loss_scale == 128.0
    assert s.state_dict() == {}


def test_state_dict_round_trip_continues_the_same_sequence():
    s = scaler(initial_loss_scale=64.0, loss_scale_window=2)
    s.update(found_inf=True)
    s.update(found_inf=False)
    restored = scaler(initial_loss_scale=2.0**32, loss_scale_window=2)
    restored.load_state_dict({**s.state_dict(), "scale": torch.tensor([64.0])})  # Megatron saves a tensor
    assert restored.state_dict() == {"scale": 64.0, "growth_tracker": 1, "hysteresis_tracker": 1}
    restored.update(found_inf=False)
    assert restored.loss_scale == 128.0


def test_bad_flags_are_named():
    with pytest.raises(ValueError, match="--min-loss-scale"):
        LossScaleSettings(initial_loss_scale=1.0, min_loss_scale=2.0)
    with pytest.raises(ValueError, match="--loss-scale-window"):
        LossScaleSettings(loss_scale_window=0)
    with pytest.raises(ValueError, match="--hysteresis"):
        LossScaleSettings(hysteresis=0)


def _overflow_on_one_rank(rank: int, world_size: int, init_file: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        s = scaler(initial_loss_scale=4.0)
        param = nn.Parameter(torch.zeros(3))
        param.grad = torch.tensor([4.0, 8.0, float("inf") if rank == 0 else 12.0])
        local = s.unscale_and_check([param])
        param.grad = torch.tensor([4.0, 8.0, 12.0])
        clean = s.unscale_and_check([param], process_group=dist.group.WORLD)
        param.grad = torch.tensor([4.0, 8.0, float("inf") if rank == 0 else 12.0])
        agreed = s.unscale_and_check([param], process_group=dist.group.WORLD)
        with open(os.path.join(results, f"rank{rank}.txt"), "w") as out:
            out.write(f"{local} {clean} {agreed}")
    finally:
        dist.destroy_process_group()


def test_found_inf_is_agreed_across_ranks(tmp_path):
    spawn_ranks(_overflow_on_one_rank, 2, str(tmp_path / "init"), str(tmp_path))
    # Only rank 0 saw the inf itself; with the group both ranks report it and would skip the step.
    assert (tmp_path / "rank0.txt").read_text() == "True False True"
    assert (tmp_path / "rank1.txt").read_text() == "False False True"


def test_data_parallel_average_leaves_one_process_magnitudes_in_backward_and_unscales_exactly():
    """A rank's loss arrives multiplied by the data-parallel size (the wrapper then averages): the scaler takes
    that size out of the backward multiplier, so fp16 gradients have one process's magnitudes, and unscaling
    the averaged gradients gives the true ones."""
    torch.manual_seed(0)
    ranks, scale = 4, 2.0**10
    model = nn.Linear(3, 1)
    inputs = torch.randn(ranks, 3)
    reference = [torch.autograd.grad(model(x).sum(), model.weight)[0] for x in inputs]
    s = LossScaler(LossScaleSettings(initial_loss_scale=scale), data_parallel_average=ranks)
    assert s.multiplier == scale / ranks and s.loss_scale == scale
    per_rank = [torch.autograd.grad(s.scale(model(x).sum() * ranks), model.weight)[0] for x in inputs]
    for grad, expected in zip(per_rank, reference, strict=True):
        torch.testing.assert_close(grad, expected * scale)  # what one process's backward would hold
    model.weight.grad = torch.stack(per_rank).mean(dim=0)  # the wrapper's average
    assert s.unscale([model.weight]).item() == 0.0
    torch.testing.assert_close(model.weight.grad, torch.stack(reference).sum(dim=0))
