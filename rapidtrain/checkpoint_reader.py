"""Read a saved checkpoint in one process, without a process group: the model's tensors whole (whatever
layout wrote them: torch.distributed.checkpoint stitches the shards) and the flags it was saved with.

The export script and `rapidtrain generate` use it. `common.pt` is read with `torch.load(weights_only=True)`:
plain data only, no pickled code runs.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from rapidtrain.checkpoint import COMMON_FILE, CheckpointError, iteration_dir, latest_iteration
from rapidtrain.models.config import ModelConfig


def checkpoint_directory(load: str | Path, iteration: int | None = None) -> Path:
    """The iter_* folder to read (`load` is a --save folder or one iter_* folder), refused with a clear
    error when missing or not completely written."""
    load = Path(load)
    if (load / ".metadata").exists():
        directory = load
    else:
        iteration = iteration if iteration is not None else latest_iteration(load)
        if iteration is None:
            raise CheckpointError(
                f"--load {load}: no latest_checkpointed_iteration.txt and no .metadata there; "
                "point it at a --save folder or one of its iter_* folders."
            )
        directory = iteration_dir(load, iteration)
    missing = [name for name in (".metadata", COMMON_FILE) if not (directory / name).exists()]
    if missing:
        raise CheckpointError(
            f"checkpoint {directory} is missing {', '.join(missing)}: it does not exist or was not "
            "completely written. Choose a complete iteration with --iteration."
        )
    return directory


def consolidated_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP checkpoint, whole, read in this one process: shards written by
    FSDP/TP/PP/EP ranks are stitched by torch.distributed.checkpoint from its metadata."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    model: dict[str, torch.Tensor] = {}
    for key, path in metadata.planner_data.items():
        stored = metadata.state_dict_metadata[key]
        if path[0] == "model" and len(path) == 2 and hasattr(stored, "size"):
            model[path[1]] = torch.empty(stored.size, dtype=stored.properties.dtype)
    if not model:
        raise CheckpointError(f"checkpoint {directory} holds no model tensors (was it written by rapidtrain?)")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model}, checkpoint_id=str(directory), no_dist=True)
    return model


def saved_common(directory: Path) -> dict[str, Any]:
    try:
        return torch.load(directory / COMMON_FILE, weights_only=True)
    except Exception as error:  # an unpickling refusal or a damaged file: say which file
        raise CheckpointError(f"{directory / COMMON_FILE} does not load as plain data ({error})") from error


def saved_args(directory: Path) -> argparse.Namespace:
    """The flags the checkpoint was saved with; flags added since then take today's defaults."""
    from rapidtrain.arguments import build_parser

    defaults = vars(build_parser().parse_args([]))
    return argparse.Namespace(**(defaults | saved_common(directory)["args"]))


def saved_model_config(directory: Path) -> ModelConfig | None:
    """The built-in model's shape from the saved flags; None for a Hugging Face model's checkpoint. The
    Hugging Face folder that initialised it (if any) is not needed again: the weights are in the checkpoint."""
    from rapidtrain.models.hf_config import trains_builtin_model
    from rapidtrain.plan import model_config_from_args

    args = saved_args(directory)
    if not trains_builtin_model(args) or not getattr(args, "padded_vocab_size", None):
        return None
    args.pretrained_model_name_or_path, args.builtin_from_pretrained = None, False
    return model_config_from_args(args, args.padded_vocab_size)
