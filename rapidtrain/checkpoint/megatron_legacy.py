"""Megatron-LM's legacy checkpoint folder, read (for --load) and written (tests, scripts/convert_checkpoint.py).

ROOT/latest_checkpointed_iteration.txt holds the iteration (or `release`); ROOT/iter_{N:07d}/mp_rank_{TT:02d}
[_{PPP:03d}][_{EEE:03d}]/model_optim_rng.pt holds, for each tensor (TT), pipeline (PPP, only when there are several)
and expert-parallel (EEE, likewise) rank, its part of the model (an expert rank's routed experts, the other weights
as every expert rank holds them):
`args` (the run's argparse.Namespace, whose `consumed_train_samples` is the run's position), `checkpoint_version`,
`iteration`, `model` (or `model0`, `model1`, ... with virtual pipeline stages), `optimizer`, `opt_param_scheduler`
(`lr_scheduler` in older releases), `rng_state` and `num_floating_point_operations_so_far`.
Files are read as data only (foreign_pickle).
"""

from __future__ import annotations

import argparse
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rapidtrain.checkpoint.compatibility import LATEST_FILE, CheckpointError
from rapidtrain.checkpoint.foreign_formats import MEGATRON_FILE, MEGATRON_RANK_DIR, ForeignCheckpoint
from rapidtrain.checkpoint.foreign_pickle import load_foreign_pickle, plain_args
from rapidtrain.checkpoint.megatron_layout import (
    ExpertSpelling,
    Shard,
    core_names,
    expert_rank_shard,
    flatten,
    is_expert,
    legacy_nested,
    split_for_megatron,
    stack_experts,
)
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


def _rank_files(checkpoint: ForeignCheckpoint) -> dict[tuple[int, ...], Path]:
    """Each rank folder's file by the numbers in its name (`mp_rank_TT[_PPP][_EEE]`: one, two or three)."""
    files: dict[tuple[int, ...], Path] = {}
    for entry in sorted(checkpoint.directory.iterdir()):
        match = MEGATRON_RANK_DIR.match(entry.name)
        if not match:
            continue
        path = entry / MEGATRON_FILE
        if not path.is_file():
            raise CheckpointError(f"{checkpoint.directory} is incomplete: {entry.name} has no {MEGATRON_FILE}")
        files[tuple(int(number) for number in match.groups() if number is not None)] = path
    return files


def _parallel_ranks(files: dict[tuple[int, ...], Path], saved_args: dict[str, Any],
                    directory: Path) -> dict[tuple[int, int, int], Path]:
    """The files by (tensor, pipeline, expert) rank, all present. `mp_rank_TT_XXX` names a pipeline rank, or an
    expert-parallel one where the saved run had experts parallel and no pipeline (its args say which)."""
    expert_names = saved_args.get("pipeline_model_parallel_size", 1) == 1 and (
        saved_args.get("expert_model_parallel_size") or 1) > 1
    ranks: dict[tuple[int, int, int], Path] = {}
    for numbers, path in files.items():
        if len(numbers) == 3:
            ranks[(numbers[0], numbers[1], numbers[2])] = path
        elif len(numbers) == 2:
            ranks[(numbers[0], 0, numbers[1]) if expert_names else (numbers[0], numbers[1], 0)] = path
        else:
            ranks[(numbers[0], 0, 0)] = path
    sizes = [1 + max(key[axis] for key in ranks) for axis in range(3)]
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if sizes[1] > 1 else "") + (f"_{e:03d}" if sizes[2] > 1 else "")
               for t in range(sizes[0]) for p in range(sizes[1]) for e in range(sizes[2]) if (t, p, e) not in ranks]
    if missing:
        raise CheckpointError(f"{directory} is incomplete: missing {', '.join(missing[:4])} of its "
                              f"{' × '.join(map(str, sizes))} (tensor × pipeline × expert) ranks' files")
    return ranks


def _model_chunks(saved: dict[str, Any], path: Path, local_experts: int | None) -> list[Shard]:
    """The Core-spelled model of one file, experts stacked: one chunk, or one per virtual pipeline stage (`model0`,
    ...)."""
    if "model" in saved:
        return [stack_experts(core_names(flatten(saved["model"])), local_experts, str(path))]
    chunks = sorted((int(key[5:]), value) for key, value in saved.items() if key[:5] == "model" and key[5:].isdigit())
    if not chunks:
        raise CheckpointError(f"{path}: no model in it (keys: {', '.join(sorted(map(str, saved))[:8])}): not a "
                              "Megatron-LM checkpoint file")
    return [stack_experts(core_names(flatten(chunk)), local_experts, str(path)) for _, chunk in chunks]


def _join_expert_ranks(shards: list[Shard], source: str) -> Shard:
    """One (tensor, pipeline) rank's shard from its expert-parallel ranks' (which hold the same other tensors): the
    routed experts of rank e follow those of rank e - 1."""
    joined = dict(shards[0])
    for name in [name for name in joined if is_expert(name)]:
        if any(name not in shard for shard in shards):
            raise CheckpointError(f"{source}: {name} is missing from an expert-parallel rank's file: the checkpoint "
                                  "is damaged")
        joined[name] = torch.cat([shard[name] for shard in shards])
    return joined


def _local_experts(saved_args: dict[str, Any], expert_parallel: int, directory: Path) -> int | None:
    """Experts per expert-parallel rank, from the saved args; refused where expert tensor parallelism differs from
    tensor parallelism (such legacy folders keep each expert's cut in files the names do not tell apart)."""
    tensor = saved_args.get("tensor_model_parallel_size") or 1
    expert_tensor = saved_args.get("expert_tensor_parallel_size") or tensor
    if saved_args.get("num_experts") and expert_tensor != tensor:
        raise CheckpointError(f"{directory}: saved with --expert-tensor-parallel-size {expert_tensor} and "
                              f"--tensor-model-parallel-size {tensor}: legacy folders of that layout are not read "
                              "(save it with --ckpt-format torch_dist, or with equal sizes)")
    experts = saved_args.get("num_experts")
    return experts // expert_parallel if isinstance(experts, int) and experts > 0 else None


def read_megatron_legacy(checkpoint: ForeignCheckpoint) -> ForeignState:
    files = _rank_files(checkpoint)
    if not files:
        raise CheckpointError(f"{checkpoint.directory}: no mp_rank_* folder with a {MEGATRON_FILE}")
    loaded = {numbers: load_foreign_pickle(path) for numbers, path in sorted(files.items())}
    for numbers, saved in loaded.items():
        if not isinstance(saved, dict):
            raise CheckpointError(f"{files[numbers]}: a {type(saved).__name__}, not a Megatron-LM checkpoint's dict")
    first = {key: value for key, value in loaded[min(loaded)].items() if not str(key).startswith("model")}
    saved_args = plain_args(first.get("args"))
    ranks = _parallel_ranks(files, saved_args, checkpoint.directory)
    tensor, pipeline, expert = (1 + max(key[axis] for key in ranks) for axis in range(3))
    version = first.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version < 2:
        raise CheckpointError(f"{checkpoint.directory}: checkpoint_version {version!r}: Megatron-LM before "
                              "checkpoint version 2 ordered the fused query/key/value differently, which is not read; "
                              "load and save it once with a newer Megatron-LM")
    local_experts = _local_experts(saved_args, expert, checkpoint.directory)
    by_name = {path: numbers for numbers, path in files.items()}
    chunks = {key: _model_chunks(loaded[by_name[path]], path, local_experts) for key, path in ranks.items()}
    virtual = len(chunks[(0, 0, 0)])
    # Virtual stage v of pipeline rank p holds the model's (v × pipeline + p)-th chunk of layers.
    stages = [[_join_expert_ranks([chunks[(t, p, e)][v] for e in range(expert)], str(checkpoint.directory))
               for t in range(tensor)] for v in range(virtual) for p in range(pipeline)]
    release = checkpoint.tag == "release"
    iteration = 0 if release else _count(first.get("iteration", saved_args.get("iteration", 0)))
    scheduler = first.get("opt_param_scheduler", first.get("lr_scheduler"))
    notes = [f"{checkpoint.describe()}: tensor parallel {tensor} × pipeline parallel {pipeline}"
             + (f" × {virtual} virtual stages" if virtual > 1 else "")
             + (f" × expert parallel {expert}" if expert > 1 else "")]
    return ForeignState(str(checkpoint.directory), stages, saved_args, iteration,
                        _count(saved_args.get("consumed_train_samples", 0)), scheduler if isinstance(scheduler, dict)
                        else None, release, notes)


def _count(value: Any) -> int:
    return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0 else 0


# ---- writing ----

def megatron_args(config: ModelConfig, tensor_parallel: int, pipeline_parallel: int, vocab_rows: int,
                  expert_parallel: int = 1, **values: Any) -> argparse.Namespace:
    """The `args` a Megatron-LM run of this model would save (the fields that fix its shape, and `values`)."""
    experts = max(config.num_experts, default=0)
    if any(count not in (0, experts) for count in config.num_experts):
        raise CheckpointError("Megatron-Core has one expert count for all MoE layers: give one --num-experts value")
    moe = dict(num_experts=experts or None, moe_layer_freq=[int(count > 0) for count in config.num_experts] or 1,
               moe_ffn_hidden_size=config.expert_ffn_size if experts else None,
               moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
               moe_shared_expert_gate=config.moe_shared_expert_gate,
               moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
               moe_router_topk=config.moe_router_topk,
               expert_model_parallel_size=expert_parallel, expert_tensor_parallel_size=tensor_parallel)
    mla = dict(multi_latent_attention=config.multi_latent_attention, q_lora_rank=config.q_lora_rank,
               kv_lora_rank=config.kv_lora_rank, qk_head_dim=config.qk_head_dim,
               qk_pos_emb_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim)
    moe = {name: value for name, value in moe.items() if name not in values}  # `values` say otherwise
    return argparse.Namespace(
        **moe, **mla, qk_layernorm=config.qk_layernorm, mtp_num_layers=config.mtp_num_layers or None,
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
                          extra_args: dict[str, Any] | None = None, optimizer_and_rng: bool = True,
                          expert_parallel: int = 1, experts: ExpertSpelling = "sequential") -> Path:
    """Write the whole built-in model `state` as Megatron-LM's save_checkpoint lays it out (legacy format,
    checkpoint_version 3.0): one model_optim_rng.pt per (tensor, pipeline) rank and the tracker file.

    `optimizer_and_rng`: also the fields a training run saves, with the state of an fp32 Megatron optimizer that has
    not stepped and this process's random state (CPU stand-ins where Megatron saves CUDA states). Without them the
    folder is what Megatron's own converters write (--no-save-optim --no-save-rng): Megatron loads it with
    --finetune, or --no-load-optim --no-load-rng.

    `expert_parallel` ranks divide the routed experts (folders `mp_rank_TT[_PPP]_EEE`, Megatron-Core names), saved
    with the `experts` implementation's names (SequentialMLP, TEGroupedMLP or the legacy GroupedMLP)."""
    root = Path(root)
    directory = root / f"iter_{iteration:07d}"
    stages = split_for_megatron(state, config, tensor_parallel, pipeline_parallel, vocab_rows)
    saved_args = megatron_args(config, tensor_parallel, pipeline_parallel, vocab_rows, expert_parallel,
                               iteration=iteration, consumed_train_samples=consumed_samples, consumed_valid_samples=0,
                               **(extra_args or {}))
    core_names = core_names or any(config.num_experts) or config.multi_latent_attention  # Megatron-Core's modules
    for (p, stage), t, e in itertools.product(enumerate(stages), range(tensor_parallel), range(expert_parallel)):
        shard = expert_rank_shard(stage[t], expert_parallel, e, experts)
        name = (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pipeline_parallel > 1 else "")
                + (f"_{e:03d}" if expert_parallel > 1 else ""))
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
