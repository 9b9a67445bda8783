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

Mixture-of-experts layers (Megatron-Core): `mlp.router.weight` (+ `bias`, and `expert_bias`, the aux-loss-free
balancing buffer), `mlp.shared_experts.linear_fc1/fc2` (one dense MLP, cut as the dense one; `gate_weight` [1, h] for
Qwen's sigmoid gate) and the routed experts, in one of three implementations' spellings: SequentialMLP's
`mlp.experts.local_experts.I.linear_fc1.weight` ([2f/TP, h] with SwiGLU, each rank's gate rows then its up rows),
TEGroupedMLP's `mlp.experts.linear_fc1.weightI` (the same tensors), and the legacy GroupedMLP's `mlp.experts.weight1`
[h, I·2f/TP] / `weight2` [I·f/TP, h], whose memory Megatron reads as [I, h, 2f/TP] / [I, f/TP, h] (a view, not a
transpose). I counts the experts of one expert-parallel rank: rank e holds experts e·I ... e·I + I - 1 (legacy
folders `mp_rank_TT[_PPP]_EEE`); torch_dist stores `mlp.experts.experts.linear_fc1.weight` whole, [E, 2f, h] with
the whole gate then the whole up projection. All are first stacked as `mlp.experts.linear_fc1.weight` [experts,
rows of this tensor rank, h] (`linear_fc2`: [experts, h, columns of this tensor rank]): `stack_experts`.

Multi-head latent attention: `linear_q_proj` or `linear_q_down_proj` + `linear_q_up_proj`, `linear_kv_down_proj`
([kv_lora_rank + rope rows, h]), `linear_kv_up_proj`, `linear_proj`; the latents' norms `q_layernorm` /
`kv_layernorm` (Transformer Engine fuses them into the up projections: `linear_q_up_proj.layer_norm_weight`). The
up projections are cut by heads; the down projections by rows (the local spec's ColumnParallelLinear) or not at all
(Transformer Engine's duplicated TELinear): told apart by their size. Megatron rotates the rotary dimensions as
DeepSeek does, in interleaved pairs; the built-in rope rotates halves, so those rows are reordered (the same dot
products).
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from typing import Any

import torch

from rapidtrain.checkpoint.compatibility import CheckpointError
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.hf_weights import _halves_of_pairs, _pairs_of_halves

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
    (".self_attention.linear_q_up_proj.layer_norm_", ".self_attention.q_layernorm."),
    (".self_attention.linear_kv_up_proj.layer_norm_", ".self_attention.kv_layernorm."),
    # torch_dist's key of the stacked routed experts (SequentialMLP's and TEGroupedMLP's alike)
    (".mlp.experts.experts.", ".mlp.experts."),
)
_IGNORED = re.compile(r"(^|\.)_extra_state$|^word_embeddings_for_head\.|\.inv_freq$|^rotary_pos_emb\.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_DEPTH = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")

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
# Mixture-of-experts layers; `experts_fc1` / `experts_fc2`: stacked [experts, ...] (stack_experts), cut by the
# tensor (expert tensor) parallel ranks as fc1 / fc2.
_MOE_PARTS = {
    "mlp.router.weight": ("mlp.router.weight", "same"),
    "mlp.router.bias": ("mlp.router.bias", "same"),
    "mlp.router.expert_bias": ("mlp.expert_bias", "same"),
    "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_experts.fc1.weight", "fc1"),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_experts.fc2.weight", "columns"),
    "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight", "same"),
    "mlp.experts.linear_fc1.weight": ("mlp.experts.w1", "experts_fc1"),
    "mlp.experts.linear_fc1.bias": ("mlp.experts.b1", "experts_fc1"),
    "mlp.experts.linear_fc2.weight": ("mlp.experts.w2", "experts_fc2"),
    "mlp.experts.linear_fc2.bias": ("mlp.experts.b2", "same"),
}
# Multi-head latent attention, in place of the fused q/k/v and the per-head q/k norms. `mla_query`: cut by heads, each
# head's last rotary rows in pairs; `latent`: cut by rows or duplicated; `mla_kv_down`: latent, its last rows rotary.
_MLA_PARTS = {
    "self_attention.linear_q_proj.weight": ("attention.q_proj.weight", "mla_query"),
    "self_attention.linear_q_down_proj.weight": ("attention.q_down_proj.weight", "latent"),
    "self_attention.linear_q_up_proj.weight": ("attention.q_up_proj.weight", "mla_query"),
    "self_attention.q_layernorm.weight": ("attention.q_down_norm.weight", "same"),
    "self_attention.linear_kv_down_proj.weight": ("attention.kv_down_proj.weight", "mla_kv_down"),
    "self_attention.linear_kv_up_proj.weight": ("attention.kv_up_proj.weight", "rows"),
    "self_attention.kv_layernorm.weight": ("attention.kv_down_norm.weight", "same"),
}
# Multi-token prediction's depth K (Megatron-Core's `mtp.layers.K.`, the built-in's `mtp.depths.K.`): its own parts,
# and a transformer layer named as the decoder's (`transformer_layer.` ↔ `layer.`). eh_proj is column-parallel.
_MTP_PARTS = {
    "enorm.weight": ("enorm.weight", "same"),
    "hnorm.weight": ("hnorm.weight", "same"),
    "eh_proj.weight": ("eh_proj.weight", "rows"),
    "final_layernorm.weight": ("final_norm.weight", "same"),
}
_GLOBAL_PARTS = {
    "embedding.word_embeddings.weight": ("embedding.word_embeddings.weight", "rows"),
    "embedding.position_embeddings.weight": ("embedding.position_embeddings.weight", "same"),
    "decoder.final_layernorm.weight": ("final_norm.weight", "same"),
    "decoder.final_layernorm.bias": ("final_norm.bias", "same"),
    "output_layer.weight": ("output.weight", "rows"),
}
VOCABULARY = ("embedding.word_embeddings.weight", "output.weight")


def layer_parts(config: ModelConfig) -> dict[str, tuple[str, str]]:
    """Per layer: Megatron-Core name → (built-in name, how ranks cut it), for this model's attention and MLPs."""
    parts = dict(_LAYER_PARTS)
    if config.multi_latent_attention:
        parts = {name: part for name, part in parts.items()
                 if not name.startswith("self_attention.") or name.startswith("self_attention.linear_proj.")}
        parts.update(_MLA_PARTS)
    return parts | _MOE_PARTS


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


_SEQUENTIAL_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
_GROUPED_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(linear_fc[12]\.(?:weight|bias))(\d+)$")
_LEGACY_GROUPED = re.compile(r"^(.+\.mlp\.experts)\.weight([12])$")


def stack_experts(shard: Shard, local_experts: int | None, source: str) -> Shard:
    """One file's (Core-spelled) shard with each layer's routed experts stacked as `mlp.experts.linear_fc1.weight`
    [experts, rows, h] / `linear_fc2.weight` [experts, h, columns], whatever implementation saved them (module
    docstring). `local_experts`: the experts of one expert-parallel rank, needed for the legacy GroupedMLP only."""
    stacked: Shard = {}
    numbered: dict[str, dict[int, torch.Tensor]] = {}
    for name, value in shard.items():
        expert = _SEQUENTIAL_EXPERT.match(name)
        if expert:
            numbered.setdefault(f"{expert.group(1)}.{expert.group(3)}", {})[int(expert.group(2))] = value
            continue
        expert = _GROUPED_EXPERT.match(name)
        if expert:
            numbered.setdefault(f"{expert.group(1)}.{expert.group(2)}", {})[int(expert.group(3))] = value
            continue
        grouped = _LEGACY_GROUPED.match(name)
        if grouped is None:
            # TEGroupedMLP's single grouped weight (--moe-single-grouped-weight): stacked already, or flat by expert
            flat = is_expert(name) and value.dim() == (2 if name.endswith(".weight") else 1)
            stacked[name] = value.reshape(local_experts, -1, *value.shape[1:]) if flat and local_experts else value
            continue
        if not local_experts:
            raise CheckpointError(f"{source}: {name} holds several experts in one matrix (the legacy GroupedMLP), "
                                  "and the checkpoint's args do not say how many (num_experts)")
        hidden = shard[f"{grouped.group(1)}.weight1"].shape[0]
        if grouped.group(2) == "1":  # [h, I·rows] read as [I, h, rows]
            stacked[f"{grouped.group(1)}.linear_fc1.weight"] = value.reshape(local_experts, hidden, -1).transpose(1, 2)
        else:  # [I·columns, h] read as [I, columns, h]
            stacked[f"{grouped.group(1)}.linear_fc2.weight"] = value.reshape(local_experts, -1, hidden).transpose(1, 2)
    for name, experts in numbered.items():
        if sorted(experts) != list(range(len(experts))):
            raise CheckpointError(f"{source}: the experts of {name} are numbered {sorted(experts)}: the file is "
                                  "damaged")
        stacked[name] = torch.stack([experts[i] for i in range(len(experts))])
    return stacked


def is_expert(name: str) -> bool:
    """Whether a stacked (Core-spelled) entry holds routed experts, which expert-parallel ranks divide."""
    return ".mlp.experts.linear_fc" in name


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


def _rotary_rows(value: torch.Tensor, block: int, rotary: int,
                 reorder: typing.Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`value` in blocks of `block` rows (heads), the last `rotary` rows of each reordered by `reorder`."""
    blocks = value.reshape(-1, block, *value.shape[1:])
    rotated = torch.stack([reorder(b[block - rotary:]) for b in blocks])
    return torch.cat([blocks[:, :block - rotary], rotated], dim=1).reshape(value.shape)


def _latent_rows(base: str, config: ModelConfig) -> int:
    return (config.q_lora_rank or 0) if "q_down" in base else config.kv_lora_rank + config.qk_pos_emb_head_dim


def _merge_experts(parts: list[torch.Tensor], how: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Stacked experts [E, rows, h] (fc1) / [E, h, columns] (fc2), or fc1's bias [E, rows], from their tensor ranks'
    parts → the built-in's input-major [E, h, f] / [E, f, h] (biases [E, f])."""
    weight = parts[0].dim() == 3
    if how == "experts_fc2":
        return {"": _cat(parts, 2).transpose(1, 2).contiguous()}
    if config.gated_linear_unit:  # each rank's gate rows, then its up rows
        halves = [part.chunk(2, dim=1) for part in parts]
        merged = {"gate": _cat([h[0] for h in halves], 1), "": _cat([h[1] for h in halves], 1)}
    else:
        merged = {"": _cat(parts, 1)}
    return {leaf: value.transpose(1, 2).contiguous() if weight else value for leaf, value in merged.items()}


def _merge(parts: list[torch.Tensor], how: str, config: ModelConfig, base: str = "") -> dict[str, torch.Tensor]:
    """The whole value(s) of one saved entry from its tensor-parallel ranks' parts, keyed by the built-in leaf."""
    if how == "same":
        return {"": parts[0]}
    if how.startswith("experts_"):
        return _merge_experts(parts, how, config)
    rotary = config.qk_pos_emb_head_dim
    if how == "mla_query":
        return {"": _rotary_rows(_cat(parts, 0), config.qk_head_dim + rotary, rotary, _halves_of_pairs)}
    if how in ("latent", "mla_kv_down"):  # duplicated (Transformer Engine) or cut by rows (the local spec)
        whole = parts[0] if parts[0].shape[0] == _latent_rows(base, config) else _cat(parts, 0)
        return {"": _rotary_rows(whole, whole.shape[0], rotary, _halves_of_pairs) if how == "mla_kv_down" else whole}
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
    `mlp.gate.bias`; the stacked experts' `mlp.experts.w1` with `gate` → `mlp.experts.w_gate` (b1: b_gate)."""
    if not leaf:
        return base
    module, _, tensor = base.rpartition(".")
    if module.endswith(".experts"):
        return f"{module}.{tensor[0]}_{leaf}"
    return f"{module.rpartition('.')[0]}.{leaf}.{tensor}"


def _part_of(name: str, parts: dict[str, tuple[str, str]], layers: int,
             depths: int) -> tuple[tuple[str, str] | None, str]:
    """(built-in base name and cut, its prefix) of a stage's entry; `layers` / `depths`: the decoder layers and
    multi-token prediction depths of the stages before."""
    layer = _LAYER.match(name)
    if layer:
        return parts.get(layer.group(2)), f"layers.{layers + int(layer.group(1))}."
    depth = _MTP_DEPTH.match(name)
    if depth:
        prefix, rest = f"mtp.depths.{depths + int(depth.group(1))}.", depth.group(2)
        if rest.startswith("transformer_layer."):
            return parts.get(rest.removeprefix("transformer_layer.")), prefix + "layer."
        return _MTP_PARTS.get(rest), prefix
    return _GLOBAL_PARTS.get(name), ""


def merge_stages(stages: list[list[Shard]], config: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """The whole model in built-in names from `stages[pipeline rank][tensor rank]` (Core-spelled shards); layer
    (and multi-token prediction depth) numbers are made global by counting each stage's."""
    whole: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    offset = depths = 0
    parts = layer_parts(config)
    for stage in stages:
        names = list(stage[0])
        missing = [f"tensor rank {r}" for r, shard in enumerate(stage) if set(shard) != set(names)]
        if missing:
            raise CheckpointError(f"{source}: the tensor-parallel files of a pipeline stage hold different tensors "
                                  f"({', '.join(missing)} differ from rank 0's): the checkpoint is damaged")
        for name in names:
            part, prefix = _part_of(name, parts, offset, depths)
            if part is None:
                unknown.append(name)
                continue
            base, how = part
            for leaf, value in _merge([shard[name] for shard in stage], how, config, base).items():
                whole[prefix + _builtin_name(base, leaf)] = value
        offset += len({m.group(1) for name in names if (m := _LAYER.match(name))})
        depths += len({m.group(1) for name in names if (m := _MTP_DEPTH.match(name))})
    if unknown:
        raise CheckpointError(f"{source}: tensors the built-in GPT has no place for: {', '.join(unknown[:6])}"
                              + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else "") + _unread_kind(unknown))
    if offset != config.num_layers:
        raise CheckpointError(f"{source}: the checkpoint has {offset} transformer layers, --num-layers is "
                              f"{config.num_layers}: give the checkpoint's --num-layers")
    if depths != config.mtp_num_layers:
        raise CheckpointError(f"{source}: the checkpoint has {depths} multi-token prediction layers, "
                              f"--mtp-num-layers is {config.mtp_num_layers}: give the checkpoint's --mtp-num-layers")
    return whole


def _unread_kind(unknown: list[str]) -> str:
    """What the tensors no built-in module takes belong to, for the refusal."""
    if any("deepspeed_moe" in name for name in unknown):
        return " (Megatron-DeepSpeed's DeepSpeed-MoE experts are not read: convert the checkpoint to Hugging Face)"
    if any(re.search(r"\.mlp\.experts\.experts\.\d+\.", name) for name in unknown):
        return (" (routed experts saved one tensor per expert, torch_dist's singleton_local_shards layout, are not "
                "read yet)")
    if not any(".self_attention." in name for name in unknown):
        return " (cross-attention, BERT's heads and other modules are not read from Megatron checkpoints)"
    return (" (give --multi-latent-attention and the other attention flags the checkpoint was trained with, or "
            "--qk-layernorm where it has q/k norms)")


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
    value = state[base]
    rotary = config.qk_pos_emb_head_dim
    if how.startswith("experts_") and value.dim() == 3:  # input-major → Megatron's [E, out, in]
        return value.transpose(1, 2)
    if how == "mla_query":
        return _rotary_rows(value, config.qk_head_dim + rotary, rotary, _pairs_of_halves)
    if how == "mla_kv_down":
        return _rotary_rows(value, value.shape[0], rotary, _pairs_of_halves)
    return value


def _cut(value: torch.Tensor, how: str, tensor_parallel: int, rank: int, config: ModelConfig,
         gate: torch.Tensor | None = None) -> torch.Tensor:
    if how == "same":
        return value.clone()
    if how == "columns":
        return value.chunk(tensor_parallel, dim=1)[rank].clone()
    if how == "experts_fc2":
        return value.chunk(tensor_parallel, dim=2)[rank].clone()
    if how == "experts_fc1":
        up = value.chunk(tensor_parallel, dim=1)[rank]
        return up.clone() if gate is None else torch.cat([gate.chunk(tensor_parallel, dim=1)[rank], up], dim=1)
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
    parts = layer_parts(config)
    stages: list[list[Shard]] = []
    for stage in range(pipeline_parallel):
        shards: list[Shard] = [{} for _ in range(tensor_parallel)]
        entries: list[tuple[str, str, str]] = []  # (Megatron name, built-in base, how)
        if stage == 0:
            entries += [(n, b, h) for n, (b, h) in _GLOBAL_PARTS.items() if n.startswith("embedding.")]
        for local in range(per_stage):
            layer = stage * per_stage + local
            entries += [(f"decoder.layers.{local}.{n}", f"layers.{layer}.{b}", h) for n, (b, h) in parts.items()]
        if stage == pipeline_parallel - 1:
            entries += [(n, b, h) for n, (b, h) in _GLOBAL_PARTS.items() if not n.startswith("embedding.")]
            for depth in range(config.mtp_num_layers):
                ours, theirs = f"mtp.depths.{depth}.", f"mtp.layers.{depth}."
                entries += [(theirs + n, ours + b, h) for n, (b, h) in _MTP_PARTS.items()]
                entries += [(f"{theirs}transformer_layer.{n}", f"{ours}layer.{b}", h) for n, (b, h) in parts.items()]
        for name, base, how in entries:
            probe = _builtin_name(base, "q_proj") if how == "qkv" else base
            if probe not in state or (base == "output.weight" and config.tie_embeddings):
                continue
            value = _builtin_value(state, base, how, config)
            gate = None
            if how == "fc1" and config.swiglu:
                gate = state.get(_builtin_name(base, "gate"))
            elif how == "experts_fc1" and config.gated_linear_unit:
                gate = _builtin_value(state, _builtin_name(base, "gate"), how, config)
            for rank in range(tensor_parallel):
                shards[rank][name] = _cut(value, how, tensor_parallel, rank, config, gate)
        stages.append(shards)
    return stages


ExpertSpelling = typing.Literal["sequential", "te_grouped", "legacy_grouped"]


def expert_rank_shard(shard: Shard, expert_parallel: int, rank: int, spelling: ExpertSpelling = "sequential") -> Shard:
    """One expert-parallel rank's part of a shard with stacked experts (split_for_megatron's): its experts
    (rank·I ... rank·I + I - 1) numbered from 0, spelled as SequentialMLP, TEGroupedMLP or the legacy GroupedMLP save
    them (module docstring); the other entries as they are."""
    out: Shard = {}
    for name, value in shard.items():
        if not is_expert(name):
            out[name] = value
            continue
        local = value.chunk(expert_parallel, dim=0)[rank]
        prefix, _, leaf = name.partition(".mlp.experts.")  # leaf: linear_fc1.weight
        experts = f"{prefix}.mlp.experts"
        if spelling == "legacy_grouped":
            if not leaf.endswith(".weight"):
                raise CheckpointError("Megatron's legacy GroupedMLP has no biases (--disable-bias-linear)")
            # Megatron views weight1 [h, I·rows] as [I, h, rows] and weight2 [I·columns, h] as [I, columns, h]
            flat = local.transpose(1, 2).contiguous()
            out[f"{experts}.weight{leaf[len('linear_fc')]}"] = (
                flat.reshape(flat.shape[1], -1) if leaf.startswith("linear_fc1") else flat.reshape(-1, flat.shape[2]))
            continue
        module, _, tensor = leaf.partition(".")
        for index, expert in enumerate(local):
            key = (f"{experts}.local_experts.{index}.{leaf}" if spelling == "sequential"
                   else f"{experts}.{module}.{tensor}{index}")
            out[key] = expert.clone()
    return out


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
