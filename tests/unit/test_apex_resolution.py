"""`--optimizers apex_adam` / `apex_lamb` resolve to apex's fused kernels only where they fit: apex imports, the
device is CUDA and the layout hands the optimizer plain tensors (one process, DDP, OSS, DeepSpeed). DTensor layouts
(TP, FSDP, SDP, ZeRO-1/2 in 3D, pipeline with data parallel, EP with TP) get torch's fused AdamW / rapidtrain's LAMB.

Real NVIDIA apex cannot be installed here (no CUDA; PyPI's `apex` is another project), so these tests put a
STAND-IN `apex` package and `amp_C` module on sys.path: FusedAdam / FusedLAMB classes that, like apex's
multi-tensor kernels, accept plain tensors only. The decision itself is rapidtrain's real code.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from rapidtrain.config import arguments, rules
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext
from rapidtrain.optim.optimizers import apex_optimizer_class, build_optimizer

STAND_IN_APEX = '''
"""STAND-IN for NVIDIA apex's fused optimizers (tests only): plain tensors only, as apex's kernels."""
import torch


class _PlainTensorsOnly:
    def check(self):
        for group in self.param_groups:
            for param in group["params"]:
                if type(param) not in (torch.Tensor, torch.nn.Parameter):
                    raise TypeError(f"apex multi_tensor_apply takes plain tensors, got {type(param).__name__}")


class FusedAdam(torch.optim.AdamW, _PlainTensorsOnly):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.check()


class FusedLAMB(torch.optim.AdamW, _PlainTensorsOnly):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.check()
'''


@pytest.fixture
def stand_in_apex(tmp_path, monkeypatch):
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text('"""STAND-IN for NVIDIA apex (tests only)."""\n')
    (tmp_path / "apex" / "optimizers.py").write_text(textwrap.dedent(STAND_IN_APEX))
    (tmp_path / "amp_C.py").write_text('"""STAND-IN for apex\'s compiled amp_C extension (tests only)."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    apex_optimizer_class.cache_clear()
    yield
    for module in ("apex", "apex.optimizers", "amp_C"):
        sys.modules.pop(module, None)
    apex_optimizer_class.cache_clear()


def cuda_plan(flags: list[str], world: int):
    args = arguments.parse_args(["--train-iters", "10", "--lr", "1e-4", *flags])
    ctx = RunContext(world, "cuda")
    rules.validate(args, ctx)
    return from_args(args, ctx)


PP2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "2"]
LAYOUTS = [  # (flags, world size, parameters are plain tensors)
    ([], 1, True),
    ([], 2, True),  # DDP
    (["--oss-memory-optimization"], 2, True),
    (["--zero-1-memory-optimization"], 2, True),  # DeepSpeed flattens plain tensors
    (["--zero-3-memory-optimization"], 2, True),
    (["--num-experts", "2", "--expert-model-parallel-size", "2"], 2, True),  # DDP, experts reduced apart
    (["--tensor-model-parallel-size", "2"], 2, False),
    (["--fsdp-memory-optimization"], 2, False),
    (["--oss-sdp-memory-optimization"], 2, False),
    (["--zero-2-memory-optimization", "--tensor-model-parallel-size", "2"], 4, False),  # FSDP2 in 3D
    (PP2, 4, True),  # DDP around each pipeline stage
    (PP2 + ["--tensor-model-parallel-size", "2"], 8, False),  # composable replicate beside tensor parallelism
    (["--num-experts", "2", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], 4, False),
]


DEEPSPEED = ("--zero-1-memory-optimization", "--zero-3-memory-optimization")
CASES = [("apex_adam", *layout) for layout in LAYOUTS] + [
    # LAMB's per-parameter trust ratio cannot run on DeepSpeed's flat partitions (rule zero-elementwise-optimizer).
    ("apex_lamb", *layout) for layout in LAYOUTS if not set(DEEPSPEED) & set(layout[0])
]


@pytest.mark.parametrize("name, flags, world, plain", CASES)
def test_apex_serves_only_plain_tensor_layouts(stand_in_apex, name, flags, world, plain):
    plan = cuda_plan(["--optimizers", name, *flags], world)
    choice = plan.engine_for("optimizer")
    apex_class = "FusedAdam" if name == "apex_adam" else "FusedLAMB"
    if plain:
        assert choice.engine == f"apex {apex_class}"
        assert choice.reason == "the layout's parameters are plain tensors"
    else:
        fallback = "torch.optim.AdamW(fused=True)" if name == "apex_adam" else "rapidtrain LAMB"
        assert choice.engine.startswith(fallback)
        assert f"apex {apex_class}'s multi-tensor kernels take plain tensors" in choice.engine
        assert choice.reason.startswith("the layout's parameters are DTensors")
    # The build reads the same settings from the plan and makes what the plan printed.
    optimizer, description = build_optimizer(nn.Linear(4, 4), plan.optimizer, "cuda")
    assert description == choice.engine
    assert (type(optimizer).__module__ == "apex.optimizers") == plain


def test_the_stand_in_refuses_dtensors_as_apex_does(stand_in_apex):
    # What the resolution prevents: apex's kernels given DTensor parameters (here on a one-rank CPU mesh).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh))
        fused_adam = apex_optimizer_class("FusedAdam")
        with pytest.raises(TypeError, match="plain tensors"):
            fused_adam([weight])
    finally:
        dist.destroy_process_group()


def test_without_cuda_apex_is_not_used_even_when_it_imports(stand_in_apex):
    args = arguments.parse_args(["--train-iters", "10", "--lr", "1e-4"])
    plan = from_args(args, RunContext(1, "cpu"))
    # (then, in one process on the built-in model, stepped on flat buffers: optim/flat_buffers.py)
    assert plan.engine_for("optimizer").engine.startswith("torch.optim.AdamW(fused=True) (apex FusedAdam needs CUDA)")
