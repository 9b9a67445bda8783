"""The device path on a real GPU: how often the loop waits on it, and which attention kernel runs in bf16.

- Host syncs: `torch.cuda.set_sync_debug_mode("warn")` over iterations 3-7 of a pretraining run (fp32, bf16,
  fp16 with loss scaling, FSDP2 in bf16) records every synchronising CUDA call with its Python stack; at most one
  per iteration is allowed, and it must be the loop's one agreed decision (`runner.agree`).
- SDPA: the built-in GPT's attention in bf16 with a causal mask and no padding mask (pretraining's default) can
  run with only the flash kernel enabled, and the profiler shows the flash kernel in the default run.

Run as a script under torchrun, this file is the sync probe.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

if __package__ in (None, ""):  # run by torchrun as the probe
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.launch import PRETRAIN, torchrun  # noqa: E402

FIRST, LAST = 3, 7
RUNS = {
    "fp32": [],
    "bf16": ["--bf16"],
    "fp16": ["--fp16", "--initial-loss-scale", "1024"],
    "fsdp_bf16": ["--fsdp-memory-optimization", "--bf16"],
}
FLAGS = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "9", "--lr", "1e-4",
         "--log-interval", "100", "--eval-iters", "0", "--num-workers", "2"]


def probe(out: Path) -> None:
    import warnings

    import torch

    import __main__
    from rapidtrain.pretrain import ENTRY, MegatronPreTrainer
    from rapidtrain.train.engine import Engine

    __main__.__file__ = str(PRETRAIN)  # pretrain.py's plan, not a user script's
    syncs: list[dict[str, Any]] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):  # not set_sync_debug_mode's own notice
            stack = [f"{os.path.relpath(f.filename)}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                     if "site-packages" not in f.filename and "warnings" not in f.filename]
            syncs.append({"message": str(message)[:200], "stack": stack[-6:]})

    class Probed(MegatronPreTrainer):
        def train_step(self, micro_batches: list[Any], stop_requested: bool = False) -> Any:
            if self.iteration + 1 == FIRST:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            if self.iteration + 1 == LAST + 1:
                torch.cuda.set_sync_debug_mode(0)
            return super().train_step(micro_batches, stop_requested)

    engine = None
    for name, flags in RUNS.items():
        syncs.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            engine = Engine(argv=FLAGS + flags, entry=ENTRY)
            Probed(engine).train()
            torch.cuda.set_sync_debug_mode(0)
        (out / f"{name}.json").write_text(json.dumps(syncs))
    if engine is not None:
        engine.shutdown()


@pytest.fixture(scope="module")
def synced(tmp_path_factory, demo_data) -> Path:
    out = tmp_path_factory.mktemp("gpu_syncs")
    torchrun(1, __file__, [str(out)], timeout=1200)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_at_most_one_device_sync_per_steady_iteration_and_it_is_the_agreed_decision(synced, name):
    syncs = json.loads((synced / f"{name}.json").read_text())
    iterations = LAST - FIRST + 1
    assert len(syncs) <= iterations, json.dumps(syncs, indent=1)[:4000]
    for sync in syncs:
        assert any("rapidtrain/parallel/runner.py" in frame for frame in sync["stack"]), sync


def test_bf16_attention_runs_the_flash_kernel():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rapidtrain.models import ModelConfig, build_model

    config = ModelConfig(num_layers=2, hidden_size=512, num_attention_heads=8, seq_length=1024,
                         max_position_embeddings=1024, vocab_size=1024, hidden_dropout=0.0, attention_dropout=0.0)
    model = build_model(config, seed=1).cuda()
    tokens = torch.randint(0, 1024, (2, 1024), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, labels=tokens).float().mean()
        loss.backward()

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises "No available kernel" if flash cannot serve it
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step()
        torch.cuda.synchronize()
    kernels = [event.name for event in profile.events()]
    used = sorted({k for k in kernels if "flash" in k.lower() or "efficient" in k.lower() or "fmha" in k.lower()})
    print(f"attention kernels in bf16 on {torch.cuda.get_device_name()}: {used}")
    assert any("flash" in k.lower() for k in used), used


if __name__ == "__main__":
    probe(Path(sys.argv[1]))


def test_device_probe_reads_the_gpus_torch_sees():
    """core/device_probe.py answers the launcher and the plan without initialising CUDA: here it must name the
    GPUs torch names (or leave the machine to torch: a model it does not know, a MIG instance)."""
    import torch

    from rapidtrain.core.device_probe import probe

    found = probe()
    print(f"probe: {found}; torch: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
    if found is not None:
        assert (found.device_type, found.device_count, found.name) == (
            "cuda", torch.cuda.device_count(), torch.cuda.get_device_name())
        assert found.native_bf16 == torch.cuda.is_bf16_supported(including_emulation=False)


def test_gradient_norm_and_clipping_launch_multi_tensor_kernels():
    """The norm and the clip of ~400 gradients (GPT 1.3B has 292) are a few multi-tensor kernels, not two or three per
    gradient as an H100 profile first showed (~10 ms of a 200 ms step); the norm stays within 1e-6 of fp64."""
    import torch

    from rapidtrain.parallel.runner import clip_by_norm, squared_norm

    params = [torch.nn.Parameter(torch.zeros(n, device="cuda")) for n in [4096, 300, 2048 * 2048] * 133]
    for param in params:
        param.grad = torch.randn_like(param)
    grads = [p.grad for p in params]
    exact = sum(float(g.double().square().sum()) for g in grads)
    assert float(squared_norm(grads)) == pytest.approx(exact, rel=1e-6)
    clip_by_norm(params, 1.0, squared_norm(grads).sqrt())  # warm-up (scales the gradients to norm 1)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        squared = squared_norm(grads)
        clip_by_norm(params, 1.0, squared.sqrt())
        torch.cuda.synchronize()
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"{len(kernels)} kernels for the norm and the clip of {len(params)} gradients")
    assert len(kernels) < len(params) // 2, sorted({e.name for e in kernels})  # per gradient: 2-3 each
    assert float(squared) == pytest.approx(1.0, rel=1e-5)  # the warm-up's clip to norm 1
