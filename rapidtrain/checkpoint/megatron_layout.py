"""Megatron's tensor names and tensor-parallel layouts ↔ the built-in GPT's whole parameters, both ways.

Megatron-LM saves each (tensor, pipeline) rank's part of the model: layers numbered from 0 on every stage, the
weights cut as its parallel layers cut them. Column-parallel weights (fused q/k/v, the MLP's first layer, the
vocabulary-parallel embedding and output layer) hold rows of the whole, row-parallel ones (attention's output,
the MLP's second layer) columns; layer norms and row-parallel biases are the same on every rank.

The fused q/k/v (checkpoint_version ≥ 2, Megatron-Core likewise) is grouped by key/value head: for each query
group, that group's query heads, then its key head, then its value head, each `head_dim` rows, so a tensor rank
holds whole groups. SwiGLU's first layer holds, on each rank, its rows of the gate, then its rows of the up
projection (Megatron splits the output in two halves and gates the second with silu of the first).

Two spellings are read: the legacy model's (`language_model.encoder.layers.N.self_attention.query_key_value`,
nested dicts as `state_dict_for_save_checkpoint` returns them) and Megatron-Core's (`decoder.layers.N.
self_attention.linear_qkv`, with Transformer Engine's fused layer norms). Both are first spelled the Core way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from rapidtrain.checkpoint.compatibility import CheckpointError
from rapidtrain.models.config import ModelConfig

Shard = dict[str, torch.Tensor]

# Legacy names (after flattening) → Megatron-Core's; applied as prefix/infix replacements in this order.
_LEGACY_TO_CORE = (
    ("language_model.embedding.", "embedding."),
    ("language_model.encoder.", "decoder."),
    ("language_model.transformer.", "decoder."),
    ("language_model.output_layer.", "output_layer."),
    (".self_attention.query_key_value.", ".self_attention.linear_qkv."),
    (".self_attention.dense.", ".self_attention.linear_proj."),
    (".post_attention_layernorm.", ".pre_mlp_layernorm."),
    (".mlp.dense_h_to_4h.", ".mlp.linear_fc1."),
    (".mlp.dense_4h_to_h.", ".mlp.linear_fc2."),
    ("decoder.final_norm.", "decoder.final_layernorm."),
    # Transformer Engine fuses the layer norm into the next linear layer
    (".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
    (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."),
)
_IGNORED = re.compile(r"(^|\.)_extra_state$|^word_embeddings_for_head\.|\.inv_freq$|^rotary_pos_emb\.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Per layer: Megatron-Core name → (built-in name, how tensor-parallel ranks cut it).
_LAYER_PARTS = {
    "input_layernorm.weight": ("ln1.weight", "same"),
    "input_layernorm.bias": ("ln1.bias", "same"),
    "self_attention.linear_qkv.weight": ("attention.qkv.weight", "qkv"),
    "self_attention.linear_qkv.bias": ("attention.qkv.bias", "qkv"),
    "self_attention.linear_proj.weight": ("attention.o_proj.weight", "columns"),
    "self_attention.linear_proj.bias": ("attention.o_proj.bias", "same"),
    "self_attention.q_layernorm.weight": ("attention.q_norm.weight", "same"),
    "self_attention.k_layernorm.weight": ("attention.k_norm.weight", "same"),
    "pre_mlp_layernorm.weight": ("ln2.weight", "same"),
    "pre_mlp_layernorm.bias": ("ln2.bias", "same"),
    "mlp.linear_fc1.weight": ("mlp.fc1.weight", "fc1"),
    "mlp.linear_fc1.bias": ("mlp.fc1.bias", "fc1"),
    "mlp.linear_fc2.weight": ("mlp.fc2.weight", "columns"),
    "mlp.linear_fc2.bias": ("mlp.fc2.bias", "same"),
}
_GLOBAL_PARTS = {
    "embedding.word_embeddings.weight": ("embedding.word_embeddings.weight", "rows"),
    "embedding.position_embeddings.weight": ("embedding.position_embeddings.weight", "same"),
    "decoder.final_layernorm.weight": ("final_norm.weight", "same"),
    "decoder.final_layernorm.bias": ("final_norm.bias", "same"),
    "output_layer.weight": ("output.weight", "rows"),
}
VOCABULARY = ("embedding.word_embeddings.weight", "output.weight")


def flatten(state: Mapping[str, Any], prefix: str = "") -> Shard:
    """A model state as saved (the legacy model nests dicts) as one dict of dotted names → tensors."""
    flat: Shard = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            flat[name] = value
    return flat


def core_name(name: str) -> str | None:
    """The Megatron-Core spelling of a saved name; None for entries that carry no weight (TE's extra state, the
    tied head's copy of the embedding, rotary buffers)."""
    if _IGNORED.search(name):
        return None
    return _renamed(name, _LEGACY_TO_CORE)


def _renamed(name: str, table: tuple[tuple[str, str], ...]) -> str:
    """`name` with each (old, new) of `table` replaced in turn, matched at the start or after a dot."""
    name = f".{name}"
    for old, new in table:
        name = name.replace("." + old.lstrip("."), "." + new.lstrip("."))
    return name[1:]


def core_names(shard: Shard) -> Shard:
    return {new: value for name, value in shard.items() if (new := core_name(name)) is not None}


# ---- read: ranks' shards → the whole built-in model ----

def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _split_qkv(fused: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    groups, head_dim = config.query_groups, config.head_dim
    per_group = config.num_attention_heads // groups
    rest = fused.shape[1:]
    if fused.shape[0] != groups * (per_group + 2) * head_dim:
        raise CheckpointError(f"the fused query/key/value has {fused.shape[0]} rows, {config.num_attention_heads} "
                              f"heads in {groups} groups of head size {head_dim} give "
                              f"{groups * (per_group + 2) * head_dim}: --num-attention-heads, --num-query-groups or "
                              "--kv-channels differ from the checkpoint's")
    grouped = fused.reshape(groups, per_group + 2, head_dim, *rest)
    return {"q_proj": grouped[:, :per_group].reshape(-1, *rest), "k_proj": grouped[:, per_group].reshape(-1, *rest),
            "v_proj": grouped[:, per_group + 1].reshape(-1, *rest)}


def _merge(parts: list[torch.Tensor], how: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole value(s) of one saved entry from its tensor-parallel ranks' parts, keyed by the built-in leaf."""
    if how == "same":
        return {"": parts[0]}
    if how in ("rows", "qkv"):
        whole = _cat(parts, 0)
        return _split_qkv(whole, config) if how == "qkv" else {"": whole}
    if how == "columns":
        return {"": _cat(parts, 1)}
    if config.swiglu:  # fc1: each rank's gate rows, then its up rows
        halves = [part.chunk(2, dim=0) for part in parts]
        return {"gate": _cat([h[0] for h in halves], 0), "fc1": _cat([h[1] for h in halves], 0)}
    return {"": _cat(parts, 0)}


def _builtin_name(base: str, leaf: str) -> str:
    """`attention.qkv.weight` with leaf `q_proj` → `attention.q_proj.weight`; `mlp.fc1.bias` with `gate` →
    `mlp.gate.bias`."""
    if not leaf:
        return base
    module, _, tensor = base.rpartition(".")
    return f"{module.rpartition('.')[0]}.{leaf}.{tensor}"


def merge_stages(stages: list[list[Shard]], config: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """The whole model in built-in names from `stages[pipeline rank][tensor rank]` (Core-spelled shards); layer
    numbers are made global by counting each stage's layers."""
    whole: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    offset = 0
    for stage in stages:
        names = list(stage[0])
        missing = [f"tensor rank {r}" for r, shard in enumerate(stage) if set(shard) != set(names)]
        if missing:
            raise CheckpointError(f"{source}: the tensor-parallel files of a pipeline stage hold different tensors "
                                  f"({', '.join(missing)} differ from rank 0's): the checkpoint is damaged")
        local_layers = sorted({int(m.group(1)) for name in names if (m := _LAYER.match(name))})
        for name in names:
            layer = _LAYER.match(name)
            if layer:
                part = _LAYER_PARTS.get(layer.group(2))
                prefix = f"layers.{offset + int(layer.group(1))}."
            else:
                part, prefix = _GLOBAL_PARTS.get(name), ""
            if part is None:
                unknown.append(name)
                continue
            base, how = part
            for leaf, value in _merge([shard[name] for shard in stage], how, config).items():
                whole[prefix + _builtin_name(base, leaf)] = value
        offset += len(local_layers)
    if unknown:
        raise CheckpointError(f"{source}: tensors the built-in GPT has no place for: {', '.join(unknown[:6])}"
                              + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else "")
                              + " (mixture-of-experts, cross-attention and other modules are not read from Megatron "
                              "checkpoints yet)")
    if offset != config.num_layers:
        raise CheckpointError(f"{source}: the checkpoint has {offset} transformer layers, --num-layers is "
                              f"{config.num_layers}: give the checkpoint's --num-layers")
    return whole


def fit_vocabulary(whole: dict[str, torch.Tensor], vocab_rows: int, padding_multiple: int, source: str) -> None:
    """Bring the embedding and output layer to this run's padded vocabulary: rows past it may only be padding
    (fewer than `padding_multiple`, the checkpoint's --make-vocab-size-divisible-by × tensor parallel size), rows
    added are padding too (zeros)."""
    for name in VOCABULARY:
        value = whole.get(name)
        if value is None or value.shape[0] == vocab_rows:
            continue
        if value.shape[0] > vocab_rows:
            if value.shape[0] - vocab_rows >= padding_multiple:
                raise CheckpointError(f"{source}: its vocabulary has {value.shape[0]} rows (padded), this run's "
                                      f"{vocab_rows}: another tokenizer. Give the checkpoint's --tokenizer-type and "
                                      "vocabulary (or --make-vocab-size-divisible-by)")
            whole[name] = value[:vocab_rows].clone()
        else:
            whole[name] = torch.cat([value, value.new_zeros(vocab_rows - value.shape[0], *value.shape[1:])])


# ---- write: the whole built-in model → ranks' shards (tests and the converter) ----

def _builtin_value(state: Mapping[str, torch.Tensor], base: str, how: str, config: ModelConfig) -> torch.Tensor:
    """The built-in tensors of one Megatron entry, as Megatron holds it whole (q/k/v fused by group)."""
    if how == "qkv":
        parts = [state[_builtin_name(base, leaf)] for leaf in ("q_proj", "k_proj", "v_proj")]
        groups, rest = config.query_groups, parts[0].shape[1:]
        q = parts[0].reshape(groups, -1, config.head_dim, *rest)
        k, v = (p.reshape(groups, 1, config.head_dim, *rest) for p in parts[1:])
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)
    return state[base]


def _cut(value: torch.Tensor, how: str, tensor_parallel: int, rank: int, config: ModelConfig,
         gate: torch.Tensor | None = None) -> torch.Tensor:
    if how == "same":
        return value.clone()
    if how == "columns":
        return value.chunk(tensor_parallel, dim=1)[rank].clone()
    if how == "qkv":
        grouped = value.reshape(config.query_groups, -1, *value.shape[1:])
        return grouped.chunk(tensor_parallel, dim=0)[rank].reshape(-1, *value.shape[1:]).clone()
    if how == "fc1" and gate is not None:
        return torch.cat([gate.chunk(tensor_parallel, dim=0)[rank], value.chunk(tensor_parallel, dim=0)[rank]])
    return value.chunk(tensor_parallel, dim=0)[rank].clone()


def split_for_megatron(state: Mapping[str, torch.Tensor], config: ModelConfig, tensor_parallel: int,
                       pipeline_parallel: int, vocab_rows: int) -> list[list[Shard]]:
    """The whole built-in model (its state dict) as `[pipeline rank][tensor rank]` shards in Megatron-Core's
    names, layers numbered from 0 on each stage (split evenly), vocabulary padded or cut to `vocab_rows`."""
    if config.num_layers % pipeline_parallel or config.query_groups % tensor_parallel:
        raise CheckpointError(f"--num-layers {config.num_layers} and {config.query_groups} query groups must divide "
                              f"by the pipeline ({pipeline_parallel}) and tensor ({tensor_parallel}) parallel sizes")
    state = dict(state)
    fit_vocabulary(state, vocab_rows, 1, "the model")  # padding rows added, none cut
    per_stage = config.num_layers // pipeline_parallel
    stages: list[list[Shard]] = []
    for stage in range(pipeline_parallel):
        shards: list[Shard] = [{} for _ in range(tensor_parallel)]
        entries: list[tuple[str, str, str]] = []  # (Megatron name, built-in base, how)
        if stage == 0:
            entries += [(n, b, h) for n, (b, h) in _GLOBAL_PARTS.items() if n.startswith("embedding.")]
        for local in range(per_stage):
            layer = stage * per_stage + local
            entries += [(f"decoder.layers.{local}.{n}", f"layers.{layer}.{b}", h) for n, (b, h) in _LAYER_PARTS.items()]
        if stage == pipeline_parallel - 1:
            entries += [(n, b, h) for n, (b, h) in _GLOBAL_PARTS.items() if not n.startswith("embedding.")]
        for name, base, how in entries:
            probe = _builtin_name(base, "q_proj") if how == "qkv" else base
            if probe not in state or (base == "output.weight" and config.tie_embeddings):
                continue
            value = _builtin_value(state, base, how, config)
            gate = state.get(_builtin_name(base, "gate")) if how == "fc1" and config.swiglu else None
            for rank in range(tensor_parallel):
                shards[rank][name] = _cut(value, how, tensor_parallel, rank, config, gate)
        stages.append(shards)
    return stages


def legacy_nested(shard: Shard) -> dict[str, Any]:
    """A Core-spelled shard in the legacy model's nesting and names (`language_model` → embedding / encoder /
    output_layer), as Megatron-LM's legacy GPTModel.state_dict_for_save_checkpoint returns it."""
    back = (("linear_qkv.", "query_key_value."), ("linear_proj.", "dense."),
            ("pre_mlp_layernorm.", "post_attention_layernorm."), ("linear_fc1.", "dense_h_to_4h."),
            ("linear_fc2.", "dense_4h_to_h."), ("final_layernorm.", "final_norm."))
    language_model: dict[str, Any] = {}
    for name, value in shard.items():
        if name.startswith("embedding."):
            module, leaf = name.removeprefix("embedding.").split(".")
            language_model.setdefault("embedding", {})[module] = {leaf: value}
        elif name.startswith("output_layer."):
            language_model["output_layer"] = {name.removeprefix("output_layer."): value}
        else:
            language_model.setdefault("encoder", {})[_renamed(name.removeprefix("decoder."), back)] = value
    return {"language_model": language_model}
