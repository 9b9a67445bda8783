"""The training loop reads the device at most once per iteration between log lines.

A device-to-host read (`.item()`, `float(t)`, `int(t)`, `bool(t)` / `if t:`, `.cpu()`, `.tolist()`) makes the
host wait for every kernel queued before it, so the CPU can no longer run ahead of the GPU. The probe counts
every call of these on any tensor during iterations 3-7 of real pretraining runs (one process: dense, MoE and
fp16 with loss scaling; two ranks: DDP dense and MoE, PP 2 and FSDP2), log lines out of the window, and requires
at most one per iteration:
the loop's one agreed decision (`runner.agree`: overflow, non-finite loss, stop).

On CPU no call is a real sync, and `.cpu()` of a CPU tensor is not even a copy: the count is a proxy that
stands for what a CUDA run would do, so host-side values (such as token counts, which stay on the host by
design) are counted too and must not be read either. One kind of call is not counted: torch's optimizers
read their own `step` counters, which torch keeps as host tensors for every device (not a sync on CUDA).
What is counted is reported by call site, so a failure names the line that waits.

Run as a script under torchrun, this file is the probe (one rank or two).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

if __package__ in (None, ""):  # run by torchrun as the probe
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.launch import TINY_GPT_PARITY, torchrun  # noqa: E402

READS = ("item", "__float__", "__int__", "__bool__", "cpu", "tolist")
FIRST, LAST = 3, 7  # the counted iterations (the first ones build caches, state and schedules)
ITERATIONS = 8
FLAGS = [*TINY_GPT_PARITY, "--seq-length", "32", "--micro-batch-size", "1", "--lr", "1e-3",
         "--log-interval", "100", "--train-iters", str(ITERATIONS)]
RUNS = {
    1: {"dense": ["--global-batch-size", "2"], "moe": ["--global-batch-size", "2", "--num-experts", "4"],
        "fp16": ["--global-batch-size", "2", "--fp16"]},
    2: {"ddp": ["--global-batch-size", "4"], "ddp_moe": ["--global-batch-size", "4", "--num-experts", "4"],
        "pp2": ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2"],
        "fsdp": ["--global-batch-size", "4", "--fsdp-memory-optimization"]},
}


class ReadCounter:
    """Patches the host-read methods of torch.Tensor while active; counts calls by (method, call site)."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.active = False
        self.host_counters: set[int] = set()
        self.originals: dict[str, Any] = {}

    def install(self) -> None:
        import torch

        for name in READS:
            original = getattr(torch.Tensor, name)
            self.originals[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        counter = self

        def read(tensor, *args, **kwargs):
            if counter.active and id(tensor) not in counter.host_counters:
                counter.active = False  # the reads torch makes inside this one are not separate waits
                try:
                    counter.calls[f"{name} at {call_site()}"] += 1
                finally:
                    counter.active = True
            return original(tensor, *args, **kwargs)

        return read

    def start(self, optimizers: list[Any]) -> None:
        self.host_counters = {id(state["step"]) for optimizer in optimizers for state in optimizer.state.values()
                              if "step" in state}
        self.active = True

    def stop(self) -> None:
        self.active = False


def call_site() -> str:
    """The innermost frame outside torch (and this file): the code that asked for the value."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(torch_dir) and frame.filename != __file__:
            return f"{os.path.relpath(frame.filename)}:{frame.lineno} ({frame.line})"
    return "torch"


def optimizers_of(runner: Any) -> list[Any]:
    optimizer = runner.optimizer
    return [getattr(optimizer, "optim", optimizer)]


def probe(out: Path) -> None:
    import torch.distributed as dist

    from rapidtrain.pretrain import ENTRY
    from rapidtrain.train.builtin_pretrainer import MegatronPreTrainer
    from rapidtrain.train.engine import Engine

    counter = ReadCounter()
    counter.install()

    class CountingTrainer(MegatronPreTrainer):
        def train_step(self, micro_batches: list[Any], stop_requested: bool = False) -> Any:
            if self.iteration + 1 == FIRST:
                counter.start(optimizers_of(self.engine.runner))
            if self.iteration + 1 == LAST + 1:
                counter.stop()
            return super().train_step(micro_batches, stop_requested)

    world = int(os.environ["WORLD_SIZE"])
    engine = None
    for name, flags in RUNS[world].items():
        counter.calls.clear()
        engine = Engine(argv=FLAGS + flags, entry=ENTRY)
        CountingTrainer(engine).train()
        counter.stop()
        rank = dist.get_rank() if dist.is_initialized() else 0
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(dict(counter.calls)))
    if engine is not None:
        engine.shutdown()


@pytest.fixture(scope="module")
def counted(tmp_path_factory, demo_data) -> Path:
    out = tmp_path_factory.mktemp("host_syncs")
    for world in RUNS:
        torchrun(world, __file__, [str(out)], timeout=900, warm=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,name", [(w, n) for w, runs in RUNS.items() for n in runs])
def test_at_most_one_host_read_per_steady_iteration(counted, world, name):
    iterations = LAST - FIRST + 1
    for rank in range(world):
        calls = json.loads((counted / f"{name}_rank{rank}.json").read_text())
        total = sum(calls.values())
        assert total <= iterations, f"rank {rank}: {total} host reads in {iterations} iterations: {calls}"
        assert total >= iterations, f"rank {rank}: the loop's one agreed decision was not seen: {calls}"


if __name__ == "__main__":
    from rapidtrain.core.process import exit_after

    exit_after(lambda: probe(Path(sys.argv[1])))  # no interpreter finalization racing gloo's threads
