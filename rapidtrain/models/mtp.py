"""Multi-token prediction (DeepSeek-V3; Megatron-Core's --mtp-num-layers): D extra prediction depths after the
model's layers, each predicting one token further ahead, sharing the model's embedding and output head.

Depth k (1-based) takes the previous depth's hidden states h_{k-1} (h_0: the model's last layer after its final
norm, as Megatron-Core 0.16 moves that norm before the MTP block; checked against its MTP loss in
tests/distributed/test_megatron_core_checkpoints.py) and the embeddings of the tokens k positions ahead, and runs
    h_k = layer_k(eh_proj([enorm(embedding(t_{i+k})); hnorm(h_{k-1})]))      (Megatron's order: embedding first)
then predicts t_{i+k+1} through its own final norm and the shared head. The tokens k ahead are the labels shifted by
k - 1 (labels are the inputs shifted by one), so a depth needs no input ids: the last pipeline stage could hold it.
Positions whose target lies past the sequence (the last k) and ignored labels (< 0) carry no loss.

The loss: `scaling_factor / D · Σ_k mean over the micro-batch's counted tokens of CE_k`, added to the training
loss's gradient (not to the reported loss, as the balancing loss) by the same injection MoE layers use, with the
same backward scale (`moe.set_aux_loss_scale` sets both); its value is recorded per training forward and logged
apart as "mtp loss" (the mean over depths of the unscaled per-depth means). Nothing here knows about parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from rapidtrain.models.config import ModelConfig
from rapidtrain.models.moe import AuxLossInjector, _recomputing
from rapidtrain.models.transformer import TransformerLayer, make_norm, run_layers


class MTPDepth(nn.Module):
    """One prediction depth: two norms, the projection of their concatenation, a transformer layer (of the model's
    last layer's kind: MoE where that is) and a final norm before the shared head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = make_norm(config)
        self.hnorm = make_norm(config)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = TransformerLayer(config, config.num_layers - 1, causal=True)
        self.final_norm = make_norm(config)


class MultiTokenPrediction(nn.Module):
    """The D depths; calling it computes their loss from the model's hidden states and labels (through forward, so
    that parallel styles' hooks on this module run)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.depths = nn.ModuleList([MTPDepth(config) for _ in range(config.mtp_num_layers)])
        self.scaling_factor = config.mtp_loss_scaling_factor
        self.aux_loss_scale = 1.0  # moe.set_aux_loss_scale: the factor the main loss carries into backward
        # [sum of per-forward losses, forwards] since the last collect_mtp_loss (fp64, not a buffer)
        self.recorded: torch.Tensor | None = None
        self.collected_from: torch.Tensor | None = None
        self.stats_paused = False  # moe.routing_stats_paused: forwards that are no training step

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
             head_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], position_ids: torch.Tensor | None,
             attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The scaled MTP loss (a scalar) of one micro-batch: `hidden` [b, s, h] the model's final-normed output,
        `embed` ids → embeddings, `head_loss` (hidden, targets) → per-token loss [b, s] (targets < 0 give 0)."""
        per_depth = []
        tokens = labels
        for depth in cast(list[MTPDepth], list(self.depths)):
            ahead = tokens.clamp(min=0)  # ignored labels embed some token; their targets are ignored below
            targets = _shifted(tokens)
            mixed = depth.eh_proj(torch.cat([depth.enorm(embed(ahead)), depth.hnorm(hidden)], dim=-1))
            layers = nn.ModuleDict({str(self.config.num_layers - 1): depth.layer})
            hidden = run_layers(layers, mixed, self.config, position_ids, attention_mask, causal=True)
            counted = (targets >= 0).sum().clamp(min=1)
            per_depth.append(head_loss(depth.final_norm(hidden), targets).sum() / counted)
            tokens = targets
        mean = torch.stack(per_depth).mean()
        if not (self.stats_paused or _recomputing()):
            value = torch.stack([mean.detach().double(), torch.ones((), dtype=torch.float64, device=mean.device)])
            self.recorded = value if self.recorded is None else self.recorded + value
        return self.scaling_factor * mean

    def inject(self, output: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
        """`output` unchanged; its backward also sends the scaled MTP loss's gradient."""
        return AuxLossInjector.apply(output, mtp_loss * self.aux_loss_scale)


def _shifted(tokens: torch.Tensor) -> torch.Tensor:
    """Each row one position to the left, the freed last position ignored (-100)."""
    return torch.cat([tokens[:, 1:], tokens.new_full((tokens.shape[0], 1), -100)], dim=1)


def mtp_modules(model: nn.Module) -> list[MultiTokenPrediction]:
    return [module for module in model.modules() if isinstance(module, MultiTokenPrediction)]


def collect_mtp_loss(model: nn.Module) -> torch.Tensor | None:
    """[Σ of the recorded per-forward MTP losses, how many forwards] since the last call, fp64, read without a host
    sync; None where the model has no MTP or it did not run in training."""
    for module in mtp_modules(model):
        if module.recorded is not None and module.recorded is not module.collected_from:
            value = module.recorded.clone()
            module.recorded.zero_()
            module.collected_from = module.recorded
            return value
    return None
