"""torchrun worker: one training step of an expert-parallel MoE GPT through the real Engine and Trainer,
checked on every rank against a plain model that sees the whole global batch in one process.

Writes OUT/rank_{r}.json with:
- gradient_difference: ‖gradients the optimizer sees − reference‖ / ‖reference‖ (shared parameters after
  DDP, expert slices after the expert_dp reduction; reference: tests/moe_reference.py, with the balancing
  loss built by hand from router probabilities, not through the layer's injector);
- grad_norm (logged by the runner) and expected_norm (the reference model's: each expert once);
- loaded_ok: this run's checkpoint, loaded into a plain full-size model (EP 1), equals this run's weights;
- reloaded_ok: the same checkpoint loaded back into this run's own (zeroed) model restores it.

    torchrun --nproc-per-node 4 tests/distributed/expert_parallel_worker.py OUT EP [extra flags]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rapidtrain.config.settings import Precision
from rapidtrain.core.process import exit_after
from rapidtrain.models import build_model
from rapidtrain.parallel.experts import ExpertParallelExperts
from rapidtrain.parallel.runner import TorchRunner
from rapidtrain.train.engine import Engine
from tests.moe_reference import (
    OneStepTrainer,
    canonical,
    capture_step_gradients,
    full,
    global_batches,
    model_flags,
    reference_gradients,
    relative_gradient_difference,
)

MICRO_BATCHES_PER_RANK = 2


def loads_at_ep1(runner: TorchRunner, config, directory: Path, expert_rank: int) -> bool:  # noqa: ANN001
    """Save this run's state, load it into a plain full-size model, compare with this rank's weights."""
    dcp.save(runner.state_dict(), checkpoint_id=str(directory))
    plain = build_model(config, seed=99)
    loader = TorchRunner(
        module=plain,
        optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
        precision=Precision("fp32", "none", ""),
        device_type="cpu",
        clip_grad=0.0,
    )
    state = loader.state_dict_for_loading(load_optimizer=False)
    dcp.load(state, checkpoint_id=str(directory))
    loader.load_state_dict(state, load_optimizer=False)
    same = True
    for name, param in runner.module.named_parameters():
        mine, whole = full(param), plain.get_parameter(canonical(name)).detach()
        if whole.shape != mine.shape:
            whole = whole[expert_rank * mine.shape[0] : (expert_rank + 1) * mine.shape[0]]
        same &= torch.equal(whole, mine)
    return bool(same)


def reloads_itself(runner: TorchRunner, directory: Path) -> bool:
    """Overwrite this run's weights, load the saved checkpoint back into the same runner, compare."""
    before = {name: full(param) for name, param in runner.module.named_parameters()}
    with torch.no_grad():
        for param in runner.module.parameters():
            param.zero_()
    state = runner.state_dict_for_loading(load_optimizer=True)
    dcp.load(state, checkpoint_id=str(directory))
    runner.load_state_dict(state, load_optimizer=True)
    return all(torch.equal(before[name], full(param)) for name, param in runner.module.named_parameters())


def main() -> None:
    out, ep, extra = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    world = int(os.environ["WORLD_SIZE"])
    tensor_parallel = (
        int(extra[extra.index("--tensor-model-parallel-size") + 1])
        if ("--tensor-model-parallel-size" in extra)
        else 1
    )
    data_parallel = world // tensor_parallel
    engine = Engine(
        argv=model_flags(MICRO_BATCHES_PER_RANK, data_parallel)
        + ["--expert-model-parallel-size", str(ep), *extra]
    )
    config = engine.plan.model
    trainer = OneStepTrainer(engine)
    trainer.model, *_ = engine.compose(build_model(config, seed=3))
    runner = engine.runner
    expert_rank = dist.get_rank(engine.mesh.group("ep")) if ep > 1 else 0
    seen = capture_step_gradients(runner)

    batches = global_batches(MICRO_BATCHES_PER_RANK * data_parallel)
    first = engine.mesh.data_parallel_rank * MICRO_BATCHES_PER_RANK
    result = trainer.train_step(batches[first : first + MICRO_BATCHES_PER_RANK])
    expected = reference_gradients(build_model(config, seed=3), batches, config.moe_aux_loss_coeff)
    # In fp64: torch's fp32 norm kernel is off by ~1e-5 relative on the embedding's gradient.
    expected_norm = float(sum(g.double().square().sum() for g in expected.values()).sqrt())

    report = {
        "rank": dist.get_rank(),
        "expert_parts": [part.__self__.__class__.__name__ for part in runner.before_step],
        "loss": float(result.loss),
        "gradients_checked": len(seen),
        "gradient_difference": relative_gradient_difference(seen, expected, expert_rank),
        "grad_norm": float(result.grad_norm),
        "expected_norm": expected_norm,
        "loaded_ok": loads_at_ep1(runner, config, out / "checkpoint", expert_rank),
        "reloaded_ok": reloads_itself(runner, out / "checkpoint"),
        "sharded_modules": [
            canonical(n) for n, m in runner.module.named_modules() if isinstance(m, ExpertParallelExperts)
        ],
        "expert_shapes": {
            canonical(n): list(full(p).shape) for n, p in runner.module.named_parameters() if ".experts." in n
        },
    }
    (out / f"rank_{dist.get_rank()}.json").write_text(json.dumps(report))
    engine.shutdown()


if __name__ == "__main__":
    exit_after(main)  # no interpreter finalization racing gloo's threads (rapidtrain/core/process.py)
