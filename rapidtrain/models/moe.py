"""Mixture-of-experts layer (top-k router, capacity, load-balancing and z losses) that replaces the
dense MLP of chosen layers, plus the tracker the training loop reads to log the balancing loss.

Routing decisions, in one place:
- The router is a bias-free Linear run in fp32 (autocast off): softmax probabilities in fp32, as
  Switch Transformer's "selective precision", so bf16 rounding never flips a routing choice.
- top-1 combines with the raw router probability (Switch); top-k > 1 renormalizes the k chosen
  probabilities to sum to 1 (GShard / DeepSpeed top-2).
- Capacity per expert = ceil(k · tokens / experts · capacity_factor), at least `moe_min_capacity`,
  at most `tokens` (more slots could never fill); with token dropping off it is `tokens`.
- Priority inside an expert: all first choices in token order, then all second choices in token
  order (GShard). Assignments past capacity are dropped: weight 0, so the token's MoE output is zero
  and it passes through the residual.
- Balancing loss (Switch/GShard): E · Σ_e mean_prob_e · fraction_e, fraction_e = assignments to e
  (before dropping) / (k · tokens); perfectly even routing gives exactly 1.0. DeepSeek-V3's sequence-wise
  loss (`seq_aux_loss`) is the same formula per sequence, averaged over the sequences. The fractions are those of
  whole sequences also where a layer sees a part of each (context parallelism: `whole_sequence_counts`).

Fine-grained MoE (DeepSeek-V2/V3, Qwen-MoE; Megatron-Core's meanings):
- Scores: softmax (above), sigmoid or sqrt(softplus) (each expert scored on its own); with k > 1 the k chosen
  sigmoid scores are divided by their sum (+ 1e-20), then every combine weight is multiplied by the top-k
  scaling factor when one is given. `pre_softmax`: softmax over all experts, the chosen keep their probabilities.
- Aux-loss-free balancing: a per-expert bias (a buffer, saved in checkpoints) is added to the scores for the
  choice only, never to the combine weights; after each optimizer step every bias moves by ± the update rate
  towards the mean load of the step's tokens (summed over micro-batches and data-parallel ranks:
  `update_expert_biases`).
- Group-limited routing: the experts form G equal groups, a group's score is the sum of its two best scores
  (with the bias), and each token chooses among the experts of its best `group_topk` groups only.
- Shared experts: one dense MLP (all shared experts side by side) that every token passes through, added to the
  routed output; Qwen-MoE multiplies it by sigmoid(Linear(h, 1)(x)) first.
- Sinkhorn routing (Megatron-Core's `sinkhorn` balancing, BASE layers' idea): in training the k experts are the top k
  of the logits balanced by Sinkhorn-Knopp over the micro-batch's tokens (every expert receives the same total mass),
  without gradient; the combine weights are sigmoid(logit) for top-1, the softmax probabilities otherwise, neither
  renormalised nor scaled. In evaluation the top k of those weights. No balancing loss: the balancing is the choice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rapidtrain.models.config import ModelConfig
from rapidtrain.models.counting import GROUP_ROWS_MULTIPLE, padded_rows
from rapidtrain.models.mlp import MLP, GatedUnit, dense_activation, gated_unit


def expert_capacity(
    num_tokens: int,
    num_experts: int,
    topk: int,
    capacity_factor: float,
    min_capacity: int,
    token_dropping: bool = True,
) -> int:
    """Slots per expert: ceil(k · tokens / experts · factor), at least min_capacity, at most tokens.

    The factor is read as the decimal it was written as (1.1 is 11/10), so the ceiling is exact.
    """
    if not token_dropping:
        return num_tokens
    factor = Fraction(capacity_factor).limit_denominator(10**6)
    numerator = topk * num_tokens * factor.numerator
    denominator = num_experts * factor.denominator
    capacity = -(-numerator // denominator)  # integer ceiling, also works on symbolic sizes
    return min(num_tokens, max(min_capacity, capacity))


def expert_counts(expert_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (int64 [E]) of expert_index [T, k], by scatter_add: no [T, k, E] one-hot (64 MB per
    layer at 256 experts, 4096 tokens and top-8) and no host read (bincount's size would need one)."""
    chosen = expert_index.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=chosen.device).scatter_add_(
        0, chosen, torch.ones_like(chosen))


def rank_in_expert(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each assignment's place among those of its expert, in the order given (int64 [N] of `chosen` [N]): a stable
    sort by expert, each sorted position minus its expert's first. No [N, E] one-hot cumsum (N·E integers: 64 MB per
    layer at 256 experts, top-8 and 4096 tokens) and no host read (F.one_hot reads min and max off the device)."""
    order = torch.argsort(chosen, stable=True)
    counts = expert_counts(chosen, num_experts)
    first = counts.cumsum(0) - counts  # the sorted position where each expert's assignments start
    ranks = torch.arange(chosen.numel(), device=chosen.device) - first[chosen[order]]
    return torch.empty_like(chosen).scatter_(0, order, ranks)


def pads_expert_groups(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the grouped expert matmuls run on rows padded per expert to a few bucketed sizes.

    On a CPU, torch runs a bf16/fp16 matrix product through oneDNN, which JIT-compiles a kernel for every new shape
    and caches up to 1,024 of them; grouped_mm's CPU kernel is a loop of such products, one per expert, whose row
    count is that expert's share of the batch: a new shape nearly every step. Measured on an AMD EPYC (Zen 4,
    AVX512-BF16, one thread; 16 experts, 4,096 rows, hidden 256, expert ffn 128, counts drawn anew each step):
    61.7 ms per forward and backward of two projections and 1.2 GiB resident (the kernel cache), against 17.0 ms
    and 340 MiB with the counts bucketed to multiples of 32 (fp32, whose kernels are not per-shape: 26.8 ms,
    325 MiB). CUDA's grouped kernel takes any offsets: no padding there."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def bucketed_counts(counts: torch.Tensor, multiple: int = GROUP_ROWS_MULTIPLE) -> torch.Tensor:
    """Each count rounded up to a multiple of max(`multiple`, an eighth of its power of two) (0 stays 0), on the
    device: at most ~8 sizes per power of two whatever the batch, at most `multiple` + count / 8 rows of padding
    each (`padded_rows` bounds the sum)."""
    octave = torch.floor(torch.log2(counts.clamp(min=1).to(torch.float32)))
    step = torch.exp2(octave - 3).clamp(min=multiple).to(counts.dtype)
    return (counts + step - 1) // step * step


# Expert counts of this layer's tokens → those of the whole sequences they are part of (a sum over the ranks that
# hold the other parts, under context parallelism); set on MoELayer.whole_sequence_counts from outside.
CountReduction = Callable[[torch.Tensor], torch.Tensor]


def load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """E · Σ_e (mean router probability of e) · (share of the k·T assignments that went to e)."""
    num_experts = probs.shape[-1]
    mean_prob = probs.float().mean(dim=0)
    fraction = tokens_per_expert.float() / tokens_per_expert.sum()
    return num_experts * (mean_prob * fraction).sum()


def sequence_load_balancing_loss(probs: torch.Tensor, expert_index: torch.Tensor, sequences: int,
                                 whole_counts: CountReduction | None = None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balancing loss: `load_balancing_loss` of each of `sequences` equal runs of tokens
    (probs [T, E], expert_index [T, k], sequence-major), averaged over the sequences; `whole_counts` makes the
    per-sequence counts [sequences, E] those of whole sequences where the layer sees a part of each."""
    num_experts = probs.shape[-1]
    chosen = expert_index.reshape(sequences, -1)  # each sequence's k·(T / sequences) assignments
    counts = torch.zeros(sequences, num_experts, device=probs.device).scatter_add_(
        1, chosen, torch.ones(chosen.shape, device=probs.device))
    if whole_counts is not None:
        counts = whole_counts(counts)
    mean_prob = probs.float().view(sequences, -1, num_experts).mean(dim=1)
    fraction = counts / counts.sum(dim=-1, keepdim=True)
    return (num_experts * (mean_prob * fraction).sum(dim=-1)).mean()


def limit_to_groups(scores: torch.Tensor, num_groups: int, group_topk: int) -> torch.Tensor:
    """`scores` [T, E] with -inf outside each token's best `group_topk` of `num_groups` equal expert groups; a
    group's score is the sum of its two best scores (one, for groups of a single expert)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    best = group_scores.topk(group_topk, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)


def sinkhorn(logits: torch.Tensor, tolerance: float = 1e-4, max_sweeps: int = 1000) -> torch.Tensor:
    """exp(logits) [T, E] scaled by a factor per token and one per expert until every token's row sums to 1/T and
    every expert's column to 1/E (Sinkhorn-Knopp): the two scalings alternate until the experts' factors move by
    less than `tolerance` on average (read on the host once per sweep), at most `max_sweeps` times. In fp32 with
    autocast off (bf16 matmuls would keep the factors from settling); each row's maximum logit is subtracted first,
    which the row factors absorb exactly, so exp cannot overflow."""
    with torch.autocast(device_type=logits.device.type, enabled=False):
        stable = logits.float()
        kernel = (stable - stable.max(dim=1, keepdim=True).values).exp()
        tokens, experts = kernel.shape
        per_token = kernel.new_ones(tokens)
        per_expert = kernel.new_ones(experts)
        for _ in range(max_sweeps):
            per_token = 1.0 / (tokens * (kernel @ per_expert) + 1e-8)
            updated = 1.0 / (experts * (per_token @ kernel) + 1e-8)
            change = (updated - per_expert).abs().mean()
            per_expert = updated
            if change.item() <= tolerance:
                break
        return per_token.unsqueeze(1) * kernel * per_expert


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean over tokens of logsumexp(router logits)², which keeps the logits small (ST-MoE)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class Routing(NamedTuple):
    """Where each of the k·T assignments (choice-major: all first choices, then all second) goes."""

    token_index: torch.Tensor  # [k·T] the token each assignment comes from
    slot: torch.Tensor  # [k·T] row in the flat [E·C] expert buffer; E·C when dropped
    weight: torch.Tensor  # [k·T] fp32 combine weight, 0 when dropped
    num_tokens: int
    num_experts: int
    capacity: int


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Multiply the router losses' (and multi-token prediction's) gradient by `scale` in `model` (default 1.0).

    Set it to what the main loss is multiplied by before backward, e.g. 1 / accumulation steps
    (times the fp16 loss scale), so both gradients carry the same factor. Read at forward time; a plain
    float attribute, so torch.compile guards on its value."""
    for module in model.modules():  # MoE layers, and multi-token prediction's loss (mtp.py, which builds on this)
        if hasattr(module, "aux_loss_scale"):
            setattr(module, "aux_loss_scale", float(scale))  # noqa: B010 (any module with the attribute)


class AuxLossInjector(torch.autograd.Function):
    """Returns the hidden states unchanged; in backward also sends gradient 1 into `router_loss`.

    So the balancing and z losses train the router without appearing in the model's outputs or
    the training loss (the router loss arrives here already multiplied by the aux-loss scale).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, router_loss: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(router_loss)
        return hidden

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        (router_loss,) = ctx.saved_tensors
        return grad_hidden, torch.ones_like(router_loss)


@contextlib.contextmanager
def routing_stats_paused(model: nn.Module) -> Iterator[None]:
    """Forwards of `model` inside do not count in the routing statistics: forwards that are no training step,
    such as a pipeline stage's shape inference on placeholder inputs."""
    # MoE layers, and multi-token prediction (mtp.py, which builds on this module), which records its loss likewise
    layers: list[Any] = [module for module in model.modules() if hasattr(module, "stats_paused")]
    before = [layer.stats_paused for layer in layers]
    for layer in layers:
        layer.stats_paused = True
    try:
        yield
    finally:
        for layer, paused in zip(layers, before, strict=True):
            layer.stats_paused = paused


def _recomputing() -> bool:
    """True while autograd's engine runs: activation checkpointing re-runs forward there, and the
    tracker must count each real forward once. A compiled graph never re-runs Python, so False."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class Experts(nn.Module):
    """E two-layer MLPs (GELU, or gated with a third matrix `w_gate`: SwiGLU, gpt-oss's clamped quick-GEGLU), stored
    stacked (dim 0 = expert) and input-major ([E, in, out]), so expert parallelism shards dim 0 and one batched
    matmul runs them all. Biases b1/b2 (and the gate's b_gate) exist unless --disable-bias-linear."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_size: int,
        swiglu: bool = False,
        bias: bool = True,
        openai_gelu: bool = False,
        gated_unit: GatedUnit | None = None,
        squared_relu: bool = False,
    ) -> None:
        super().__init__()
        self.openai_gelu = openai_gelu
        self.squared_relu = squared_relu
        self.gated_unit = gated_unit or GatedUnit()  # the gate's activation when `swiglu` (gated); SwiGLU's silu
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size)) if swiglu else None
        self.b1 = nn.Parameter(torch.empty(num_experts, ffn_size)) if bias else None
        self.b_gate = nn.Parameter(torch.empty(num_experts, ffn_size)) if bias and swiglu else None
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # A usable default for a layer built alone; models overwrite it with init_weights.
        for name, param in self.named_parameters(recurse=False):
            if name.startswith("b"):
                nn.init.zeros_(param)
            else:
                nn.init.normal_(param, 0.0, 0.02)

    @staticmethod
    def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.bmm(x, weight) if bias is None else torch.baddbmm(bias.unsqueeze(1), x, weight)

    # Whether forward takes rows sorted by expert with their offsets (grouped matrix products, dropless routing). An
    # expert-parallel subclass exchanges fixed [E, C, h] buffers instead and sets this False.
    takes_grouped_rows = True
    # --recompute-modules moe_act (parallel/recompute.py sets it): the activation between the two projections is
    # recomputed in backward, so its output is not kept (its inputs are, as the projections' outputs)
    recompute_activation = False

    def _activation(self, hidden: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            return self.gated_unit(gate, hidden)
        return dense_activation(hidden, self.openai_gelu, self.squared_relu)

    def activate(self, hidden: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The experts' activation of the first projection `hidden` (gated by `gate` where the experts are)."""
        if self.recompute_activation and torch.is_grad_enabled():
            return checkpoint(self._activation, hidden, gate, use_reentrant=False)
        return self._activation(hidden, gate)

    def forward(self, buffers: torch.Tensor, offsets: torch.Tensor | None = None,
                row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """[E_local, C, h] → [E_local, C, h], one batched matmul per projection over the local experts; or with
        `offsets` (int32 [E], each expert's end row) rows [N, h] sorted by expert → [N, h], one grouped matmul per
        projection (torch's grouped_mm: each row meets its own expert's weights, no capacity; rows past the last offset
        are left undefined), each output row multiplied by its `row_weights` [N] when given. 16-bit on a CPU, the
        caller pads each expert's rows (MoELayer.grouped_padded)."""
        if offsets is not None:
            return self.run_grouped(buffers, offsets, row_weights)
        return self.run_experts(buffers, self.w1, self.w_gate, self.b1, self.w2, self.b2, self.b_gate)

    def run_grouped(self, rows: torch.Tensor, offsets: torch.Tensor,
                    row_weights: torch.Tensor | None = None) -> torch.Tensor:
        # Each row's expert, for the biases, found on the device (no host read of the counts).
        expert = torch.searchsorted(offsets, torch.arange(rows.shape[0], device=rows.device, dtype=offsets.dtype),
                                    right=True) if any(b is not None for b in (self.b1, self.b_gate, self.b2)) \
            else None

        def bias_rows(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            # Rows past the last offset (padded layouts) find expert E: a zero row there, whose gradient is dropped.
            return F.pad(bias.to(dtype), (0, 0, 0, 1))[expert]

        def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            out = F.grouped_mm(x, weight.to(x.dtype), offs=offsets)
            return out if bias is None or expert is None else out + bias_rows(bias, out.dtype)

        if torch.is_autocast_enabled(rows.device.type):  # grouped_mm has no autocast rule: cast once, as autocast
            rows = rows.to(torch.get_autocast_dtype(rows.device.type))
        gate = project(rows, self.w_gate, self.b_gate) if self.w_gate is not None else None
        hidden = self.activate(project(rows, self.w1, self.b1), gate)
        if row_weights is None:
            return project(hidden, self.w2, self.b2)
        # The down projection is linear: weighting its input (ffn wide) costs less than its output (hidden wide) in
        # fine-grained MoE, whose experts are narrower than the model; the bias, added after, is weighted apart.
        scale = row_weights.to(hidden.dtype).unsqueeze(-1)
        out = F.grouped_mm(hidden * scale, self.w2.to(hidden.dtype), offs=offsets)
        return out if self.b2 is None or expert is None else out + scale * bias_rows(self.b2, out.dtype)

    def run_experts(self, buffers: torch.Tensor, w1: torch.Tensor, w_gate: torch.Tensor | None,
                    b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
                    b_gate: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self._project(buffers, w1, b1)
        gate = self._project(buffers, w_gate, b_gate) if w_gate is not None else None
        return self._project(self.activate(hidden, gate), w2, b2)


class MoELayer(nn.Module):
    """Router → dispatch into per-expert capacity buffers → experts → weighted combine.

    `dispatch` and `combine` are the replaceable steps: an expert-parallel version swaps them for
    all-to-all exchanges of the [E, C, h] buffers and shards `experts` along dim 0.
    """

    def __init__(self, config: ModelConfig, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.topk = config.moe_router_topk
        self.capacity_factor = config.moe_capacity_factor
        self.min_capacity = config.moe_min_capacity
        self.token_dropping = config.moe_token_dropping
        self.aux_loss_coeff = config.moe_aux_loss_coeff
        self.z_loss_coeff = config.moe_z_loss_coeff
        self.jitter_eps = config.moe_jitter_eps
        # A bias on the logits with config.moe_router_bias (Megatron-Core's, gpt-oss's); DeepSpeed-MoE's has none.
        self.router = nn.Linear(config.hidden_size, num_experts, bias=config.moe_router_bias)
        self.score_function = config.moe_router_score_function
        self.pre_softmax = config.moe_router_pre_softmax
        self.scaling_factor = config.moe_router_topk_scaling_factor
        self.num_groups = config.moe_router_num_groups
        self.group_topk = config.moe_router_group_topk
        self.per_sequence_aux_loss = config.moe_aux_loss_type == "seq_aux_loss"
        self.sinkhorn = config.moe_aux_loss_type == "sinkhorn"
        self.bias_update_rate = config.moe_router_bias_update_rate
        self.force_load_balancing = config.moe_router_force_load_balancing
        # Aux-loss-free balancing: fp32, used for the choice only; moved by update_expert_biases after each step.
        self.expert_bias: torch.Tensor | None
        self.register_buffer("expert_bias", torch.zeros(num_experts) if config.moe_router_enable_expert_bias
                             else None)
        # Assignments per expert of the training forwards since the last bias update (not a buffer: read and reset
        # every step, so never part of a checkpoint, which is written between steps).
        self.pending_load: torch.Tensor | None = None
        self.experts = Experts(
            num_experts,
            config.hidden_size,
            config.expert_ffn_size,
            swiglu=config.gated_linear_unit,
            bias=config.add_bias_linear,
            openai_gelu=config.openai_gelu,
            gated_unit=gated_unit(config),
            squared_relu=config.squared_relu,
        )
        # PR-MoE (DeepSpeed's Residual-MoE, Rapidformer's --use-expert-residual-network): a dense MLP beside the
        # experts, the two outputs mixed per token by a softmax over two learned coefficients.
        self.residual_mlp: nn.Module | None = None
        self.residual_coefficient: nn.Linear | None = None
        if config.moe_residual:
            self.residual_mlp = MLP(config)
            self.residual_coefficient = nn.Linear(config.hidden_size, 2)
        shared = config.moe_shared_expert_intermediate_size
        self.shared_experts = MLP(config, ffn_size=shared) if shared else None
        self.shared_expert_gate = (nn.Linear(config.hidden_size, 1, bias=False)
                                   if shared and config.moe_shared_expert_gate else None)
        # Tracker, read by collect_*: [aux-loss sum, forwards, assignments per expert...], float64
        # (exact counts). One tensor, not Python numbers: torch.compile guards on the values of
        # int attributes and would recompile every step. Not a buffer: DDP would broadcast it.
        self.routing_stats: torch.Tensor | None = None
        # Rapidformer's models return the balancing loss to the forward step, which adds it to its loss, instead
        # of rapidtrain adding its gradient (`returns_aux_loss`, set by rapidtrain.rapidformer.GPTModel).
        self.returns_aux_loss = False
        self.last_aux_loss: torch.Tensor | None = None
        self.aux_collected_from: torch.Tensor | None = None  # routing_stats when collect_aux_losses last read it
        self.load_collected_from: torch.Tensor | None = None  # ... and when collect_expert_load did
        self.aux_loss_scale = 1.0  # set_aux_loss_scale: the factor the main loss carries into backward
        self.stats_paused = False  # routing_stats_paused: forwards that are no training step
        # The balancing losses' expert counts are the whole sequences' (Megatron-Core sums them over TP × CP): where
        # the layer sees only a part of each sequence (context parallelism), parallel/ sets this to the sum over the
        # parts; the mean router probabilities stay this layer's tokens', and the ranks' losses, averaged with their
        # gradients, are the whole sequences' loss. None: the layer sees whole sequences (under tensor parallelism too:
        # each TP rank routes every token of its sequences).
        self.whole_sequence_counts: CountReduction | None = None

    def router_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 router logits [T, E]; in training, optional multiplicative jitter on the router input."""
        if self.training and self.jitter_eps > 0:
            noise = torch.empty_like(tokens).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            tokens = tokens * noise
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            bias = None if self.router.bias is None else self.router.bias.float()
            logits = F.linear(tokens.float(), self.router.weight.float(), bias)
        if self.force_load_balancing:  # benchmarking: random logits (the router still takes a zero gradient)
            return logits * 0.0 + torch.randn_like(logits)
        return logits

    def scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores [T, E] the combine weights come from, the balancing losses' probabilities [T, E]), fp32."""
        if self.sinkhorn and self.topk == 1:
            return torch.sigmoid(logits), logits.softmax(dim=-1)
        if self.score_function == "softmax":
            probs = logits.softmax(dim=-1)
            return probs, probs
        scores = torch.sigmoid(logits) if self.score_function == "sigmoid" else F.softplus(logits).sqrt()
        return scores, scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)

    def balanced_choice(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Sinkhorn routing in training: the logits balanced over the experts, to choose by (no gradient)."""
        if not (self.sinkhorn and self.training):
            return None
        with torch.no_grad():
            return sinkhorn(logits)

    def choose(self, scores: torch.Tensor, balanced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(combine weights [T, k], expert index [T, k]): the top k by score (+ expert bias, within the best
        groups), weighted by their scores, normalised and scaled as the router's settings say. Sinkhorn routing:
        the top k of `balanced` (in training; of the scores in evaluation), weighted by their scores as they are."""
        if self.sinkhorn:
            expert_index = (scores if balanced is None else balanced).topk(self.topk, dim=-1).indices
            return scores.gather(-1, expert_index), expert_index
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if self.num_groups and self.group_topk:
            choice = limit_to_groups(choice, self.num_groups, self.group_topk)
        if choice is scores:
            weights, expert_index = scores.topk(self.topk, dim=-1)
        else:
            expert_index = choice.topk(self.topk, dim=-1).indices
            weights = scores.gather(-1, expert_index)
        if self.topk > 1 and self.score_function == "softmax" and not self.pre_softmax:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        elif self.topk > 1 and self.score_function != "softmax":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling_factor:
            weights = weights * self.scaling_factor
        return weights, expert_index

    def route(self, probs: torch.Tensor, balanced: torch.Tensor | None = None) -> tuple[Routing, torch.Tensor]:
        """Top-k choice, capacity and priority → (Routing, expert index [T, k]); `probs` are the scores."""
        num_tokens = probs.shape[0]
        weights, expert_index = self.choose(probs, balanced)
        capacity = expert_capacity(
            num_tokens,
            self.num_experts,
            self.topk,
            self.capacity_factor,
            self.min_capacity,
            self.token_dropping,
        )
        chosen = expert_index.t().reshape(-1)  # choice-major: first choices outrank second choices
        position = rank_in_expert(chosen, self.num_experts)
        kept = position < capacity
        slot = torch.where(kept, chosen * capacity + position, self.num_experts * capacity)
        token_index = torch.arange(num_tokens, device=probs.device).repeat(self.topk)
        weight = weights.t().reshape(-1) * kept
        return Routing(token_index, slot, weight, num_tokens, self.num_experts, capacity), expert_index

    def grouped(self, tokens: torch.Tensor, weights: torch.Tensor, expert_index: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """Dropless routing without capacity buffers: the k·T assignments sorted by expert (stable: token order
        inside an expert), one grouped matmul per projection over them, each output weighted and added to its
        token. Computes k·T rows, where [E, C = T, h] buffers would compute E·T. No host read: the counts and
        offsets stay on the device. `counts`: expert_counts(expert_index)."""
        num_tokens, hidden = tokens.shape
        chosen = expert_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # token-major: token t's choices at t·k...
        token_of = torch.div(order, self.topk, rounding_mode="floor")
        row_weights = weights.reshape(-1)[order]
        device = tokens.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.experts.w1.dtype
        if not pads_expert_groups(tokens.device, dtype):
            weighted = self.experts(tokens.index_select(0, token_of), counts.cumsum(0).to(torch.int32),
                                    row_weights=row_weights)
        else:
            weighted = self.grouped_padded(tokens, chosen[order], token_of, row_weights, counts)
        return weighted.new_zeros(num_tokens, hidden).index_add(0, token_of, weighted)

    def grouped_padded(self, tokens: torch.Tensor, sorted_experts: torch.Tensor, token_of: torch.Tensor,
                       row_weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`grouped`'s expert rows [N, h] (sorted by expert) computed with each expert's group padded by zero rows
        to a bucketed size (`pads_expert_groups` says why), in a buffer of static size: padding rows have weight 0
        and are never read back; rows past the last group are not computed (their values are undefined, and stay
        in rows that nothing reads and in gradients that land on dropped zero rows)."""
        num_tokens, hidden = tokens.shape
        padded = bucketed_counts(counts)
        # Sorted assignment j of expert e moves from its rank j - first[e] to padded_first[e] + that rank.
        shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)
        position = torch.arange(token_of.numel(), device=tokens.device) + shift[sorted_experts]
        rows = padded_rows(token_of.numel(), self.num_experts)
        source = torch.full((rows,), num_tokens, device=tokens.device).scatter(0, position, token_of)
        # Gathered in the tokens' dtype, cast by the experts: a token's k row gradients add up in fp32 under
        # autocast, as without padding. Row num_tokens: zeros.
        padded_tokens = F.pad(tokens, (0, 0, 0, 1)).index_select(0, source)
        padded_weights = row_weights.new_zeros(rows).scatter(0, position, row_weights)
        out = self.experts(padded_tokens, padded.cumsum(0).to(torch.int32), row_weights=padded_weights)
        return out.index_select(0, position)

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Tokens [T, h] → per-expert buffers [E, C, h]; empty slots are zero."""
        rows = routing.num_experts * routing.capacity
        # One extra row swallows dropped assignments, keeping every shape static (compile-friendly).
        buffers = tokens.new_zeros(rows + 1, tokens.shape[-1]).index_add(
            0, routing.slot, tokens[routing.token_index]
        )
        return buffers[:rows].view(routing.num_experts, routing.capacity, tokens.shape[-1])

    def combine(self, expert_output: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Expert outputs [E, C, h] → tokens [T, h]: Σ over a token's kept choices of weight · output."""
        hidden = expert_output.shape[-1]
        flat = torch.cat([expert_output.reshape(-1, hidden), expert_output.new_zeros(1, hidden)])
        picked = flat[routing.slot] * routing.weight.unsqueeze(-1).to(flat.dtype)
        return picked.view(-1, routing.num_tokens, hidden).sum(dim=0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        logits = self.router_logits(tokens)
        scores, probs = self.scores(logits)
        balanced = self.balanced_choice(logits)
        if not self.token_dropping and self.experts.takes_grouped_rows:
            weights, expert_index = self.choose(scores, balanced)
            tokens_per_expert = expert_counts(expert_index, self.num_experts)
            output = self.grouped(tokens, weights, expert_index, tokens_per_expert).view(shape)
        else:
            routing, expert_index = self.route(scores, balanced)
            tokens_per_expert = expert_counts(expert_index, self.num_experts)
            output = self.combine(self.experts(self.dispatch(tokens, routing)), routing).view(shape)
        if self.residual_mlp is not None and self.residual_coefficient is not None:
            coefficients = self.residual_coefficient(hidden_states).softmax(dim=-1)
            output = output * coefficients[..., :1] + self.residual_mlp(hidden_states) * coefficients[..., 1:]
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden_states)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(hidden_states))
            output = output + shared
        if not self.training:
            return output
        if self.per_sequence_aux_loss:
            aux_loss = sequence_load_balancing_loss(probs, expert_index, shape[0] if len(shape) == 3 else 1,
                                                    self.whole_sequence_counts)
        else:
            whole = tokens_per_expert if self.whole_sequence_counts is None \
                else self.whole_sequence_counts(tokens_per_expert)
            aux_loss = load_balancing_loss(probs, whole)
        if not (self.stats_paused or _recomputing()):
            self._record(aux_loss.detach(), tokens_per_expert.detach())
            if self.expert_bias is not None:
                load = tokens_per_expert.detach().float()
                self.pending_load = load if self.pending_load is None else self.pending_load + load
        if self.returns_aux_loss:
            self.last_aux_loss = aux_loss
        elif torch.is_grad_enabled():
            router_loss = self.aux_loss_coeff * aux_loss
            if self.z_loss_coeff:
                router_loss = router_loss + self.z_loss_coeff * router_z_loss(logits)
            output = AuxLossInjector.apply(output, router_loss * self.aux_loss_scale)
        return output

    def _record(self, aux_loss: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
        aux_loss = aux_loss.double().view(1)
        stats = torch.cat([aux_loss, torch.ones_like(aux_loss), tokens_per_expert.double()])
        self.routing_stats = stats if self.routing_stats is None else self.routing_stats + stats


def update_expert_biases(modules: list[nn.Module], group: dist.ProcessGroup | None) -> None:
    """Aux-loss-free balancing's step, after each optimizer step: every expert bias in `modules` (a model, or a
    pipeline rank's stages) moves by ± its update rate towards the mean load, the loads being the assignments of the
    step's training forwards summed over the data-parallel `group` (one all-reduce for all layers; no host read).
    Ranks that hold the same layers and see the same tokens (tensor parallelism) compute the same update. Nothing
    happens where no layer has a bias."""
    layers = list({id(layer): layer for module in modules for layer in moe_layers(module).values()
                   if layer.expert_bias is not None}.values())
    if not layers:
        return
    loads = torch.stack([layer.pending_load if layer.pending_load is not None
                         else torch.zeros(layer.num_experts, device=cast(torch.Tensor, layer.expert_bias).device)
                         for layer in layers])
    if group is not None:
        dist.all_reduce(loads, group=group)
    with torch.no_grad():
        for layer, load in zip(layers, loads, strict=True):
            assert layer.expert_bias is not None  # the layers with a bias
            step = torch.sign(load.mean() - load) * layer.bias_update_rate
            layer.expert_bias.add_(step.to(layer.expert_bias.dtype))
            layer.pending_load = None


def moe_layers(model: nn.Module) -> dict[str, MoELayer]:
    """The MoE layers of `model` by name (wrapper prefixes included, as named_modules gives them)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MoELayer)}


def collect_aux_loss_sum(model: nn.Module) -> tuple[torch.Tensor | None, int]:
    """(Σ over MoE layers of each layer's mean unscaled balancing loss over its training forwards since the last
    call, how many layers ran); resets. (None, 0) when no MoE layer ran forward in training.

    Sums, so that the parts of a model split into pipeline stages add up to the whole model's mean.

    Nothing is read on the host (the loop calls this every iteration): a forward replaces `routing_stats` by a
    new tensor, so a layer that ran since the last call is told by the tensor's identity, not by its count.
    """
    ran = [layer for layer in moe_layers(model).values()
           if layer.routing_stats is not None and layer.routing_stats is not layer.aux_collected_from]
    if not ran:
        return None, 0
    means = []
    for layer in ran:
        stats = layer.routing_stats
        assert stats is not None  # `ran` holds the layers with statistics
        means.append(stats[0] / stats[1])
        stats[:2].zero_()
        layer.aux_collected_from = stats
    return torch.stack(means).sum(), len(means)


def collect_aux_losses(model: nn.Module) -> torch.Tensor | None:
    """Mean unscaled balancing loss over MoE layers and training forwards since the last call; resets.

    None when no MoE layer ran forward in training. Each rank returns its own value (detached):
    average across data-parallel ranks before logging if wanted.
    """
    total, layers = collect_aux_loss_sum(model)
    return None if total is None else (total / layers).float()


def collect_expert_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per MoE layer that has run, assignments each expert received (before dropping) since the last call, fp64
    (exact counts); resets. No host read (the log line reads them all at once)."""
    loads = {}
    for name, layer in moe_layers(model).items():
        stats = layer.routing_stats
        if stats is not None and stats is not layer.load_collected_from:  # a forward replaced it since
            loads[name] = stats[2:].clone()
            stats[2:].zero_()
            layer.load_collected_from = stats
    return loads
