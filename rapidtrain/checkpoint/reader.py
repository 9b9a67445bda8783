"""Read a saved checkpoint in one process, without a process group: the model's tensors whole (whatever
layout wrote them: torch.distributed.checkpoint stitches the shards) and its common state.

The export script and `rapidtrain generate` use it, through the checkpoint module's safe readers: nothing
stored in the files runs, and damaged files are named.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from rapidtrain.checkpoint.checkpointer import (
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


def checkpoint_directory(load: str | Path, iteration: int | None = None) -> Path:
    """The iter_* folder to read (`load` is a --save folder or one iter_* folder), refused with a clear
    error when missing, not completely written, or damaged (its manifest's checksums)."""
    load = Path(load)
    from rapidtrain.checkpoint.foreign_formats import detect_foreign

    foreign = detect_foreign(load) if not (load / METADATA_FILE).exists() else None
    if foreign is not None:
        raise CheckpointError(f"--load {load}: a {foreign.describe()}. This reads rapidtrain's own checkpoints; a "
                              "training run's --load reads that one (--finetune for its weights only), and its next "
                              "--save is a rapidtrain checkpoint.")
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


def consolidated_model_state(directory: Path, merge_lora: bool = True) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP checkpoint, whole, read in this one process: shards written by
    FSDP/TP/PP/EP ranks are stitched by torch.distributed.checkpoint from its metadata (read by an
    allow-list unpickler: nothing stored in the file runs). LoRA adapters of the built-in model are folded into
    their weights unless `merge_lora` is False."""
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
    return merged_lora(model, directory) if merge_lora else model


def merged_lora(model: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """The plain model of a run that trained LoRA adapters on the built-in model: each adapted weight with its
    adapter folded in (scale --lora-alpha / --lora-rank, from the saved flags), the adapters left out."""
    from rapidtrain.models.lora import is_adapter_weight, merge_adapters

    if not any(is_adapter_weight(name) for name in model):
        return model
    saved_flags = read_common(directory).get("args") or {}
    rank = int(saved_flags.get("lora_rank") or 0)
    if rank <= 0:
        raise CheckpointError(f"{directory}: LoRA adapters without the --lora-rank that made them in its saved flags")
    alpha = saved_flags.get("lora_alpha")
    return merge_adapters(model, (float(alpha) if alpha is not None else 2.0 * rank) / rank)
