"""Read a saved checkpoint in one process, without a process group: the model's tensors whole (whatever
layout wrote them: torch.distributed.checkpoint stitches the shards) and the flags it was saved with.

The export script and `rapidtrain generate` use it, through the checkpoint module's safe readers: nothing
stored in the files runs, and damaged files are named.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from pathlib import Path

import torch

from rapidtrain.checkpoint import (
    METADATA_FILE,
    CheckpointError,
    check_complete,
    iteration_dir,
    latest_iteration,
    read_common,
    read_metadata_file,
    safe_dcp_load,
    verify_checkpoint,
)
from rapidtrain.models.config import ModelConfig


def checkpoint_directory(load: str | Path, iteration: int | None = None) -> Path:
    """The iter_* folder to read (`load` is a --save folder or one iter_* folder), refused with a clear
    error when missing, not completely written, or damaged (its manifest's checksums)."""
    load = Path(load)
    if (load / METADATA_FILE).exists():
        directory = load
    else:
        iteration = iteration if iteration is not None else latest_iteration(load)
        if iteration is None:
            raise CheckpointError(
                f"--load {load}: no latest_checkpointed_iteration.txt and no .metadata there; "
                "point it at a --save folder or one of its iter_* folders."
            )
        directory = iteration_dir(load, iteration)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist: choose a complete iteration with --iteration.")
    check_complete(directory)
    verify_checkpoint(directory)
    return directory


def consolidated_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP checkpoint, whole, read in this one process: shards written by
    FSDP/TP/PP/EP ranks are stitched by torch.distributed.checkpoint from its metadata (read by an
    allow-list unpickler: nothing stored in the file runs)."""
    metadata = read_metadata_file(directory / METADATA_FILE)
    model: dict[str, torch.Tensor] = {}
    for key, path in metadata.planner_data.items():
        stored = metadata.state_dict_metadata[key]
        if path[0] == "model" and len(path) == 2 and hasattr(stored, "size"):
            model[path[1]] = torch.empty(stored.size, dtype=stored.properties.dtype)
    if not model:
        raise CheckpointError(f"checkpoint {directory} holds no model tensors (was it written by rapidtrain?)")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_dcp_load({"model": model}, directory, no_dist=True)
    return model


def saved_args(directory: Path) -> argparse.Namespace:
    """The flags the checkpoint was saved with; flags added since then take today's defaults."""
    from rapidtrain.arguments import build_parser

    defaults = vars(build_parser().parse_args([]))
    return argparse.Namespace(**(defaults | read_common(directory)["args"]))


def saved_model_config(directory: Path) -> ModelConfig | None:
    """The built-in model's settings saved with the checkpoint's plan; None for a Hugging Face model's
    checkpoint. The Hugging Face folder that initialised it (if any) is not needed again: the weights are in
    the checkpoint."""
    common = read_common(directory)
    model = (common.get("plan") or {}).get("model")
    if model:
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in model.items() if k in fields}
        return ModelConfig(**{**values, "hf_weights": None})
    from rapidtrain.models.hf_config import trains_builtin_model  # older checkpoints: from the saved flags
    from rapidtrain.plan import model_config_from_args

    args = saved_args(directory)
    if not trains_builtin_model(args) or not getattr(args, "padded_vocab_size", None):
        return None
    args.pretrained_model_name_or_path, args.builtin_from_pretrained = None, False
    return model_config_from_args(args, args.padded_vocab_size)
