"""fp16 trainings under every sharding, one after another in one torchrun launch (tests/distributed/test_fp16.py).

Usage: `torchrun --nproc-per-node N tests/distributed/fp16_runs.py RUNS.json`, RUNS.json a list of
`{"name", "argv", "out", "inject": null | {"iteration": I, "rank": R}}`. Each run is pretrain.py's code path
(Engine → MegatronPreTrainer → train). Every rank writes `{out}/{name}_rank{r}.json`: the iterations it skipped
and, for a run with `inject`, what the forced overflow did on this rank.

The overflow is forced here, not in rapidtrain: at iteration I, rank R writes inf into its own local gradient
shard (after the layout's reductions, right before the loss scaler unscales), so only that rank's flag is set
and the step must still be skipped everywhere.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rapidtrain.core.process import exit_after  # noqa: E402
from rapidtrain.pretrain import ENTRY  # noqa: E402
from rapidtrain.train.builtin_pretrainer import MegatronPreTrainer  # noqa: E402
from rapidtrain.train.engine import Engine  # noqa: E402


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class RecordingTrainer(MegatronPreTrainer):
    """Records the iterations every rank skipped; optionally forces an overflow on one rank's shard."""

    def __init__(self, engine: Engine, inject: dict[str, int] | None) -> None:
        super().__init__(engine)
        self.inject = inject
        self.skipped: list[int] = []
        self.report: dict[str, Any] = {}

    def after_step(self, result: Any) -> None:
        super().after_step(result)
        if result.skipped:
            self.skipped.append(self.iteration)

    def train_step(self, micro_batches: list[Any], stop_requested: bool = False) -> Any:
        if self.inject is None or self.iteration + 1 != self.inject["iteration"]:
            return super().train_step(micro_batches, stop_requested)
        runner = self.engine.runner
        rank = dist.get_rank()
        before = [local(p).detach().clone() for p in runner.parameters]
        scale_before = runner.loss_scale
        unscale = runner.scaler.unscale
        seen: dict[str, Any] = {}

        def unscale_after_forcing_inf(parameters: Any) -> torch.Tensor:
            parameters = list(parameters)
            if rank == self.inject["rank"]:
                grad = next(local(p.grad) for p in parameters if p.grad is not None and local(p.grad).numel())
                grad.view(-1)[0] = float("inf")
            found_inf = unscale(parameters)
            seen["local_overflow"] = bool(found_inf > 0)
            return found_inf

        runner.scaler.unscale = unscale_after_forcing_inf
        try:
            result = super().train_step(micro_batches, stop_requested)
        finally:
            runner.scaler.unscale = unscale
        after = [local(p).detach() for p in runner.parameters]
        self.report = {
            "local_overflow": seen["local_overflow"],
            "skipped": result.skipped,
            "weights_unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            "parameters": len(before),
            "scale_before": scale_before,
            "scale_after": runner.loss_scale,
        }
        return result


def run_all(runs: list[dict[str, Any]]) -> None:
    import __main__

    __main__.__file__ = str(Path(__file__).resolve().parents[2] / "rapidtrain" / "pretrain.py")  # pretrain.py's plan
    engine = None
    for run in runs:
        engine = Engine(argv=run["argv"], entry=ENTRY)
        trainer = RecordingTrainer(engine, run.get("inject"))
        trainer.train()
        rank = dist.get_rank()
        report = {"skipped": trainer.skipped, "injected": trainer.report}
        (Path(run["out"]) / f"{run['name']}_rank{rank}.json").write_text(json.dumps(report))
        del trainer
        gc.collect()
    if engine is not None:
        engine.shutdown()


if __name__ == "__main__":
    exit_after(lambda: run_all(json.loads(Path(sys.argv[1]).read_text())))  # rapidtrain/core/process.py
