"""--optimizer muon: torch.optim.Muon for the transformer layers' weight matrices, torch.optim.AdamW for every other
parameter, stepped as one optimizer, so the schedule, clipping and checkpoints see one set of groups and one state.

Which parameters Muon takes (`takes_muon`): the 2-D weights inside `layers.*` and the multi-token prediction depths
`mtp.*` (attention's projections, the MLP's, the MoE router and shared experts, MTP's [h, 2h] projection) and the MoE
experts' stacked weights [E, in, out], each expert's matrix orthogonalized on its own (as Megatron-Core does with one
weight per expert). A matrix sharded by FSDP2 or tensor parallelism is gathered whole for its step
(optim/muon_adamw.py): torch.optim.Muon on the shards themselves runs but is wrong (measured with torch 2.13, FSDP2 on
2 ranks: weights off by 1.2e-2 after 3 steps at lr 0.05, AdamW 9e-8). AdamW takes the rest: the embeddings, the output
head (and BERT's head and pooler), norms and biases. Q, K and V are separate matrices in the built-in models, so each
is orthogonalized on its own, as Megatron-Core does by default (--muon-split-qkv); multi-head latent attention's down-
and up-projections are matrices of their own too.

Megatron-Core scales the orthogonalized update of an [out, in] weight by `muon_scale` × --muon-extra-scale-factor
and decays the weight by lr × weight decay. torch's Muon scales it by sqrt(max(1, A / B)) for the [A, B] matrix it
steps (its `adjust_lr_fn="original"`) and decays by its group's lr × weight decay: a group's `lr_mult` (read by the
schedule) makes up the ratio of the two scales, and its weight decay is divided by the same ratio, so the decay stays
lr × wd.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rapidtrain.optim.param_names import STACKED_BIAS_SUFFIXES, WRAPPER_NAMES

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rapidtrain.models.config import ModelConfig

MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_OPTIMIZER_NAMES = ("muon", "dist_muon")  # Megatron-Core's names; both run the same optimizer here


def muon_scale(rows: int, cols: int, mode: str) -> float:
    """Megatron-Core's scale of the orthogonalized update of a [rows, cols] (out × in) weight for --muon-scale-mode:
    shape_scaling is Keller Jordan's, spectral Moonshot's / Scion's (learning rates transfer from AdamW),
    unit_rms_norm keeps the update's RMS at one."""
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    raise ValueError(f"--muon-scale-mode {mode!r}: choose one of {', '.join(MUON_SCALE_MODES)}")


def lr_mult(shape: tuple[int, ...], mode: str, extra_scale_factor: float) -> float:
    """What a Muon group's rate is multiplied by so that torch's `original` adjustment gives Megatron's scale: `shape`
    is an nn.Linear weight's [out, in] or the experts' stacked [E, in, out] (x @ W)."""
    if len(shape) == 3:  # torch adjusts by the expert's matrix as stored, [in, out]
        _, fan_in, fan_out = shape
        rows, cols = fan_in, fan_out
    else:
        fan_out, fan_in = shape
        rows, cols = fan_out, fan_in
    return extra_scale_factor * muon_scale(fan_out, fan_in, mode) / math.sqrt(max(1.0, rows / cols))


def bare_name(name: str) -> str:
    """`name` without the prefixes of wrappers (DDP, torch.compile, activation checkpointing)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


EXPERT_WEIGHT_SUFFIXES = ("experts.w1", "experts.w_gate", "experts.w2")  # [E, in, out], x @ W per expert


def is_expert_weight(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 3 and bare_name(name).endswith(EXPERT_WEIGHT_SUFFIXES)


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """Whether Muon steps this parameter: a 2-D weight of a transformer layer or an MoE layer's stacked expert
    weights (biases, norms, the embeddings and the heads go to AdamW)."""
    bare = bare_name(name)
    # The transformer layers, and the multi-token prediction depths (each a layer and its [h, 2h] projection).
    if bare.split(".")[0] not in ("layers", "mtp") or bare.endswith(".bias") or bare.endswith(STACKED_BIAS_SUFFIXES):
        return False
    return param.ndim == 2 or is_expert_weight(name, param)


def split_for_muon(model: nn.Module, groups: list[dict[str, Any]], weight_decay: float, scale_mode: str,
                   extra_scale_factor: float) -> list[dict[str, Any]]:
    """`groups` (optimizers.param_groups) with Muon's matrices moved into groups of their own, one per update scale
    (`lr_mult`) and kind (`muon_by_matrix`: stacked expert weights), after AdamW's; every group says which optimizer
    steps it (`use_muon`). Muon's groups decay by `weight_decay` / `lr_mult` at their rate × `lr_mult`: lr × weight
    decay, as every other decayed weight."""
    muon_ids = {id(p) for name, p in model.named_parameters() if p.requires_grad and takes_muon(name, p)}
    by_scale: dict[tuple[bool, float], list[nn.Parameter]] = {}
    adamw: list[dict[str, Any]] = []
    for group in groups:
        for param in group["params"]:
            if id(param) in muon_ids:
                key = (param.ndim == 3, lr_mult(tuple(param.shape), scale_mode, extra_scale_factor))
                by_scale.setdefault(key, []).append(param)
        rest = [p for p in group["params"] if id(p) not in muon_ids]
        if rest:
            adamw.append({**group, "params": rest, "use_muon": False})
    if not by_scale:
        raise ValueError("--optimizer muon: no parameter is a 2-D weight of a transformer layer (`layers.N....`), so "
                         "Muon would step nothing; use --optimizer adamw for this model")
    muon = [{"params": params, "use_muon": True, "muon_by_matrix": experts, "lr_mult": mult,
             "weight_decay": weight_decay / mult} for (experts, mult), params in sorted(by_scale.items())]
    return adamw + muon  # AdamW's first group keeps the schedule's own rate: the log line reports groups[0]


def build_muon_with_adamw(groups: list[dict[str, Any]], muon_options: dict[str, Any],
                          adamw_options: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer for groups tagged `use_muon` (split_for_muon's, or a ZeroRedundancyOptimizer's share of them)."""
    from rapidtrain.optim.muon_adamw import MuonWithAdamW  # torch: the plan imports this module without it

    if any("use_muon" not in group for group in groups):
        raise ValueError("--optimizer muon: the parameter groups do not say which parameters Muon steps; pass the "
                         "model (its 2-D layer weights go to Muon) or groups with a `use_muon` key")
    return MuonWithAdamW(groups, muon_options, adamw_options)


def muon_parameter_counts(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """((tensors, elements) Muon steps, (tensors, elements) AdamW steps) of the built-in model, from its settings
    alone (for the plan): Muon takes the layers' 2-D weights and the experts' stacked ones, AdamW everything else."""
    from collections import Counter

    from rapidtrain.models.counting import layer_shapes, parameter_shapes

    layers = Counter(config.num_experts) if config.num_experts else Counter({0: config.num_layers})
    muon_tensors = muon_elements = 0
    if config.mtp_num_layers and config.model_type == "gpt":  # each depth: a layer of the last's kind, [h, 2h]
        layers[config.experts_in_layer(config.num_layers - 1)] += config.mtp_num_layers
        muon_tensors, muon_elements = config.mtp_num_layers, config.mtp_num_layers * 2 * config.hidden_size ** 2
    for experts, count in layers.items():
        shared, stacked = layer_shapes(config, experts)
        matrices = [shape for shape in shared if len(shape) == 2] + [shape for shape in stacked if len(shape) == 3]
        muon_tensors += count * len(matrices)
        muon_elements += count * sum(math.prod(shape) for shape in matrices)
    shapes = parameter_shapes(config)
    tensors = sum(shapes.values())
    elements = sum(math.prod(shape) * n for shape, n in shapes.items())
    return (muon_tensors, muon_elements), (tensors - muon_tensors, elements - muon_elements)
