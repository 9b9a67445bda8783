"""Megatron-LM's legacy checkpoint folder, read (for --load) and written (tests, scripts/convert_checkpoint.py).

ROOT/latest_checkpointed_iteration.txt holds the iteration (or `release`); ROOT/iter_{N:07d}/mp_rank_{TT:02d}
[_{PPP:03d}]/model_optim_rng.pt holds, for each tensor (TT) and pipeline (PPP, only when there are several) rank:
`args` (the run's argparse.Namespace, whose `consumed_train_samples` is the run's position), `checkpoint_version`,
`iteration`, `model` (or `model0`, `model1`, ... with virtual pipeline stages), `optimizer`, `opt_param_scheduler`
(`lr_scheduler` in older releases), `rng_state` and `num_floating_point_operations_so_far`.
Files are read as data only (foreign_pickle).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rapidtrain.checkpoint.compatibility import LATEST_FILE, CheckpointError
from rapidtrain.checkpoint.foreign_formats import MEGATRON_FILE, MEGATRON_RANK_DIR, ForeignCheckpoint
from rapidtrain.checkpoint.foreign_pickle import load_foreign_pickle, plain_args
from rapidtrain.checkpoint.megatron_layout import Shard, core_names, flatten, legacy_nested, split_for_megatron
from rapidtrain.models.config import ModelConfig


@dataclass
class ForeignState:
    """What a foreign checkpoint holds, in the terms rapidtrain loads: the model's Core-spelled shards by
    `[pipeline stage][tensor rank]`, the saved run's flags, its position and schedule, and what was not read."""

    source: str
    stages: list[list[Shard]]
    saved_args: dict[str, Any]
    iteration: int
    consumed_samples: int
    scheduler: dict[str, Any] | None
    release: bool = False
    notes: list[str] = field(default_factory=list)
    # Adam's moments where the format keeps them by parameter: {"exp_avg" | "exp_avg_sq": shards laid out as
    # `stages`}, and the step count; None when they are not read (the optimizer then starts fresh).
    moments: dict[str, list[list[Shard]]] | None = None
    optimizer_step: int | None = None


def _rank_files(checkpoint: ForeignCheckpoint) -> dict[tuple[int, int], Path]:
    files: dict[tuple[int, int], Path] = {}
    for entry in sorted(checkpoint.directory.iterdir()):
        match = MEGATRON_RANK_DIR.match(entry.name)
        if not match:
            continue
        if match.group(3) is not None and int(match.group(3)) > 0:
            raise CheckpointError(f"{checkpoint.directory}: {entry.name} is an expert-parallel rank's part: "
                                  "expert-parallel Megatron checkpoints are not read yet (save it with "
                                  "--expert-model-parallel-size 1, or convert it to Hugging Face first)")
        if match.group(3) is not None:
            continue  # expert rank 0 of a mixture-of-experts model: its experts are refused by name below
        path = entry / MEGATRON_FILE
        if not path.is_file():
            raise CheckpointError(f"{checkpoint.directory} is incomplete: {entry.name} has no {MEGATRON_FILE}")
        files[(int(match.group(1)), int(match.group(2) or 0))] = path
    tensor = 1 + max(t for t, _ in files)
    pipeline = 1 + max(p for _, p in files)
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pipeline > 1 else "") for t in range(tensor)
               for p in range(pipeline) if (t, p) not in files]
    if missing:
        raise CheckpointError(f"{checkpoint.directory} is incomplete: missing {', '.join(missing[:4])} of its "
                              f"{tensor} × {pipeline} (tensor × pipeline) ranks' files")
    return files


def _model_chunks(saved: dict[str, Any], path: Path) -> list[Shard]:
    """The Core-spelled model of one file: one chunk, or one per virtual pipeline stage (`model0`, ...)."""
    if "model" in saved:
        return [core_names(flatten(saved["model"]))]
    chunks = sorted((int(key[5:]), value) for key, value in saved.items() if key[:5] == "model" and key[5:].isdigit())
    if not chunks:
        raise CheckpointError(f"{path}: no model in it (keys: {', '.join(sorted(map(str, saved))[:8])}): not a "
                              "Megatron-LM checkpoint file")
    return [core_names(flatten(chunk)) for _, chunk in chunks]


def read_megatron_legacy(checkpoint: ForeignCheckpoint) -> ForeignState:
    files = _rank_files(checkpoint)
    tensor = 1 + max(t for t, _ in files)
    pipeline = 1 + max(p for _, p in files)
    chunks: dict[tuple[int, int], list[Shard]] = {}
    first: dict[str, Any] = {}
    for (t, p), path in sorted(files.items(), key=lambda item: (item[0][1], item[0][0])):
        saved = load_foreign_pickle(path)
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path}: a {type(saved).__name__}, not a Megatron-LM checkpoint's dict")
        chunks[(t, p)] = _model_chunks(saved, path)
        if (t, p) == (0, 0):
            first = {key: value for key, value in saved.items() if not str(key).startswith("model")}
    version = first.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version < 2:
        raise CheckpointError(f"{checkpoint.directory}: checkpoint_version {version!r}: Megatron-LM before "
                              "checkpoint version 2 ordered the fused query/key/value differently, which is not read; "
                              "load and save it once with a newer Megatron-LM")
    virtual = len(chunks[(0, 0)])
    # Virtual stage v of pipeline rank p holds the model's (v × pipeline + p)-th chunk of layers.
    stages = [[chunks[(t, p)][v] for t in range(tensor)] for v in range(virtual) for p in range(pipeline)]
    saved_args = plain_args(first.get("args"))
    release = checkpoint.tag == "release"
    iteration = 0 if release else _count(first.get("iteration", saved_args.get("iteration", 0)))
    scheduler = first.get("opt_param_scheduler", first.get("lr_scheduler"))
    notes = [f"{checkpoint.describe()}: tensor parallel {tensor} × pipeline parallel {pipeline}"
             + (f" × {virtual} virtual stages" if virtual > 1 else "")]
    return ForeignState(str(checkpoint.directory), stages, saved_args, iteration,
                        _count(saved_args.get("consumed_train_samples", 0)), scheduler if isinstance(scheduler, dict)
                        else None, release, notes)


def _count(value: Any) -> int:
    return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0 else 0


# ---- writing ----

def megatron_args(config: ModelConfig, tensor_parallel: int, pipeline_parallel: int, vocab_rows: int,
                  **values: Any) -> argparse.Namespace:
    """The `args` a Megatron-LM run of this model would save (the fields that fix its shape, and `values`)."""
    return argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        ffn_hidden_size=config.ffn_size, kv_channels=config.head_dim, group_query_attention=config.num_query_groups
        is not None, num_query_groups=config.query_groups, max_position_embeddings=config.max_position_embeddings,
        seq_length=config.seq_length, padded_vocab_size=vocab_rows, swiglu=config.swiglu,
        normalization=config.normalization, position_embedding_type=config.position_embedding_type,
        untie_embeddings_and_output_weights=not config.tie_embeddings, add_bias_linear=config.add_bias_linear,
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=torch.float32, **values)


def write_megatron_legacy(root: str | Path, state: dict[str, torch.Tensor], config: ModelConfig, *,
                          tensor_parallel: int, pipeline_parallel: int, iteration: int, consumed_samples: int,
                          vocab_rows: int, scheduler: dict[str, Any] | None = None, core_names: bool = False,
                          extra_args: dict[str, Any] | None = None, optimizer_and_rng: bool = True) -> Path:
    """Write the whole built-in model `state` as Megatron-LM's save_checkpoint lays it out (legacy format,
    checkpoint_version 3.0): one model_optim_rng.pt per (tensor, pipeline) rank and the tracker file.

    `optimizer_and_rng`: also the fields a training run saves, with the state of an fp32 Megatron optimizer that has
    not stepped and this process's random state (CPU stand-ins where Megatron saves CUDA states). Without them the
    folder is what Megatron's own converters write (--no-save-optim --no-save-rng): Megatron loads it with
    --finetune, or --no-load-optim --no-load-rng."""
    root = Path(root)
    directory = root / f"iter_{iteration:07d}"
    stages = split_for_megatron(state, config, tensor_parallel, pipeline_parallel, vocab_rows)
    saved_args = megatron_args(config, tensor_parallel, pipeline_parallel, vocab_rows, iteration=iteration,
                         consumed_train_samples=consumed_samples, consumed_valid_samples=0, **(extra_args or {}))
    for p, stage in enumerate(stages):
        for t, shard in enumerate(stage):
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pipeline_parallel > 1 else "")
            model: dict[str, Any] = dict(shard) if core_names else legacy_nested(shard)
            if not core_names and config.tie_embeddings and pipeline_parallel > 1 and p == pipeline_parallel - 1:
                model["word_embeddings_for_head"] = {"weight": stages[0][t]["embedding.word_embeddings.weight"].clone()}
            saved: dict[str, Any] = {
                "args": saved_args, "checkpoint_version": 3.0, "iteration": iteration, "model": model,
                "opt_param_scheduler": scheduler or {}, "num_floating_point_operations_so_far": 0,
            }
            if optimizer_and_rng:
                saved["optimizer"] = {"state": {}, "param_groups": [  # Megatron's two groups: with and without decay
                    {"wd_mult": 1.0, "lr_mult": 1.0, "params": list(range(len(shard)))},
                    {"wd_mult": 0.0, "lr_mult": 1.0, "params": []}]}
                saved["rng_state"] = [{
                    "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                    "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}]
            (directory / name).mkdir(parents=True, exist_ok=True)
            torch.save(saved, directory / name / MEGATRON_FILE)
    (root / LATEST_FILE).write_text(f"{iteration}\n")
    return directory
