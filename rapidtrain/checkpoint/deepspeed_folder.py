"""A DeepSpeed / Megatron-DeepSpeed checkpoint folder, read for --load.

ROOT/latest names the tag (`global_stepN`); ROOT/TAG/mp_rank_{TT:02d}_model_states.pt holds, per tensor rank,
`module` (the model's state dict: Megatron-DeepSpeed's GPT in the legacy model's names), DeepSpeed's own fields
(`global_steps`, `global_samples`, `lr_scheduler`, `ds_config`, ...) and the client state Megatron-DeepSpeed adds
(`args`, `iteration`, `checkpoint_version`, RNG states). Under DeepSpeed's pipeline engine `module` is None and each
layer is in `layer_{LL:02d}[-model_{TT:02d}]-model_states.pt`, named as its layer class names them (the embedding's
`word_embeddings.weight`, a transformer layer's `input_layernorm.weight`, ..., the final norm's `weight`), numbered
by position in the pipeline's layer list. The optimizer's state is in `*_optim_states.pt`, cut as ZeRO cut its flat
buffers: it is not read (the model weights are, and the optimizer starts fresh; the plan says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rapidtrain.checkpoint.compatibility import CheckpointError
from rapidtrain.checkpoint.foreign_formats import DEEPSPEED_LAYER_FILE, DEEPSPEED_MODEL_FILE, ForeignCheckpoint
from rapidtrain.checkpoint.foreign_pickle import load_foreign_pickle, plain_args
from rapidtrain.checkpoint.megatron_layout import Shard, core_names, flatten
from rapidtrain.checkpoint.megatron_legacy import ForeignState, _count

_ZERO3_REFUSAL = ("{directory}: a ZeRO stage 3 checkpoint: its weights are cut among the zero_pp_rank_* files, which "
                  "are not read. Save the run once with ZeRO stage 1 or 2 (or consolidate it with the zero_to_fp32.py "
                  "DeepSpeed wrote beside it into a plain state dict)")


def _files(directory: Path, pattern: Any) -> list[tuple[tuple[int, ...], Path]]:
    found = []
    for path in sorted(directory.iterdir()):
        match = pattern.match(path.name)
        if match:
            found.append((tuple(int(g or 0) for g in match.groups()), path))
    return found


def _layer_shard(index: int, state: dict[str, Any], layer: int) -> tuple[str, Shard]:
    """One pipeline layer file's tensors in the legacy model's names: ("embedding" | "layer" | "final" | "skip")."""
    flat = flatten(state)
    if "word_embeddings.weight" in flat:
        return "embedding", {f"language_model.embedding.{name}": value for name, value in flat.items()}
    if any(name.startswith(("input_layernorm.", "self_attention.")) for name in flat):
        return "layer", {f"language_model.encoder.layers.{layer}.{name}": value for name, value in flat.items()}
    if set(flat) and set(flat) <= {"weight", "bias"}:
        return "final", {f"language_model.encoder.final_layernorm.{name}": value for name, value in flat.items()}
    if not flat:
        return "skip", {}
    raise CheckpointError(f"pipeline layer {index}: holds {', '.join(sorted(flat)[:5])}, which is no layer of "
                          "Megatron-DeepSpeed's GPT")


def _pipeline_model(directory: Path, tensor: int) -> Shard:
    """Tensor rank `tensor`'s whole model from its layer files, layers numbered by their order."""
    layers = sorted((index, path) for (index, rank), path in _files(directory, DEEPSPEED_LAYER_FILE) if rank == tensor)
    shard: Shard = {}
    seen_embedding, count = False, 0
    for index, path in layers:
        state = load_foreign_pickle(path)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: a {type(state).__name__}, not a layer's state dict")
        kind, tensors = _layer_shard(index, state, count)
        if kind == "embedding" and seen_embedding:
            continue  # the tied output layer's copy of the embedding, on the last stage
        seen_embedding = seen_embedding or kind == "embedding"
        count += kind == "layer"
        shard.update(tensors)
    return shard


def read_deepspeed(checkpoint: ForeignCheckpoint) -> ForeignState:
    directory = checkpoint.directory
    model_files = _files(directory, DEEPSPEED_MODEL_FILE)
    if not model_files and any(directory.glob("zero_pp_rank_*_model_states.pt")):
        raise CheckpointError(_ZERO3_REFUSAL.format(directory=directory))
    if not model_files:
        raise CheckpointError(f"{directory}: no mp_rank_*_model_states.pt: the DeepSpeed checkpoint is incomplete "
                              "(or its files were moved)")
    ranks = [rank for (rank,), _ in model_files]
    if ranks != list(range(len(ranks))):
        raise CheckpointError(f"{directory}: its model files are of tensor ranks {ranks}: one is missing")
    shards: list[Shard] = []
    first: dict[str, Any] = {}
    for (rank,), path in model_files:
        saved = load_foreign_pickle(path)
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path}: a {type(saved).__name__}, not a DeepSpeed checkpoint's dict")
        if rank == 0:
            first = saved
        module = saved.get("module")
        if isinstance(module, dict) and module:
            shards.append(core_names(flatten({k: v for k, v in module.items() if isinstance(k, str)})))
        else:
            shards.append(core_names(_pipeline_model(directory, rank)))
    if any(value.numel() == 0 for shard in shards for value in shard.values()):
        raise CheckpointError(_ZERO3_REFUSAL.format(directory=directory))
    if not any(shards):
        raise CheckpointError(f"{directory}: no model weights in it (DeepSpeed saved no module and no layer files)")
    saved_args = plain_args(first.get("args"))
    iteration = _count(first.get("iteration", first.get("global_steps", 0)))
    consumed = _count(saved_args.get("consumed_train_samples", first.get("global_samples", 0)))
    scheduler = first.get("lr_scheduler")
    notes = [f"{checkpoint.describe()}: tensor parallel {len(shards)}"]
    return ForeignState(str(directory), [shards], saved_args, iteration, consumed,
                        scheduler if isinstance(scheduler, dict) else None, False, notes)

