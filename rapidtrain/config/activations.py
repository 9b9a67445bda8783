"""Activation memory per rank and per pipeline stage before anything is built, after Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models").

Their count per transformer layer, in bytes of 16-bit tensors with 1-byte dropout masks, is s·b·h·(34 + 5·a·s/h):
  attention  11·s·b·h + 5·a·s²·b   input 2, Q and K 4, V 2, output projection's input 2, dropout mask 1;
                                   softmax output 2·a·s²·b, its dropout mask a·s²·b, the dropped scores 2·a·s²·b
  MLP        19·s·b·h              input 2, first linear's output 8, the activation's output 8, dropout mask 1
  two norms   4·s·b·h              their inputs
Written here in elements so it holds for any precision and shape: 16 tensors of s·b·h elements (for h = a·d, no
grouped-query attention and ffn = 4h) plus two masks, and 3 score tensors of a·s²·b when the attention kernel
keeps its scores. Under tensor parallelism of size t the Q/K/V, scores and MLP parts are split (24/t of the 34); the
norms' inputs and the masks (6 of them) are split only with sequence parallelism; the two blocks' inputs (4) are not
split at all here: DTensor's column-parallel linears save the input they multiply, under sequence parallelism the
all-gathered one (Megatron-Core saves the rank's part and gathers it again in backward, the paper's 34/t).
Selective recompute drops the scores; full recompute keeps the layer's input alone (2·s·b·h, split by t under
sequence parallelism). The last stage keeps the final norm's and head's inputs and the fp32 log-softmax of the
loss (4·s·b·V/t with a vocab-parallel loss), with the logits beside it at the peak (and their fp32 copy in 16-bit
runs; the chunked loss keeps less: head_bytes); the first keeps the embedding dropout's mask.

Beyond the paper's table, which counts what is kept: backward recomputes one layer of one micro-batch at a time,
which then holds again what recompute dropped (the whole layer under full recompute, the scores under selective)
beside everything still kept, and the forward's working set inside a layer is of the same kind; and backward makes
its own tensors beside them (backward_working_bytes: the gradients of one layer's widest tensors; at the loss, the
logits' gradient block and the head weight's gradient; the word embedding's gradient, last). So a stage's peak is
what it keeps plus the larger of that one layer's dropped part with backward's working set and (last stage) the
head's tensors at the loss's backward; on the first stage at least the embedding's gradient. Measured on CPU runs
of every layout, checked after every operator of forward and backward (tests/distributed/test_memory_estimate.py):
without the backward terms most layouts' true peak was 1.15-1.33 times the plan; without the recomputed layer,
the first of two stages held 6.5 times the estimate of its activations under full recompute.

Beyond the paper, which assumes Megatron's 16-bit residual stream: under autocast over fp32 weights the residual
additions and norms run in fp32, so each layer's input and its norms' inputs are fp32 (ActivationContext.
residual_bytes); the built-in attention and SwiGLU cast their input to 16 bits once for their projections (autocast
alone would keep one 16-bit copy per projection).

Beyond the paper, which assumes 16-bit weights (Megatron's): a 16-bit run over fp32 weights (torch autocast) holds a
16-bit copy of every matrix its stage multiplies by, from the forward that casts it until backward — WeightCopies.
Measured on CPU runs of every layout, fp32 and bf16 (tests/distributed/test_memory_estimate.py): without the copies
the bf16 estimates were 35-55% under.

Pipelining: under 1F1B stage i keeps min(p - i, m) micro-batches in flight (stage 0 holds p: the pipeline depth;
with m < p the schedule is GPipe and every stage keeps all m);
the interleaved schedule keeps 2·(p - i - 1) + (v - 1)·p + 1 model chunks of L/(p·v) layers, which for stage 0 is
p micro-batches × (1 + (p - 1)/(p·v)).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from rapidtrain.config.settings import Layout, RecomputeSettings
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.counting import layer_shapes, padded_rows
from rapidtrain.models.loss_blocks import block_size

# Which fp32 weights a 16-bit run copies to 16 bits for its matmuls, each copy kept from the forward that makes it
# to its backward (autocast saves it for the weight's gradient): "all" under torch autocast over fp32 parameters
# (one process, DDP, OSS, FairScale), "head_and_experts" under FSDP2 (its MixedPrecisionPolicy gathers the blocks in
# 16 bits; the root and the experts' units keep fp32, so the head's weight and the experts are copied), "none" in
# fp32 or when DeepSpeed holds 16-bit weights.
WeightCopies = Literal["none", "head_and_experts", "all"]


@dataclass(frozen=True)
class ActivationContext:
    """What decides the bytes besides the model and layout: element size, whether dropout keeps masks and how big,
    whether the attention kernel keeps its s × s scores."""

    element_bytes: int  # 2 for fp16/bf16 activations, 4 for fp32
    mask_bytes: int  # a dropout mask element: 1 on CUDA (bool), the input's size on a CPU (measured)
    hidden_dropout: bool
    scores_kept: bool  # eager attention, or SDPA's math path (a CPU with attention dropout); flash kernels keep none
    chunked_loss: bool = False  # head and loss computed together in chunks (models/chunked_loss.py)
    device_type: str = "cpu"  # the chunks' size depends on it
    weight_copies: WeightCopies = "none"
    # the scores come from SDPA's math path on a CPU (attention dropout), which computes 16-bit inputs in fp32
    scores_upcast: bool = False
    # dropless grouped experts pad each expert's rows to bucketed sizes (16-bit on a CPU: models/moe.py's
    # `pads_expert_groups`), in buffers of models/counting.py's `padded_rows`
    padded_expert_groups: bool = False
    # rapidtrain's short-sequence kernel (models/attention.py's short_attention, config/memory.py's
    # short_attention_planned): it keeps the bf16 probabilities and, with attention dropout, a bool keep-mask
    short_attention: bool = False

    @property
    def score_bytes(self) -> int:
        """An element of a kept score tensor (the softmax's output, its dropout mask, the dropped scores): fp32 from
        SDPA's CPU math path whatever the inputs (it upcasts fp16/bf16 query and key before the matmul: measured,
        bf16 at seq 256, three fp32 [b, heads, s, s] tensors per layer, 6.3 MB the plan had counted as 3.1 in bf16
        and a 2,048-row head's share no longer covered); the activations' own size from an eager kernel."""
        return 4 if self.scores_upcast else self.element_bytes

    @property
    def score_mask_bytes(self) -> int:
        """An element of the attention dropout's mask over the scores: the scores' size on a CPU (measured)."""
        return self.score_bytes if self.scores_upcast else self.mask_bytes

    @property
    def residual_bytes(self) -> int:
        """An element of the residual stream (each layer's input and its norms' inputs): fp32 under autocast over fp32
        weights, whose residual additions and norms run in fp32; the activations' own size otherwise."""
        return 4 if self.weight_copies == "all" else self.element_bytes

    @staticmethod
    def of(model: ModelConfig, dtype: str, device_type: str) -> ActivationContext:
        element = 4 if dtype == "fp32" else 2
        mask = 1 if device_type == "cuda" else element
        math_path = device_type == "cpu" and model.attention_dropout > 0 and model.attention_kernel != "eager"
        scores = model.attention_kernel == "eager" or math_path
        return ActivationContext(element, mask, model.hidden_dropout > 0, scores, device_type=device_type,
                                 scores_upcast=math_path, padded_expert_groups=device_type == "cpu" and element == 2)


def routed_rows_per_token(model: ModelConfig, layout: Layout, experts: int, act: ActivationContext,
                          tokens: int) -> float:
    """Rows the routed experts compute per token of an MoE layer of `tokens` tokens (a micro-batch's on this rank):
    capacity buffers of k·T·factor rows with token dropping; dropless, the k assignments grouped by expert (k·T rows;
    16-bit on a CPU, each expert's group padded to a bucketed size in a buffer of `padded_rows(k·T, E)` rows, at the
    memory test's DeepSeek shape ~1.8·k·T), or under expert parallelism, whose all-to-all exchanges equal [E, C, h]
    buffers, E buffers of C = T rows."""
    k = model.moe_router_topk
    if model.moe_token_dropping:
        return k * max(model.moe_capacity_factor, 1.0)
    if layout.expert_parallel_size > 1:
        return float(experts)
    if act.padded_expert_groups:
        return padded_rows(k * tokens, experts) / tokens
    return float(k)


def mlp_wide_tensors(model: ModelConfig) -> int:
    """[tokens, ffn] tensors the MLP keeps for backward (models/mlp.py): GELU its fc1 output and the activation's;
    a gated unit the gate, the linear half, act(gate) and the product; quick GELU's sigmoid output besides (silu keeps
    only its input); a clamp its clamped gate and linear half besides their inputs (with --glu-linear-offset the
    shifted linear half takes the clamped one's place). gpt-oss: 7, where SwiGLU keeps 4: the 2,048-row head of the
    demo tokenizer left the three uncounted ones outside the memory test's 15%."""
    if not model.gated_linear_unit:
        return 2
    return 4 + (1 if model.quick_geglu else 0) + (2 if model.activation_clamp is not None else 0)


def _mlp_width(model: ModelConfig, layout: Layout, act: ActivationContext, tokens: int, experts: int,
               tensors: float) -> float:
    """Elements per token of `tensors` [tokens, ffn] tensors of one layer's MLP: the dense FFN's, or the routed
    experts' copies of each token (routed_rows_per_token) with the shared experts' dense MLP beside them."""
    if experts:
        return tensors * (model.expert_ffn_size * routed_rows_per_token(model, layout, experts, act, tokens)
                          + (model.moe_shared_expert_intermediate_size or 0))
    return tensors * model.ffn_size


def layer_bytes(model: ModelConfig, micro: int, layout: Layout, act: ActivationContext,
                granularity: str = "none", experts: int = 0) -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch on one rank.

    The attention's and the MLP's inputs (the norms' outputs, which their first linears save for the weights'
    gradients) are whole [s, b, h] tensors on every tensor-parallel rank, sequence parallel or not: under sequence
    parallelism DTensor's column-parallel linear saves the all-gathered input it multiplies (Megatron-Core saves the
    rank's part and gathers it again in backward; Korthikanti et al. count that, 2·s·b·h/t). Measured at TP 2 + SP,
    seq 256 × hidden 128: two [s, b, h] all-gather outputs per layer, 0.26 MB each.

    Op-level recompute (parallel/recompute.py's policy) keeps every matmul's, attention kernel's and collective's
    output, needed or not, and recomputes the rest from the layer's input: the Q, K, V, attention and fc1 outputs
    (split by heads or columns); the two row-parallel linears' (o_proj, fc2) outputs, whole [s, b, h] partial sums
    under tensor parallelism (the reduction comes after the matmul); under tensor parallelism the reductions' outputs
    too (an all-reduce's whole, a reduce-scatter's s/t part), and under sequence parallelism the two all-gathered
    inputs. So under TP 2 + SP op-level keeps more than no recompute (measured 2.49 MB per layer against 2.36 at seq
    256 × hidden 128, GELU, fp32; the plan had counted 1.44 as if all but the input were split by t, and the draw's
    tp2_sp recompute=op measured 9.72 MB of activations against 7.34 planned)."""
    s, h, b = model.seq_length, model.hidden_size, micro
    t = layout.tensor_parallel_size
    sequence = t if layout.sequence_parallel else 1  # the residual stream's split
    e, r = act.element_bytes, act.residual_bytes
    if granularity == "full":
        return s * b * h * r / sequence
    attention, latents = _attention_widths(model)
    if granularity == "op":
        kept_wide = 2 if model.gated_linear_unit else 1
        kept_matmuls = (attention + _mlp_width(model, layout, act, s * b, experts, kept_wide)) * e / t
        reductions = 2 * h * e / sequence if t > 1 else 0.0
        gathered = 2 * h * e if layout.sequence_parallel else 0.0
        per_token = h * r / sequence + kept_matmuls + 2 * h * e + reductions + gathered
    else:
        # fc1 and activation outputs (SwiGLU: + gate, product; gpt-oss's clamped quick GEGLU more: mlp_wide_tensors)
        mlp_width = _mlp_width(model, layout, act, s * b, experts, mlp_wide_tensors(model))
        masks = 2 * act.mask_bytes * h if act.hidden_dropout else 0
        # split along the sequence under SP: the two norms' inputs and dropout masks; whole: the attention and MLP
        # inputs (gathered under SP) and MLA's latents; split by heads or columns: Q, K, V, attention output, the
        # MLP's wide tensors
        per_token = (2 * h * r + masks) / sequence + (2 * h + latents) * e + (attention + mlp_width) * e / t
    scores = 0.0
    cp = layout.context_parallel_size  # `model` is a context-parallel rank's (its seq_length the local part)
    if _kernel_keeps_scores(act, layout) and granularity != "selective":
        heads = model.num_attention_heads
        # under context parallelism the local queries see every key (a2a: heads/CP of the whole sequence's)
        kept = 2 * act.score_bytes + (act.score_mask_bytes if model.attention_dropout > 0 else 0)
        if act.short_attention:
            kept = act.score_bytes + (1 if model.attention_dropout > 0 else 0)
        if granularity == "op":
            # an eager kernel or SDPA's math path is plain ops to op-level recompute: it keeps the q·kᵀ matmul's
            # output and recomputes the softmax and dropout from it (measured: 4.0 MB of two layers' fp32 scores at
            # seq 256, bf16, attention dropout, which the plan had left out)
            kept = act.score_bytes
        scores = heads * s * s * cp * b * kept / t
    if model.softmax_type != "vanilla" and model.attention_kernel in ("auto", "sdpa", "sdpa_flash", "sdpa_cudnn"):
        # attention sinks under SDPA: the float mask [heads, s, s + 1] that carries them, an input SDPA keeps; one per
        # layer, shared by the micro-batch under causal masking alone (a per-row mask, b of them: not counted)
        scores += model.num_attention_heads * s * (s + 1) * e / t
    if cp > 1:
        scores += context_parallel_bytes(model, micro, layout, act) if granularity not in ("full",) else 0.0
    return s * b * per_token + scores


def _kernel_keeps_scores(act: ActivationContext, layout: Layout) -> bool:
    """Whether the attention kernel keeps its scores: under context parallelism the ring computes its own blocks
    and keeps none of their scores (its kept output: context_parallel_bytes); allgather and a2a call the model's
    kernel (allgather with a boolean mask, which a CPU's SDPA serves without keeping scores: measured at CP 2)."""
    if layout.context_parallel_size > 1 and layout.cp_comm_type == "p2p":
        return False
    return act.scores_kept


def context_parallel_bytes(model: ModelConfig, micro: int, layout: Layout, act: ActivationContext) -> float:
    """What one layer's attention exchange keeps for backward on a context-parallel rank (parallel/
    context_parallel.py), for `model` of the rank's local sequence part s:
    - p2p: the ring's running output and log-sum-exp in fp32 (s · heads · (dv + 1) per sample). Its forward keeps
      nothing else beyond the local q, k, v the layer counts anyway: the blocks received from the other ranks are
      not kept (backward passes them around the ring again, with their dK/dV, and recomputes each block pair's
      scores and dropout mask), as in Megatron-Core's ring (Transformer Engine) and ring-flash-attention, so the
      ring keeps the same bytes whatever CP and the attention dropout;
    - allgather: the gathered K/V of the whole sequence (CP · s tokens);
    - a2a: the whole sequence's Q, K, V and output of heads/CP heads (as many elements as the local ones)."""
    s, b, t, cp = model.seq_length, micro, layout.tensor_parallel_size, layout.context_parallel_size
    e = act.element_bytes
    attention, _ = _attention_widths(model)
    if model.multi_latent_attention:
        kv = model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim)
    else:
        kv = 2 * model.head_dim * model.query_groups
    if layout.cp_comm_type == "a2a":
        return s * b * attention * e / t
    if layout.cp_comm_type == "allgather":
        return cp * s * b * kv * e / t
    value = model.v_head_dim if model.multi_latent_attention else model.head_dim
    return s * b * model.num_attention_heads * (value + 1) * 4 / t


def _attention_widths(model: ModelConfig) -> tuple[int, int]:
    """Per token, the attention's tensors kept for backward that tensor parallelism splits by heads (Q, K, V and the
    attention output), and those every rank keeps whole (0 but for multi-head latent attention).

    Multi-head latent attention (models/mla.py) keeps per head the query projection's output and the query and key
    it concatenates from their parts (qk_head_dim + qk_pos_emb_head_dim each), kv_up's output (qk_head_dim +
    v_head_dim, the values a view of it), the attention output and o_proj's input (v_head_dim each); whole on every
    rank, kv_down's output, the normed kv latent and, with --q-lora-rank, the q latent and its normed copy (measured
    on its saved tensors: 406 against 404 elements per token, tests/unit/test_mla_and_yarn.py)."""
    if not model.multi_latent_attention:
        inner, kv = model.head_dim * model.num_attention_heads, model.head_dim * model.query_groups
        return 2 * inner + 2 * kv, 0
    query, v = model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
    latents = 2 * model.kv_lora_rank + model.qk_pos_emb_head_dim + 2 * (model.q_lora_rank or 0)
    return model.num_attention_heads * (3 * query + model.qk_head_dim + 3 * v), latents


def weight_copy_bytes(model: ModelConfig, layout: Layout, act: ActivationContext, experts: int = 0) -> float:
    """The 16-bit copies of one layer's fp32 matrices (`act.weight_copies`: all of them, or the experts' alone), on
    one rank: tensor parallelism splits the shared ones, expert parallelism the experts. One copy per step whatever
    the micro-batches in flight or the recompute: autocast caches each cast weight until its context ends, and the
    pipeline runs its whole schedule in one context (a data-parallel micro-batch ends its forward before the next
    begins). The router's counts too, though it runs in fp32 (a small overestimate)."""
    if act.weight_copies == "none":
        return 0.0
    shared, stacked = layer_shapes(model, experts)
    matrices = sum(math.prod(shape) for shape in shared if len(shape) >= 2) / layout.tensor_parallel_size
    copied = sum(math.prod(shape) for shape in stacked) / layout.expert_parallel_size
    return act.element_bytes * (copied + (matrices if act.weight_copies == "all" else 0.0))


def head_bytes(model: ModelConfig, micro: int, layout: Layout, act: ActivationContext, backward: bool = False,
               weight_gradient_is_a_temporary: bool = True) -> float:
    """The last stage's at the loss (measured): the final norm's input (the residual stream) and output, under
    sequence parallelism both the rank's part and the head's input their whole all-gather (measured), the head's
    weight copied to 16 bits (`act.weight_copies`), and the loss's tensors:
    - plain path: the logits in the matmul's dtype, their fp32 copy when 16-bit, and the fp32 log-softmax saved for
      backward, each split by the vocabulary under tensor parallelism;
    - chunked (models/chunked_loss.py): the logits kept in the matmul's dtype (16-bit, or fp32 when one block holds
      the vocabulary), and the one fp32 block being reduced (a 16-bit or kept block's fp32 copy, or the block
      itself), which the log-sum-exp overwrites in place: no other block-sized tensor; `backward`: at the loss's
      backward, where the chunked path peaks, also the block's gradient cast to 16 bits and the head weight's
      gradient in the matmul's dtype unless it becomes the weight's .grad itself
      (`weight_gradient_is_a_temporary`, head_gradient_is_a_temporary); the plain path's backward (without tensor
      parallelism; the vocab-parallel loss keeps to its forward's) holds three fp32 [tokens, vocabulary] tensors."""
    s, h, b, t = model.seq_length, model.hidden_size, micro, layout.tensor_parallel_size
    e, tokens, vocab = act.element_bytes, model.seq_length * micro, model.vocab_size
    norms = s * b * h * (act.residual_bytes + e) / (t if layout.sequence_parallel else 1)
    if layout.sequence_parallel:  # the head's input, all-gathered from the final norm's parts: whole
        norms += s * b * h * e
    weight = e * vocab * h / t if act.weight_copies != "none" else 0.0
    if act.chunked_loss:
        block = min(block_size(vocab, math.ceil(tokens), act.device_type), vocab)
        kept = e <= 2 or block >= vocab
        weight_gradient = e * vocab * h if weight_gradient_is_a_temporary else 0.0
        gradients = ((e * tokens * block if e < 4 else 0) + weight_gradient) if backward else 0.0
        return norms + weight + (e * tokens * vocab if kept else 0) + 4 * tokens * block + gradients
    fp32_copy = 4 if e < 4 else 0
    per_logit = e + fp32_copy + 4
    if backward and t == 1:  # F.cross_entropy's backward: the saved log-softmax, its gradient and the logits'
        per_logit = max(per_logit, 12)
    return norms + weight + per_logit * tokens * vocab / t


def head_gradient_is_a_temporary(model: ModelConfig, micro_batches: int, layout: Layout,
                                 act: ActivationContext) -> bool:
    """Whether the chunked loss's head-weight gradient (the [vocabulary, h] tensor its backward fills; the chunked
    path runs without tensor parallelism) lives beside the gradient the weight holds: it does when it is made in 16
    bits and cast into the fp32 .grad, when a micro-batch before it left a gradient to add it to, or when an engine
    copies or reduces it (any data parallelism), or when the head is tied to the word embedding on the same stage
    (autograd holds the head's gradient until the embedding's arrives at the end of backward, and adds the two).
    Otherwise (fp32, one micro-batch, no data parallelism, an untied head or a pipeline's last stage with its own
    copy) autograd makes it the weight's .grad itself, which the model states already count (activations measured
    over planned, one process, fp32: untied 1.008; tied 1.007 with it counted, 1.23 without). The same rule as the
    word embedding's gradient, and 16 bits."""
    return act.element_bytes < 4 or embedding_gradient_is_a_temporary(model, micro_batches, layout)


def embedding_gradient_bytes(model: ModelConfig, layout: Layout, act: ActivationContext) -> float:
    """The first stage's word-embedding gradient as backward makes it, before it is added to the gradient already
    there (the micro-batches after the first), copied into the engine's buckets or partitions, or reduced: a
    [vocabulary / t, h] tensor in the parameters' dtype (fp32 under autocast): under tensor parallelism the
    vocabulary-parallel embedding's backward makes only the rank's rows (parallel/tensor_parallel.py). It is the
    last thing backward makes, when the layers' activations are freed: a peak of its own where they are small
    (full recompute, tensor parallelism)."""
    element = 4 if act.weight_copies == "all" else act.element_bytes
    rows = -(-model.vocab_size // layout.tensor_parallel_size)  # torch.chunk's split: the first ranks' share
    return element * rows * model.hidden_size


def embedding_gradient_is_a_temporary(model: ModelConfig, micro_batches: int, layout: Layout) -> bool:
    """Whether backward's word-embedding gradient lives beside the gradient the weight holds: it does when there is
    one already (a micro-batch before it, or a tied head on the same stage whose gradient came first) or an engine
    copies or reduces it (any data parallelism). Otherwise autograd makes it the weight's .grad itself (measured:
    PP 2, one micro-batch, full recompute, bf16: the first stage's peak is its kept activations, 0.48 MiB, not the
    1.97 MiB gradient)."""
    tied_here = model.tie_embeddings and layout.pipeline_parallel_size == 1
    return micro_batches > 1 or layout.data_parallel_size > 1 or tied_here


def embedding_bytes(model: ModelConfig, micro: int, layout: Layout, act: ActivationContext) -> float:
    """The first stage's: the embedding dropout's mask."""
    if not act.hidden_dropout:
        return 0.0
    split = layout.tensor_parallel_size if layout.sequence_parallel else 1
    return model.seq_length * micro * model.hidden_size * act.mask_bytes / split


def chunks_in_flight(stage: int, layout: Layout, micro_batches: int) -> float:
    """Model chunks whose activations stage `stage` holds at its peak, in units of the stage's whole layers
    (one micro-batch through all of them = 1)."""
    p, v = layout.pipeline_parallel_size, layout.virtual_pipeline_stages
    if v <= 1:
        # 1F1B: stage i warms up with p - i forwards; with fewer micro-batches than stages the schedule is GPipe
        # (parallel/pipeline.py), whose every stage runs all its forwards before any backward.
        return min(p - stage, micro_batches) if micro_batches >= p else micro_batches
    chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, micro_batches * v)
    return chunks / v


def recomputed_again(model: ModelConfig, micro: int, layout: Layout, act: ActivationContext, granularity: str,
                     experts: int = 0) -> float:
    """What one recomputed layer of one micro-batch holds again while backward recomputes it: what recompute
    dropped from it (0 without recompute)."""
    if granularity == "none":
        return 0.0
    # none at least: op-level recompute under tensor parallelism keeps more than no recompute (layer_bytes)
    return max(0.0, layer_bytes(model, micro, layout, act, "none", experts)
               - layer_bytes(model, micro, layout, act, granularity, experts))


def backward_working_bytes(model: ModelConfig, micro: int, layout: Layout, act: ActivationContext,
                           experts: int = 0) -> float:
    """What backward makes while it runs through one layer of one micro-batch, beside what the layers keep
    (measured on CPU runs): the gradients of the MLP's wide tensors (GELU: one [s, b, ffn]; SwiGLU: three, its two
    branches and their product), split by tensor parallelism, and of the layer's input before any reduction (whole),
    and in a 16-bit run that copies fp32 weights, the 16-bit gradient of its widest matrix before it is cast to
    fp32. Attention's own (its inputs' gradients, or two fp32 score-sized gradients where the scores are kept)
    comes after the MLP's wide tensors are freed, and is no larger where measured."""
    s, h, b, t = model.seq_length, model.hidden_size, micro, layout.tensor_parallel_size
    e = act.element_bytes
    wide: float = (3 if model.gated_linear_unit else 1) * model.ffn_size
    if experts:
        wide = (3 if model.gated_linear_unit else 1) * model.expert_ffn_size \
            * routed_rows_per_token(model, layout, experts, act, s * b)
    weight_gradient = e * h * model.ffn_size / t if act.weight_copies != "none" and e < 4 else 0.0
    return e * s * b * (wide / t + h) + weight_gradient


def stage_activation_bytes(model: ModelConfig, micro: int, micro_batches: int, layout: Layout,
                           act: ActivationContext, recompute: RecomputeSettings) -> list[float]:
    """Activation bytes at each pipeline stage's peak, on one rank of it: what it keeps, plus the larger of the
    layer being recomputed with backward's working set in it and (last stage) the head's tensors at the loss's
    backward; on the first stage at least the word embedding's gradient."""
    p = layout.pipeline_parallel_size
    # layers per rank: the same on each, or an uneven split's (config/pipeline_split.py)
    per_rank = layout.layers_per_rank(model.num_layers) if layout.stage_layers else [model.num_layers // p] * p
    head_rank = layout.head_rank()  # the last stage's rank: p - 1, or 0 on a V (ZBV, DualPipeV)
    if layout.context_parallel_size > 1:  # each rank holds its part of every sequence: counted per local token
        model = dataclasses.replace(model, seq_length=model.seq_length // layout.context_parallel_size)
    stages = []
    for stage in range(p):
        per_stage, start = per_rank[stage], sum(per_rank[:stage])
        recomputed = len(recompute.layers_of(per_stage)) if recompute.enabled else 0
        # --cpu-offloading: these layers' saved tensors wait in host memory (on a CPU that is the same memory)
        offloaded = min(recompute.offload_layers, per_stage) if act.device_type == "cuda" else 0
        if model.num_experts:  # layer kinds differ: count each layer (MoE models have tens of layers)
            kinds = model.num_experts[start:start + per_stage]
            granularity = recompute.counted_granularity
            layers = sum(layer_bytes(model, micro, layout, act, granularity if i < recomputed else "none", experts)
                         for i, experts in enumerate(kinds) if i >= offloaded)
            copies = sum(weight_copy_bytes(model, layout, act, experts) for experts in kinds)
            again = max((recomputed_again(model, micro, layout, act, recompute.counted_granularity, experts)
                         for experts in kinds[:recomputed]), default=0.0)
            working = max((backward_working_bytes(model, micro, layout, act, experts) for experts in kinds),
                          default=0.0)
        else:  # dense: two kinds at most, counted by arithmetic (a plan of 10^8 layers answers at once)
            layers = recomputed * layer_bytes(model, micro, layout, act, recompute.counted_granularity) \
                + max(per_stage - recomputed - offloaded, 0) * layer_bytes(model, micro, layout, act)
            copies = per_stage * weight_copy_bytes(model, layout, act)
            again = recomputed_again(model, micro, layout, act, recompute.counted_granularity) if recomputed else 0.0
            working = backward_working_bytes(model, micro, layout, act)
        if stage == head_rank and model.mtp_num_layers and model.model_type == "gpt":
            # multi-token prediction's depths run after the last layer: each keeps a layer of the last layer's kind,
            # its [s, b, 2h] concatenated input, the embeddings of the tokens ahead, and its own head and loss's
            # tensors (as the main head's forward keeps them: its loss is computed before the main one's backward)
            last = model.experts_in_layer(model.num_layers - 1)
            extra = layer_bytes(model, micro, layout, act, "none", last) \
                + 3 * model.seq_length * micro * model.hidden_size * act.element_bytes \
                + head_bytes(model, micro, layout, act)
            layers += model.mtp_num_layers * extra
            copies += model.mtp_num_layers * weight_copy_bytes(model, layout, act, last)
        total = chunks_in_flight(stage, layout, micro_batches) * layers + copies
        if stage == 0:
            total += min(p, micro_batches) * embedding_bytes(model, micro, layout, act)
        at_loss = 0.0
        if stage == head_rank:
            temporary = head_gradient_is_a_temporary(model, micro_batches, layout, act)
            at_loss = head_bytes(model, micro, layout, act, backward=True, weight_gradient_is_a_temporary=temporary)
        total += max(again + working, at_loss)
        if stage == 0 and embedding_gradient_is_a_temporary(model, micro_batches, layout):
            total = max(total, embedding_gradient_bytes(model, layout, act))
        stages.append(total)
    return stages
