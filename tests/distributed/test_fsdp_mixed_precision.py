"""FSDP2 mixed precision on 2 gloo ranks: the dtypes that cross the wire, and losses against one process.

Under --bf16/--fp16 the transformer blocks all-gather their parameters in the low precision (half the bytes)
and reduce-scatter gradients in fp32; the root (embeddings, final norm, head) stays fp32. Every collective
FSDP2 issues goes through its extension point (`set_custom_all_gather` / `set_custom_reduce_scatter`), where
this probe records the dtype and bytes of each before sending it on. The bf16 FSDP2 run's losses stay within
bf16 rounding of one process's.

Run as a script under torchrun (2 ranks), this file is the probe.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

if __package__ in (None, ""):  # run by torchrun as the probe
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.parallel_runs import train_here  # noqa: E402
from tests.launch import read_losses, relative_difference, torchrun  # noqa: E402

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
         "--eval-iters", "0", "--lr", "1e-3", "--log-interval", "100", "--make-vocab-size-divisible-by", "512"]
PARITY = [*SHAPE, "--global-batch-size", "4", "--train-iters", "6", "--bf16"]
# bf16 parameters in the blocks round norms and weights to 8 bits of mantissa: ~3e-4 relative measured.
LOSS_TOLERANCE = 2e-3


def record_collectives(model, log: list[dict]) -> None:
    """Route every FSDP unit's all-gather and reduce-scatter through recorders that note dtype and bytes."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class RecordingAllGather(DefaultAllGather):
        def __init__(self, unit: str) -> None:
            self.unit = unit

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            log.append({"kind": "all_gather", "unit": self.unit, "dtype": str(input_tensor.dtype),
                        "bytes": input_tensor.numel() * input_tensor.element_size()})
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class RecordingReduceScatter(DefaultReduceScatter):
        def __init__(self, unit: str) -> None:
            self.unit = unit

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            log.append({"kind": "reduce_scatter", "unit": self.unit, "dtype": str(input_tensor.dtype),
                        "bytes": input_tensor.numel() * input_tensor.element_size()})
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            unit = type(module).__name__.removeprefix("FSDP")
            module.set_custom_all_gather(RecordingAllGather(unit))
            module.set_custom_reduce_scatter(RecordingReduceScatter(unit))


def probe(precision: str, out: Path) -> None:
    """Two optimizer steps of an FSDP2 model composed by the Engine; every collective recorded."""
    import torch
    import torch.distributed as dist

    from rapidtrain.models import build_model
    from rapidtrain.train.engine import Engine

    flags = [*SHAPE, "--fsdp-memory-optimization", "--global-batch-size", "2", "--train-iters", "2"]
    engine = Engine(argv=flags + ([f"--{precision}"] if precision != "fp32" else []), entry="pretrain")
    module, *_ = engine.compose(build_model(engine.plan.model, seed=1234))
    log: list[dict] = []
    record_collectives(module, log)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        tokens = torch.randint(0, 512, (1, 32), generator=generator)
        with engine.runner.micro_batch(is_last=True):
            loss = module(tokens, labels=tokens).float().mean()
        engine.backward(loss)
        engine.step()
    if dist.get_rank() == 0:
        (out / f"{precision}.json").write_text(json.dumps(log))


def probe_main(out: Path) -> None:
    import torch.distributed as dist

    from rapidtrain.pretrain import main

    for precision in ("bf16", "fp16", "fp32"):
        probe(precision, out)
    dist.barrier()
    main(PARITY + ["--fsdp-memory-optimization", "--loss-log-file", str(out / "fsdp_bf16.txt")])


@pytest.fixture(scope="module")
def wire(tmp_path_factory, demo_data) -> Path:
    out = tmp_path_factory.mktemp("fsdp_mixed_precision")
    torchrun(2, __file__, [str(out)], timeout=900, warm=True)
    train_here(PARITY + ["--loss-log-file", str(out / "single_bf16.txt")])
    return out


def collectives(wire: Path, precision: str) -> list[dict]:
    return json.loads((wire / f"{precision}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_blocks_all_gather_in_low_precision_and_reduce_in_fp32(wire, precision):
    """Blocks: all-gathers in bf16/fp16; root: fp32; every reduce-scatter fp32; the blocks' all-gather bytes
    are half the fp32 run's."""
    log, fp32 = collectives(wire, precision), collectives(wire, "fp32")
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    block_gathers = [c for c in log if c["kind"] == "all_gather" and c["unit"] == "TransformerLayer"]
    root_gathers = [c for c in log if c["kind"] == "all_gather" and c["unit"] == "GPTModel"]
    assert block_gathers and root_gathers
    assert {c["dtype"] for c in block_gathers} == {dtype}
    assert {c["dtype"] for c in root_gathers} == {"torch.float32"}
    assert {c["dtype"] for c in log if c["kind"] == "reduce_scatter"} == {"torch.float32"}
    fp32_block_bytes = sum(c["bytes"] for c in fp32 if c["kind"] == "all_gather" and c["unit"] == "TransformerLayer")
    assert sum(c["bytes"] for c in block_gathers) * 2 == fp32_block_bytes


@pytest.mark.slow
def test_fp32_run_sends_fp32_everywhere(wire):
    log = collectives(wire, "fp32")
    assert {c["kind"] for c in log} == {"all_gather", "reduce_scatter"}
    assert {c["dtype"] for c in log} == {"torch.float32"}


@pytest.mark.slow
def test_bf16_fsdp_losses_match_one_process_within_bf16_rounding(wire):
    fsdp, single = read_losses(wire / "fsdp_bf16.txt"), read_losses(wire / "single_bf16.txt")
    assert sorted(fsdp) == list(range(1, 7))
    assert relative_difference(fsdp, single) < LOSS_TOLERANCE


if __name__ == "__main__":
    from rapidtrain.core.process import exit_after

    exit_after(lambda: probe_main(Path(sys.argv[1])))  # no interpreter finalization racing gloo's threads
