"""A DeepSpeed / Megatron-DeepSpeed checkpoint folder, read for --load.

ROOT/latest names the tag (`global_stepN`); ROOT/TAG/mp_rank_{TT:02d}_model_states.pt holds, per tensor rank,
`module` (the model's state dict: Megatron-DeepSpeed's GPT in the legacy model's names), DeepSpeed's own fields
(`global_steps`, `global_samples`, `lr_scheduler`, `ds_config`, ...) and the client state Megatron-DeepSpeed adds
(`args`, `iteration`, `checkpoint_version`, RNG states). Under DeepSpeed's pipeline engine `module` is None and each
layer is in `layer_{LL:02d}[-model_{TT:02d}]-model_states.pt`, named as its layer class names them (the embedding's
`word_embeddings.weight`, a transformer layer's `input_layernorm.weight`, ..., the final norm's `weight`), numbered
by position in the pipeline's layer list. ZeRO stage 1/2 keeps the optimizer's state in
`zero_pp_rank_D_mp_rank_TT_optim_states.pt`, one per data-parallel rank, as flat partitions with a map of where each
parameter's part lies: Adam's moments are read from them by parameter name (read_zero_moments). ZeRO stage 3 keeps
even the weights partitioned: refused, naming the way round.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

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
    pipeline_engine = False
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
            pipeline_engine = True
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
    state = ForeignState(str(directory), [shards], saved_args, iteration, consumed,
                         scheduler if isinstance(scheduler, dict) else None, False, notes)
    if pipeline_engine:
        notes.append("its pipeline engine's optimizer files (named by layer position) are not read: the optimizer "
                     "starts fresh")
    else:
        read_zero_moments(state, directory, len(shards), notes)
    return state


MOMENTS = ("exp_avg", "exp_avg_sq")
_OPTIMIZER_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2})_optim_states\.pt$")


def _fragment(address: Any) -> tuple[int, int]:
    """(start, numel) of DeepSpeed's fragment_address, read as data (a dataclass, or a tuple of numel and start)."""
    values = getattr(address, "state", None) or getattr(address, "__dict__", {})
    if isinstance(values, dict) and "start" in values:
        return int(values["start"]), int(values["numel"])
    numel, start = getattr(address, "arguments", address)
    return int(start), int(numel)


def read_zero_moments(state: ForeignState, directory: Path, tensor_ranks: int, notes: list[str]) -> None:
    """Adam's moments from ZeRO stage 1/2's optimizer files (`zero_pp_rank_D_mp_rank_TT_optim_states.pt`, one per
    data-parallel rank D): each holds its partition of every parameter group's flat fp32 buffer, the base
    optimizer's state on it, and `param_slice_mappings`, where in the partition each parameter's part starts and
    how long it is. A parameter's moments are its parts in data-parallel rank order. Left unread (the optimizer
    starts fresh, said in `notes`) when the files are missing, have not stepped, or hold another optimizer."""
    files: dict[int, list[tuple[int, Path]]] = {}
    for path in sorted(directory.iterdir()):
        match = _OPTIMIZER_FILE.match(path.name)
        if match:
            files.setdefault(int(match.group(2)), []).append((int(match.group(1)), path))
    if sorted(files) != list(range(tensor_ranks)):
        notes.append("no ZeRO optimizer files for every tensor rank: the optimizer starts fresh")
        return
    moments: dict[str, list[Shard]] = {key: [] for key in MOMENTS}
    steps: set[int] = set()
    for tensor_rank in range(tensor_ranks):
        parts: dict[str, dict[str, list[torch.Tensor]]] = {key: {} for key in MOMENTS}
        for _, path in sorted(files[tensor_rank]):
            saved = load_foreign_pickle(path)
            optimizer = saved.get("optimizer_state_dict") if isinstance(saved, dict) else None
            base = optimizer.get("base_optimizer_state") if isinstance(optimizer, dict) else None
            group_states = base.get("state") if isinstance(base, dict) else None
            mappings = optimizer.get("param_slice_mappings") if isinstance(optimizer, dict) else None
            if not group_states or not isinstance(mappings, list):
                notes.append(f"{path.name} holds no optimizer state by parameter (not stepped yet, or not ZeRO "
                             "stage 1/2's layout): the optimizer starts fresh")
                return
            for group, mapping in enumerate(mappings):
                group_state = group_states.get(group, {})
                if not all(isinstance(group_state.get(key), torch.Tensor) for key in MOMENTS):
                    notes.append(f"{path.name}: its optimizer keeps no Adam moments ({', '.join(map(str, group_state))}"
                                 "): the optimizer starts fresh")
                    return
                step = group_state.get("step")
                steps.add(int(step.item() if isinstance(step, torch.Tensor) else step or 0))
                for name, address in mapping.items():
                    start, numel = _fragment(address)
                    for key in MOMENTS:
                        parts[key].setdefault(name, []).append(group_state[key][start:start + numel])
        shapes = _parameter_shapes(directory, tensor_rank)
        for key in MOMENTS:
            moments[key].append(core_names(flatten({
                name: torch.cat(pieces).view(shapes[name]) for name, pieces in parts[key].items()})))
    if len(steps) != 1:
        notes.append(f"its optimizer's groups have taken different numbers of steps ({sorted(steps)}): the optimizer "
                     "starts fresh")
        return
    state.moments = {key: [shards] for key, shards in moments.items()}
    state.optimizer_step = steps.pop()


def _parameter_shapes(directory: Path, tensor_rank: int) -> dict[str, torch.Size]:
    saved = load_foreign_pickle(directory / f"mp_rank_{tensor_rank:02d}_model_states.pt")
    groups = saved.get("param_shapes") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        raise CheckpointError(f"{directory}: mp_rank_{tensor_rank:02d}_model_states.pt has no param_shapes, which its "
                              "optimizer files need")
    return {name: torch.Size(shape) for group in groups for name, shape in group.items()}

