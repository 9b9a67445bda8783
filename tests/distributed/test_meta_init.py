"""Sharded layouts build the model on the meta device: no rank holds it whole, and every weight is bitwise the
one-process initialisation.

On 4 gloo ranks, for FSDP2, SDP, tensor parallel (TP 2 × DP 2), pipeline parallel (PP 2 × DP 2), TP 2 × PP 2,
interleaved PP 2 with ZeRO-1 served by FSDP2, and DeepSpeed ZeRO-3: the built-in pretraining's model provider
returns a model whose every parameter is on meta (nothing allocated), `Engine.compose` splits, wraps and
materializes it, and each rank then holds only its share of the parameter bytes: its pipeline stage's (the
tied embedding is on the first and the last stage, as in Megatron) divided by the ranks that shard it (TP, or
DP under FSDP/ZeRO-3), within 10%, and never the whole model. The checkpoint state of the
composed model (every shard, gathered here for the comparison only) equals `build_model(config, seed)` of one
process bit for bit, and together the ranks cover every parameter.

Run as a script under torchrun (4 ranks), this file is the probe.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

if __package__ in (None, ""):  # run by torchrun as the probe
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.launch import PRETRAIN, torchrun  # noqa: E402

SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3",
         "--num-workers", "0", "--make-vocab-size-divisible-by", "512"]
# name → (flags, ranks that shard one pipeline stage's parameters)
LAYOUTS = {
    "fsdp": (["--fsdp-memory-optimization"], 4),
    "sdp": (["--oss-sdp-memory-optimization"], 4),
    "tp2_dp2": (["--tensor-model-parallel-size", "2"], 2),
    "pp2_dp2": (["--pipeline-model-parallel-size", "2"], 1),
    "tp2_pp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2),
    "pp2_virtual_zero1": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                           "--zero-1-memory-optimization"], 2),
    "zero3": (["--zero-3-memory-optimization"], 4),
}


def local_bytes(runner) -> int:
    """Bytes of parameters this rank holds (DTensor: its shard; ZeRO-3: its partition plus persistent ones)."""
    engine = getattr(runner, "engine", None)
    if engine is not None:  # DeepSpeed: a partitioned parameter holds nothing outside a gather
        return sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
    total = 0
    for param in runner.module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def probe(out: Path) -> None:
    import torch
    import torch.distributed as dist

    import __main__
    from rapidtrain.models import build_model
    from rapidtrain.pretrain import ENTRY, MegatronPreTrainer
    from rapidtrain.train.engine import Engine

    # The probe runs pretrain.py's code path: its plan must be the built-in pretraining's, not a user script's.
    __main__.__file__ = str(PRETRAIN)
    engine = None
    for name, (flags, _) in LAYOUTS.items():
        engine = Engine(argv=SHAPE + flags, entry=ENTRY)
        trainer = MegatronPreTrainer(engine)
        model, *_ = trainer.model_optimizer_lr_scheduler_provider()
        on_meta = all(p.is_meta for p in model.parameters())
        engine.compose(model, model_factory=trainer.model_factory())
        reference = build_model(engine.plan.model, seed=engine.plan.training.seed).state_dict()
        whole_bytes = sum(v.numel() * v.element_size() for k, v in reference.items()
                          if k != "output.weight" or not engine.plan.model.tie_embeddings)
        unequal, seen = [], []
        for key, value in engine.runner.state_dict()["model"].items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            seen.append(key)
            if not torch.equal(full.cpu(), reference[key]):
                unequal.append(key)
        covered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(covered, seen)
        stage_bytes = sum(reference[k].numel() * reference[k].element_size() for k in set(seen) & set(reference))
        report = {"on_meta": on_meta, "unequal": unequal, "local_bytes": local_bytes(engine.runner),
                  "whole_bytes": whole_bytes, "stage_bytes": stage_bytes,
                  "missing": sorted(set(reference) - {k for c in covered for k in c}),
                  "plan_says_meta": engine.plan.switches.build_on_meta}
        (out / f"{name}_rank{dist.get_rank()}.json").write_text(json.dumps(report))
        del trainer, model
    engine.shutdown()


@pytest.fixture(scope="module")
def probed(tmp_path_factory, demo_data) -> Path:
    out = tmp_path_factory.mktemp("meta_init")
    torchrun(4, __file__, [str(out)], timeout=900, warm=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_layout_builds_on_meta_and_initialises_bitwise_the_one_process_weights(probed, layout):
    _, shards = LAYOUTS[layout]
    for rank in range(4):
        report = json.loads((probed / f"{layout}_rank{rank}.json").read_text())
        assert report["plan_says_meta"] and report["on_meta"], "the provider allocated the model"
        assert report["unequal"] == [], f"rank {rank}: initial values differ from one process's"
        assert report["missing"] == [], "some parameters are on no rank"
        # Norms, biases and position embeddings are replicated under TP (a few % here).
        assert report["local_bytes"] <= report["stage_bytes"] / shards * 1.10, (
            f"rank {rank} holds {report['local_bytes']} of its stage's {report['stage_bytes']} bytes")
        assert report["local_bytes"] < report["whole_bytes"]


if __name__ == "__main__":
    from rapidtrain.core.process import exit_after

    exit_after(lambda: probe(Path(sys.argv[1])))  # no interpreter finalization racing gloo's threads
