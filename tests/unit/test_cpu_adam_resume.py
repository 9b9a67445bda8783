"""DeepSpeedCPUAdam (the optimizer of --cpu-offload) continues bitwise after a resume at any step.

The C++ optimizer keeps beta^t in float32 and multiplies it by beta once per step, but computes std::pow(beta, t)
when a step arrives out of sequence, as the first step after a resume into a fresh optimizer does. The load
(`ZeroState.load`) replays the step count (`replay_cpu_adam_steps`); here every stop point of a short run is tried,
with and without the replay, on the real DeepSpeed op."""

from __future__ import annotations

import pytest
import torch

from rapidtrain.parallel.deepspeed_state import replay_cpu_adam_steps

STEPS = 16
SETTINGS = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "adamw_mode": True}


@pytest.fixture(scope="module")
def cpu_adam():
    """The class, with its OpenMP loops on one thread: 512 elements need no more, and a team of spinning threads
    on cores other tests are using makes each step take seconds."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield DeepSpeedCPUAdam
    torch.set_num_threads(threads)


def step(optimizer, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad.clone()
    optimizer.step()


def test_every_stop_point_continues_bitwise_only_with_the_replay(cpu_adam):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(512, generator=generator) for _ in range(STEPS)]
    param = torch.nn.Parameter(torch.randn(512, generator=generator))
    uninterrupted = cpu_adam([param], **SETTINGS)
    saved = {}  # stop → (weights, optimizer state) after that many steps: what a checkpoint holds
    for stop, grad in enumerate(grads, start=1):
        step(uninterrupted, param, grad)
        state = uninterrupted.state[param]
        saved[stop] = param.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    resumed_param = torch.nn.Parameter(torch.zeros(512))
    resumed = cpu_adam([resumed_param], **SETTINGS)

    def resume(stop: int, replay: bool) -> torch.Tensor:
        # A fresh C++ optimizer under the same id, as a new process builds (what DeepSpeedCPUAdam's __init__ does;
        # one Python object for every stop: building one loads the op, ~1 s each).
        resumed.ds_opt_adam.destroy_adam(resumed.opt_id)
        resumed.ds_opt_adam.create_adam(resumed.opt_id, SETTINGS["lr"], *SETTINGS["betas"], SETTINGS["eps"],
                                        SETTINGS["weight_decay"], SETTINGS["adamw_mode"], False)
        weights, state = saved[stop]
        resumed_param.data.copy_(weights)
        resumed.state[resumed_param] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        if replay:
            replay_cpu_adam_steps(resumed, state["step"])
        for grad in grads[stop:]:
            step(resumed, resumed_param, grad)
        return resumed_param.detach()

    stops = range(1, STEPS)
    assert [stop for stop in stops if not torch.equal(resume(stop, replay=True), param)] == []
    # Without the replay some stop points drift (std::pow against the running product): the fault this guards.
    drifted = [stop for stop in stops if not torch.equal(resume(stop, replay=False), param)]
    assert drifted, "no stop point drifted without the replay: the test no longer shows the fault it guards"
