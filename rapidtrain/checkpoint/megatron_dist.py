"""Megatron-LM's torch_dist checkpoint (`--ckpt-format torch_dist`, Megatron-Core's dist_checkpointing), read for
--load without megatron-core: it is a torch.distributed.checkpoint folder, which torch's FileSystemReader reads.

ROOT/latest_checkpointed_iteration.txt → ROOT/iter_{N:07d}/ holding `metadata.json` (`sharded_backend`:
"torch_dist"), `common.pt` (what is not sharded: `args`, `iteration`, `opt_param_scheduler`, ...), `.metadata`
and `__R_K.distcp`. Each model tensor is stored whole, under its Megatron-Core name: the tensor-parallel ranks'
parts in place (a fused q/k/v as Megatron holds it whole, grouped by key/value head; SwiGLU's first layer as
the whole gate then the whole up projection), the transformer layers stacked on a leading axis of
--num-layers (`decoder.layers.self_attention.linear_qkv.weight` is [layers, rows, hidden]), or one key per layer
(`decoder.layers.N. ...`). Optimizer and RNG entries are not read; nothing pickled in the folder runs (the
metadata through the allow-list unpickler, common.pt through foreign_pickle).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rapidtrain.checkpoint.checkpointer import METADATA_FILE, read_metadata_file, safe_dcp_load
from rapidtrain.checkpoint.compatibility import CheckpointError
from rapidtrain.checkpoint.foreign_formats import ForeignCheckpoint
from rapidtrain.checkpoint.foreign_pickle import load_foreign_pickle, plain_args
from rapidtrain.checkpoint.megatron_layout import Shard, core_name
from rapidtrain.checkpoint.megatron_legacy import ForeignState, _count

_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
_STACKED = "decoder.layers."


def _model_tensors(checkpoint: ForeignCheckpoint) -> dict[str, torch.Tensor]:
    """Every model tensor of the folder, whole (optimizer and RNG entries left out)."""
    metadata = read_metadata_file(checkpoint.directory / METADATA_FILE)
    tensors: dict[str, torch.Tensor] = {}
    for key, stored in metadata.state_dict_metadata.items():
        if key.startswith(_MODEL_PREFIXES) and hasattr(stored, "size") and not key.endswith("_extra_state"):
            tensors[key] = torch.empty(stored.size, dtype=stored.properties.dtype)
    if not tensors:
        raise CheckpointError(f"{checkpoint.directory}: no model tensors among its entries (embedding.*, decoder.*, "
                              "output_layer.*): not a Megatron-Core GPT checkpoint")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_dcp_load(tensors, checkpoint.directory, no_dist=True)
    return tensors


def _per_layer(tensors: dict[str, torch.Tensor], num_layers: int | None) -> Shard:
    """Stacked layer entries split into one entry per layer (`decoder.layers.X` → `decoder.layers.N.X`)."""
    shard: Shard = {}
    for key, value in tensors.items():
        rest = key[len(_STACKED):] if key.startswith(_STACKED) else None
        if rest is None or rest.split(".")[0].isdigit():
            shard[key] = value
            continue
        if num_layers is not None and value.shape[0] != num_layers:
            raise CheckpointError(f"{key}: {value.shape[0]} stacked layers, the checkpoint's args say {num_layers}")
        for layer, part in enumerate(value.unbind(0)):
            shard[f"{_STACKED}{layer}.{rest}"] = part.clone()
    return {new: value for name, value in shard.items() if (new := core_name(name)) is not None}


def read_megatron_dist(checkpoint: ForeignCheckpoint) -> ForeignState:
    common_file = checkpoint.directory / "common.pt"
    common: Any = load_foreign_pickle(common_file) if common_file.is_file() else {}
    if not isinstance(common, dict):
        raise CheckpointError(f"{common_file}: a {type(common).__name__}, not Megatron's common state")
    saved_args = plain_args(common.get("args"))
    layers = saved_args.get("num_layers")
    shard = _per_layer(_model_tensors(checkpoint), layers if isinstance(layers, int) else None)
    release = checkpoint.tag == "release"
    iteration = 0 if release else _count(common.get("iteration", 0))
    scheduler = common.get("opt_param_scheduler", common.get("lr_scheduler"))
    # Stored whole: one "tensor rank" holding everything; the padded vocabulary is the saved TP's.
    return ForeignState(str(checkpoint.directory), [[shard]], saved_args, iteration,
                        _count(saved_args.get("consumed_train_samples", 0)),
                        scheduler if isinstance(scheduler, dict) else None, release,
                        [f"{checkpoint.describe()}: {len(shard)} model tensors, stored whole"])
