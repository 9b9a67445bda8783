"""Checkpoints in Megatron's layout, written with torch.distributed.checkpoint so they reshard.

SAVE/iter_0000100/ holds the model and optimizer (`.metadata` + `__{rank}_{k}.distcp`), `common.pt`
(iteration, consumed samples, scheduler, arguments) and `rng/rank_{r}.pt`. Everything is written under
a temporary name and published by a rename after every rank finished; `latest_checkpointed_iteration.txt`
is replaced last. A half-written checkpoint is therefore never visible under its final name.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

LATEST_FILE = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.pt"
# Flags that fix the model's shape: a checkpoint saved with other values cannot load.
MODEL_SHAPE_FLAGS = ("model_type", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "padded_vocab_size", "position_embedding_type", "max_position_embeddings",
                     "untie_embeddings_and_output_weights", "bert_binary_head", "num_experts", "moe_layer_freq",
                     "normalization", "swiglu", "group_query_attention", "num_query_groups", "add_bias_linear",
                     "add_qkv_bias", "post_layernorm")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, incomplete, or of another model."""


@dataclass
class LoadedState:
    iteration: int
    consumed_samples: int
    extra: dict[str, Any]


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _publish(tmp: Path, final: Path) -> None:
    """Replace `final` by `tmp` so that a reader sees either the old or the new directory, never half."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(root: str | Path, iteration: int, runner: Any, lr_scheduler: Any, consumed_samples: int,
                    args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Path:
    root = Path(root)
    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    dcp.save(runner.state_dict(), checkpoint_id=str(tmp))
    torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
    if _rank() == 0:
        common = {"iteration": iteration, "consumed_samples": consumed_samples, "args": vars(args),
                  "lr_scheduler": lr_scheduler.state_dict() if hasattr(lr_scheduler, "state_dict") else None,
                  "extra": extra or {}}
        torch.save(common, tmp / COMMON_FILE)
    _barrier()
    if _rank() == 0:
        _publish(tmp, final)
        _write_atomically(root / LATEST_FILE, f"{iteration}\n")
    _barrier()
    return final


def latest_iteration(root: str | Path) -> int | None:
    path = Path(root) / LATEST_FILE
    if not path.exists():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number; the file is corrupt. Remove it to "
                              "start from scratch, or write the iteration of a complete iter_* folder into it.")
    return int(text)


def _check_complete(directory: Path) -> None:
    missing = [name for name in (".metadata", COMMON_FILE) if not (directory / name).exists()]
    if missing:
        raise CheckpointError(f"checkpoint {directory} is incomplete (missing {', '.join(missing)}): it was not "
                              "fully written. Point --load at a folder whose latest iteration is complete.")


def check_same_model(saved: dict[str, Any], current: argparse.Namespace, directory: Path) -> None:
    differing = []
    for name in MODEL_SHAPE_FLAGS:
        if name in saved and hasattr(current, name) and saved[name] != getattr(current, name):
            differing.append(f"--{name.replace('_', '-')} (checkpoint {saved[name]!r}, now {getattr(current, name)!r})")
    if differing:
        raise CheckpointError(f"checkpoint {directory} holds a different model: " + "; ".join(differing)
                              + ". Use the flags the checkpoint was saved with, or another --load folder.")


def load_checkpoint(root: str | Path, runner: Any, lr_scheduler: Any, args: argparse.Namespace, *,
                    finetune: bool = False, load_optimizer: bool = True, load_rng: bool = True) -> LoadedState | None:
    """Fill the runner (and schedule, RNG) from the latest checkpoint in `root`; None when there is none."""
    iteration = latest_iteration(root)
    if iteration is None:
        if finetune:
            raise CheckpointError(f"--finetune --load {root}: no {LATEST_FILE} there; nothing to fine-tune from.")
        return None
    directory = iteration_dir(root, iteration)
    if not directory.is_dir():
        raise CheckpointError(f"{Path(root) / LATEST_FILE} names iteration {iteration}, but {directory} "
                              f"does not exist.")
    _check_complete(directory)
    common = torch.load(directory / COMMON_FILE, weights_only=False)
    check_same_model(common["args"], args, directory)
    load_optimizer = load_optimizer and not finetune
    state = runner.state_dict_for_loading(load_optimizer)
    dcp.load(state, checkpoint_id=str(directory))
    runner.load_state_dict(state, load_optimizer=load_optimizer)
    if load_optimizer and common.get("lr_scheduler") and hasattr(lr_scheduler, "load_state_dict"):
        lr_scheduler.load_state_dict(common["lr_scheduler"])
    rng_file = directory / "rng" / f"rank_{_rank()}.pt"
    if load_rng and not finetune and rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    if finetune:
        return LoadedState(0, 0, {})
    return LoadedState(iteration, common["consumed_samples"], common.get("extra", {}))
