"""Train each layout for two iterations inside one torchrun launch and measure each rank's memory, for
test_memory_estimate.py. Usage: `torchrun --nproc-per-node 2 tests/distributed/memory_runs.py RUNS.json OUT.json`,
RUNS.json a {name: argument list} object.

What is measured, per rank:
- model states: before the second optimizer step, the bytes of every distinct tensor storage reachable from the
  runner (its module's parameters and gradients, the optimizer's state, DeepSpeed's flat partitions: a walk of
  the objects' attributes), buffers excluded; DDP's gradient buckets (C++ only) are counted through the
  gradients, which are views into them;
- activations: during the second iteration's forward and backward (not its optimizer step), after every operator,
  backward's included, the bytes the storages created in this iteration hold then (a storage resized to nothing,
  as FSDP2 frees a resharded parameter, holds none), parameters excluded; the largest such sum (for a pipeline
  stage, with its micro-batches in flight): the rank's true peak, wherever it falls (the loss's backward, a
  layer's backward beside the layer being recomputed, the embedding's gradient). A DTensor counts its local tensor
  (its wrapper's storage has the global size and no memory). Storages that end the iteration as gradients are
  left out (gradient memory, counted with the model states; DDP rebuilds its buckets, which the gradients are
  views into, in the second iteration's forward); gradients made on one micro-batch and replaced later (DDP's
  gradients beside its buckets during accumulation, FSDP2's and replicate()'s accumulated ones) are counted;
- whether the head and loss ran chunked (models/chunked_loss.py) in that iteration, which the plan predicts.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from rapidtrain.core.process import exit_after  # noqa: E402
from rapidtrain.models.transformer import TokenCrossEntropy  # noqa: E402
from rapidtrain.pretrain import ENTRY, MegatronPreTrainer  # noqa: E402
from rapidtrain.train.engine import Engine  # noqa: E402


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def storages_reachable(root: object, skip: set[int], depth: int = 8) -> dict[int, int]:
    """{storage address: bytes} of the tensors reachable from `root` through attributes, containers and
    optimizer state; `skip` holds the ids of objects not to enter (buffers)."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    stack = [(root, 0)]
    while stack:
        obj, level = stack.pop()
        if id(obj) in seen or id(obj) in skip or level > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensor = local(obj)
            if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes():
                found[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            if obj.grad is not None:
                stack.append((obj.grad, level + 1))
            continue
        if isinstance(obj, dict):
            stack += [(v, level + 1) for v in obj.values()] + [(k, level + 1) for k in obj if
                                                               isinstance(k, torch.Tensor)]
        elif isinstance(obj, (list, tuple, set)):
            stack += [(v, level + 1) for v in obj]
        elif isinstance(obj, torch.optim.Optimizer):
            stack += [(obj.state, level + 1), (obj.param_groups, level + 1)]
            stack += [(v, level + 1) for v in vars(obj).values()]
        elif isinstance(obj, torch.nn.Module):
            stack += [(p, level + 1) for p in obj.parameters()]
            stack += [(v, level + 1) for v in vars(obj).values() if not isinstance(v, dict)]
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("rapidtrain", "deepspeed", "torch"):
            stack += [(v, level + 1) for v in vars(obj).values()]
    return found


class PeakActivations(TorchDispatchMode):
    """The largest sum of live storages created under the mode, checked after each operator (forward and backward);
    `peak` leaves out the storages that are gradients when it is read (after backward)."""

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        super().__init__()
        self.parameters = parameters
        self.excluded = {StorageWeakRef(local(p).untyped_storage()) for p in parameters}
        self.created: set[StorageWeakRef] = set()
        self.checks: list[dict[StorageWeakRef, int]] = []  # the storages alive at each check, with their bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = local(t).untyped_storage()
                ref = StorageWeakRef(storage)
                if ref not in self.excluded:
                    self.created.add(ref)
        # Bytes as they are now: FSDP2 frees a resharded parameter by resizing its storage to 0, not dropping it.
        alive = {ref: torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
                 for ref in self.created if not ref.expired()}
        self.checks.append(alive)
        return out

    def gradient_storages(self) -> set[StorageWeakRef]:
        return {StorageWeakRef(local(p.grad).untyped_storage()) for p in self.parameters if p.grad is not None}

    @property
    def peak(self) -> int:
        grads = self.gradient_storages()
        return max((sum(size for ref, size in alive.items() if ref not in grads) for alive in self.checks), default=0)


class MeasuredTrainer(MegatronPreTrainer):
    """Measures the second iteration: activations over its forward and backward, model states just before its
    optimizer step (gradients present, optimizer state from the first step)."""

    def train_step(self, micro_batches, stop_requested=False):
        if self.iteration != 1:
            return super().train_step(micro_batches, stop_requested)
        runner = self.engine.runner
        parameters = list(runner.module.parameters())
        forward_backward, optimizer_step = runner.forward_backward, runner.step
        measured: dict = {}

        chunked_calls = []
        from_hidden = TokenCrossEntropy.from_hidden

        def counted_from_hidden(loss, *args, **kwargs):
            chunked_calls.append(1)
            return from_hidden(loss, *args, **kwargs)

        def measured_forward_backward(*args, **kwargs):
            TokenCrossEntropy.from_hidden = counted_from_hidden
            try:
                with PeakActivations(parameters) as mode:
                    total = forward_backward(*args, **kwargs)
            finally:
                TokenCrossEntropy.from_hidden = from_hidden
            measured["activation_bytes"] = mode.peak
            measured["chunked_loss"] = bool(chunked_calls)
            return total

        def measured_optimizer_step(*args, **kwargs):
            buffers = {id(b) for b in runner.module.buffers()}
            measured["state_bytes"] = sum(storages_reachable(runner, buffers).values())
            return optimizer_step(*args, **kwargs)

        runner.forward_backward, runner.step = measured_forward_backward, measured_optimizer_step
        try:
            result = super().train_step(micro_batches, stop_requested)
        finally:
            del runner.forward_backward, runner.step
        self.measured = measured
        return result


def run_all(runs: dict[str, list[str]], out: Path) -> None:
    import __main__

    __main__.__file__ = str(Path(__file__).resolve().parents[2] / "rapidtrain" / "pretrain.py")
    engine, results = None, {}
    for name, argv in runs.items():
        engine = Engine(argv=argv, entry=ENTRY)
        trainer = MeasuredTrainer(engine)
        trainer.train()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, trainer.measured)
        results[name] = gathered
        del trainer
        gc.collect()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    if engine is not None:
        engine.shutdown()


if __name__ == "__main__":
    exit_after(lambda: run_all(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))  # core/process.py
