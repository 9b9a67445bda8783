"""Tensor parallelism (DTensor) on gloo: the losses and global gradient norms of one process under TP 2 × DP 2,
with ZeRO-1 and with sequence parallelism, for GPT and BERT; half the parameter bytes per rank; dropout masks
that agree across tensor-parallel ranks where the tensor is replicated.

Run as a script under torchrun (2 ranks), this file is the probe of the per-rank properties.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

if __package__ in (None, ""):  # run by torchrun as the probe
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.parallel_runs import ITERATIONS, layout_runs  # noqa: E402
from tests.launch import read_grad_norms, read_losses, relative_difference, torchrun  # noqa: E402

TOLERANCE = 1e-5  # fp32, relative


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data):
    return layout_runs(tmp_path_factory, demo_data)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_dp2", "tp2_zero1", "tp2_sequence_parallel"])
def test_tensor_parallel_matches_one_process_losses_and_grad_norms(runs, layout):
    """6 iterations on 4 ranks (TP 2 × DP 2; with ZeRO-1 served by FSDP2 over dp; with sequence parallel):
    every loss and the logged global gradient norm equal one process's within 1e-5."""
    losses, single = read_losses(runs.losses(layout)), read_losses(runs.losses("single"))
    assert sorted(losses) == list(range(1, ITERATIONS + 1))
    assert relative_difference(losses, single) < TOLERANCE
    assert (
        relative_difference(read_grad_norms(runs.losses(layout)), read_grad_norms(runs.losses("single")))
        < TOLERANCE
    )


@pytest.mark.slow
def test_bert_tensor_parallel_matches_one_process(runs):
    """BERT (WordPiece vocabulary trained here, data from scripts/preprocess_data.py) at TP 2 × DP 2."""
    losses, single = read_losses(runs.losses("bert_tp2_dp2")), read_losses(runs.losses("bert_single"))
    assert sorted(losses) == list(range(1, ITERATIONS + 1))
    assert relative_difference(losses, single) < TOLERANCE


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tensor_parallel_probe")
    torchrun(2, __file__, [str(out)], timeout=600, warm=True)
    return json.loads((out / "probe.json").read_text())


@pytest.mark.slow
def test_parameter_bytes_per_rank_halve_at_tp2(probe):
    """Only norms, biases of row-split layers and position embeddings stay whole: TP 2 holds ~half of TP 1."""
    full, per_rank = probe["bytes"]["tp1"], probe["bytes"]["tp2"]
    assert full == 4 * 728_448  # the 4-layer test GPT, fp32
    assert 0.5 <= per_rank / full < 0.52


@pytest.mark.slow
def test_dropout_agrees_on_replicated_tensors_and_differs_on_shards(probe):
    """With dropout 0.3: the residual stream after every layer (replicated) is identical on both ranks, the
    shared generator stays in lockstep, while a rank's own part (forked generator) gets its own mask."""
    dropout = probe["dropout"]
    assert dropout["replicated_layer_outputs_equal"] == [True] * 4
    assert dropout["generator_in_lockstep"]
    assert not dropout["sharded_masks_equal"]
    assert dropout["sharded_fork_keeps_lockstep"]
    assert 0.25 < dropout["sharded_drop_fraction"] < 0.35


@pytest.mark.slow
def test_activation_recomputation_repeats_dropout_masks(probe):
    """TP 2 with dropout: --checkpoint-activations gives the same loss and gradients as no recomputation."""
    assert probe["recompute"]["loss_difference"] == 0.0
    assert probe["recompute"]["max_grad_difference"] < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gpt", "bert"])
def test_sequence_parallel_shards_the_residual_stream(probe, model_type):
    """--sequence-parallel: between layers each rank holds half the sequence (a DTensor sharded on dim 1),
    and loss and gradients still equal the unsplit model's."""
    sp = probe["sequence_parallel"][model_type]
    assert sp["sharded_on_sequence"]
    assert sp["local_sequence"] == sp["sequence"] // 2
    assert sp["loss_relative_difference"] < TOLERANCE
    assert sp["max_grad_difference"] < 1e-4  # gradients of a 128-token loss sum


# ---- the probe (runs under torchrun, 2 ranks) ----


def _config(**overrides):
    from rapidtrain.models import ModelConfig

    settings = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=64,
        max_position_embeddings=64,
        vocab_size=8192,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return ModelConfig(**(settings | overrides))


def _split(config, mesh, sequence_parallel=False, seed=3):
    from rapidtrain.models import build_model
    from rapidtrain.parallel.tensor_parallel import apply_tensor_parallel

    model = build_model(config, seed=seed)
    apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    return model


def _loss(model, batch):
    if model.config.model_type == "bert":
        return model(
            batch["ids"],
            attention_mask=batch["mask"],
            tokentype_ids=batch["types"],
            lm_labels=batch["labels"],
        ).sum()
    return model(batch["ids"], labels=batch["labels"]).sum()


def _batch(config):
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=generator)
    return {
        "ids": ids,
        "labels": ids.roll(-1, dims=1),
        "mask": torch.ones_like(ids),
        "types": torch.zeros_like(ids),
    }


def _equal_on_all_ranks(tensor) -> bool:
    import torch
    import torch.distributed as dist

    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def _parameter_bytes(mesh) -> dict:
    from rapidtrain.models import build_model

    full = sum(p.numel() * p.element_size() for p in build_model(_config()).parameters())
    split = sum(p.to_local().numel() * p.element_size() for p in _split(_config(), mesh).parameters())
    return {"tp1": full, "tp2": split}


def _dropout(mesh) -> dict:
    import torch

    from rapidtrain.parallel.tensor_parallel import ShardedDropoutRNG

    config = _config(hidden_dropout=0.3, attention_dropout=0.3)
    model = _split(config, mesh)
    outputs = []
    for layer in model.layers.values():
        layer.register_forward_hook(lambda _m, _a, output: outputs.append(output.detach()))
    torch.manual_seed(11)
    _loss(model, _batch(config)).backward()
    result = {
        "replicated_layer_outputs_equal": [_equal_on_all_ranks(o) for o in outputs],
        "generator_in_lockstep": _equal_on_all_ranks(torch.get_rng_state()),
    }
    dropout = torch.nn.Dropout(0.3)
    ShardedDropoutRNG(mesh.get_local_rank()).attach(dropout)
    mask = dropout(torch.ones(10_000)) == 0
    result.update(
        sharded_masks_equal=_equal_on_all_ranks(mask),
        sharded_drop_fraction=float(mask.float().mean()),
        sharded_fork_keeps_lockstep=_equal_on_all_ranks(torch.get_rng_state()),
    )
    return result


def _local_grads(model) -> dict:
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def _recompute(mesh) -> dict:
    import torch

    from rapidtrain.parallel.transforms import apply_activation_checkpointing

    config = _config(hidden_dropout=0.3, attention_dropout=0.3)
    losses, grads = [], []
    for checkpointing in (False, True):
        model = _split(config, mesh)
        if checkpointing:
            apply_activation_checkpointing(model)
        torch.manual_seed(11)
        loss = _loss(model, _batch(config))
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(_local_grads(model))
    names = [n.replace("_checkpoint_wrapped_module.", "") for n in grads[1]]
    worst = max(float((grads[0][n] - g).abs().max()) for n, g in zip(names, grads[1].values(), strict=True))
    return {"loss_difference": abs(losses[0] - losses[1]), "max_grad_difference": worst}


def _sequence_parallel(mesh, model_type: str) -> dict:
    from rapidtrain.models import build_model

    config = _config(model_type=model_type, num_tokentypes=2 if model_type == "bert" else 0, vocab_size=1024)
    reference = build_model(config, seed=3)
    reference_loss = _loss(reference, _batch(config))
    reference_loss.backward()
    model = _split(config, mesh, sequence_parallel=True)
    between_layers = []
    model.layers["0"].register_forward_hook(lambda _m, _a, output: between_layers.append(output))
    loss = _loss(model, _batch(config))
    loss.backward()
    reference_grads = dict(reference.named_parameters())
    worst = max(float((g - reference_grads[n].grad).abs().max()) for n, g in _local_grads(model).items())
    return {
        "sharded_on_sequence": [p.is_shard(1) for p in between_layers[0].placements] == [True],
        "local_sequence": between_layers[0].to_local().shape[1],
        "sequence": config.seq_length,
        "loss_relative_difference": abs(float(loss.detach()) - float(reference_loss.detach()))
        / float(reference_loss.detach()),
        "max_grad_difference": worst,
    }


def run_probe(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    result = {
        "bytes": _parameter_bytes(mesh),
        "dropout": _dropout(mesh),
        "recompute": _recompute(mesh),
        "sequence_parallel": {kind: _sequence_parallel(mesh, kind) for kind in ("gpt", "bert")},
    }
    if dist.get_rank() == 0:
        (out / "probe.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rapidtrain.core.process import exit_after

    exit_after(lambda: run_probe(Path(sys.argv[1])))  # no interpreter finalization racing gloo's threads
