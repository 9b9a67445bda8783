"""Megatron tensor parallelism for the built-in GPT and BERT with DTensor `parallelize_module`.

Attention q/k/v and the MLP's fc1 (and SwiGLU gate) are split by columns (each rank owns whole heads and,
with grouped-query attention, whole key/value groups: query_groups / TP of them, which serve exactly the
rank's query heads), o_proj and fc2 by rows; multi-head latent attention splits its per-head up-projections
(q_up_proj or q_proj, kv_up_proj) by columns and keeps the down-projections and latent norms whole; the word
embedding is split by vocabulary rows and the logits stay split on the vocabulary dimension into
`loss_parallel` (no rank ever holds full logits). Every other parameter becomes a replicated DTensor, so
optimizers, gradient norms and checkpoints see one kind of tensor.

Dropout RNG. Every rank is seeded alike (`seed_everything`), and the ranks of a tensor-parallel group
run the same operations on the same shapes, so the default generator advances in lockstep: dropout on
a replicated tensor (embeddings, the residual stream without sequence parallelism) draws the same mask
on every rank, as it must. Where a rank holds its own part of a tensor (attention probabilities of its
heads; with --sequence-parallel, its slice of the sequence) Megatron uses a per-rank "model-parallel"
RNG; here `ShardedDropoutRNG` forks the generator around those modules: it draws one number from the
shared stream (keeping the ranks in lockstep and making activation recomputation repeat the masks)
and seeds the module's dropout from it and the tensor-parallel rank. (On CUDA, DTensor's own
OffsetBasedRNGTracker serves the dropout of sequence-sharded DTensors; CPU has no such tracker.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from rapidtrain.models.config import ModelConfig
from rapidtrain.models.mla import MultiLatentAttention
from rapidtrain.models.moe import MoELayer
from rapidtrain.models.transformer import Attention, OutputLayer, TransformerLayer

_RNG_SALT = 0x9E3779B97F4A7C15  # spreads the per-rank seeds far apart (golden-ratio constant)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Split a built-in GPT/BERT (or one pipeline stage of it) over `tp_mesh`, in place.

    Parameter names stay the full model's, so checkpoints reshard between layouts.
    """
    if not hasattr(model, "layers") or not hasattr(model, "config"):
        raise ValueError(
            f"--tensor-model-parallel-size applies to the built-in GPT/BERT models; {type(model).__name__} "
            "has no `layers`/`config`. Use --tensor-model-parallel-size 1 (and ZeRO/FSDP for memory) for "
            "other models."
        )
    check_tensor_parallel_shape(model.config, tp_mesh.size())
    _enable_loss_parallel()
    residual = Shard(1) if sequence_parallel else Replicate()
    # The casts: nn.Module's __getattr__ types a submodule Tensor | Module.
    if getattr(model, "embedding", None) is not None:
        _split_embedding(cast(nn.Module, model.embedding), tp_mesh, sequence_parallel)
    # ALiBi: this rank computes heads [rank × heads / TP, ...), and takes their slopes.
    first_head = tp_mesh.get_local_rank() * (cast(ModelConfig, model.config).num_attention_heads // tp_mesh.size())
    for layer in cast(Mapping[str, TransformerLayer], model.layers).values():  # a ModuleDict of them
        _split_layer(layer, tp_mesh, residual, sequence_parallel)
        layer.attention.first_head = first_head
    _split_head(model, tp_mesh, residual, sequence_parallel)
    _tie_output_to_embedding(model)
    parallelize_module(cast(nn.Module, model.loss), tp_mesh, VocabParallelLoss())
    per_head_norms = {id(norm) for attention in model.modules() if isinstance(attention, Attention)
                      for norm in (attention.q_norm, attention.k_norm, attention.sink) if norm is not None}
    for module in _unsplit_subtrees(model):
        # --qk-layernorm's norms and the attention sinks see only this rank's heads: their gradients are summed over
        # the ranks.
        parallelize_module(module, tp_mesh, ReplicatedParameters(sum_gradients=id(module) in per_head_norms))
    _fork_rng_where_sharded(model, tp_mesh, sequence_parallel)


def check_tensor_parallel_shape(config, tp_size: int) -> None:
    """Each rank must own whole heads and whole key/value groups (the rules refuse these flags earlier)."""
    for what, count in (("--num-attention-heads", config.num_attention_heads),
                        ("--num-query-groups", config.query_groups)):
        if count % tp_size:
            raise ValueError(f"{what} {count} is not divisible by --tensor-model-parallel-size {tp_size}: each "
                             "tensor-parallel rank holds whole heads")


# ---- the splits ----


def _split_embedding(embedding: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    # Vocabulary rows split; each rank looks up its rows and the partial results are summed.
    embedding.word_embeddings = VocabParallelEmbedding(cast(nn.Embedding, embedding.word_embeddings), tp_mesh)
    if sequence_parallel:  # dropout ran on the replicated sum; from here on each rank keeps its slice
        parallelize_module(
            embedding,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
            ),
        )


class VocabParallelEmbedding(nn.Module):
    """Megatron's vocabulary-parallel embedding: the weight is a DTensor with its rows split over the
    tensor-parallel ranks (Shard(0), torch.chunk's split, as DTensor's RowwiseParallel splits it, so checkpoints
    and the tied head see the same tensor); each rank looks up the tokens whose rows it holds, zeroes the rest,
    and the ranks' partial lookups are summed. Its backward makes the gradient of the rank's rows only: DTensor's
    own embedding (RowwiseParallel) made the whole [vocabulary, h] gradient on every rank and sliced it after,
    (t - 1) / t of a vocabulary-sized tensor more at the end of backward (measured by the memory test)."""

    def __init__(self, embedding: nn.Embedding, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("tensor parallelism splits a plain nn.Embedding (no padding_idx, max_norm or sparse)")
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = nn.Parameter(distribute_tensor(embedding.weight, tp_mesh, [Shard(0)]),
                                   requires_grad=embedding.weight.requires_grad)  # frozen beside LoRA adapters
        self.group = tp_mesh.get_group()
        rows = -(-self.num_embeddings // tp_mesh.size())  # torch.chunk's: every rank but the last holds this many
        self.first_row = min(tp_mesh.get_local_rank() * rows, self.num_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = cast(DTensor, self.weight).to_local()  # its gradient comes back as the same Shard(0) DTensor
        local_ids = input_ids - self.first_row
        elsewhere = (local_ids < 0) | (local_ids >= weight.shape[0])
        partial = F.embedding(local_ids.masked_fill(elsewhere, 0), weight)
        return _SumOverRanks.apply(partial.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows split over {dist.get_world_size(self.group)} ranks"


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum of the ranks' partial lookups (an all-reduce, in place). Backward: the output's gradient
    as it is, since every rank holds the whole of it (Megatron's reduce-from-tensor-parallel region)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        ctx.mark_dirty(partial)
        dist.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _split_layer(layer: TransformerLayer, tp_mesh: DeviceMesh, residual, sequence_parallel: bool) -> None:
    # With sequence parallelism the residual stream is a DTensor sharded on the sequence (its global
    # shape keeps the sequence length that masks and rotary angles are made from).
    keep_dtensor = not sequence_parallel
    plan: dict[str, ParallelStyle] = {
        f"attention.{name}": ColwiseParallel() for name in _column_split_attention(layer.attention, tp_mesh)}
    plan["attention.o_proj"] = RowwiseParallel(output_layouts=residual, use_local_output=keep_dtensor)
    if isinstance(layer.mlp, MoELayer):  # routed experts are not split; each rank routes the full sequence
        if layer.mlp.shared_experts is not None:  # shared experts: a dense MLP, split as one (Megatron-Core)
            plan["mlp.shared_experts.fc1"] = ColwiseParallel()
            if layer.mlp.shared_experts.gate is not None:
                plan["mlp.shared_experts.gate"] = ColwiseParallel()
            plan["mlp.shared_experts.fc2"] = RowwiseParallel()
        if sequence_parallel:
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=False,
            )
    else:
        plan["mlp.fc1"] = ColwiseParallel()
        if layer.mlp.gate is not None:  # SwiGLU: the gate's columns pair with fc1's on each rank
            plan["mlp.gate"] = ColwiseParallel()
        plan["mlp.fc2"] = RowwiseParallel(output_layouts=residual, use_local_output=keep_dtensor)
        if sequence_parallel:
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
    if sequence_parallel:
        plan["ln1"] = SequenceParallel()
        plan["ln2"] = SequenceParallel()
        plan["attention"] = PrepareModuleInput(  # (x, mask, rope, KV cache)
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        )
    adapters = _detach_adapters(layer, plan)
    parallelize_module(layer, tp_mesh, plan)
    _attach_split_adapters(layer, adapters, tp_mesh)


def _detach_adapters(layer: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, tuple[nn.Module, bool]]:
    """LoRA adapters (models/lora.py) of the layers the plan splits, taken off them while their layer is split
    (a linear layer's style splits every parameter under it): {layer path: (adapter, split by columns)}."""
    adapters = {}
    for path, style in plan.items():
        if not isinstance(style, ColwiseParallel | RowwiseParallel):
            continue
        linear = layer.get_submodule(path)
        adapter = linear._modules.pop("lora", None)
        if adapter is not None:
            adapters[path] = (adapter, isinstance(style, ColwiseParallel))
    return adapters


def _attach_split_adapters(layer: nn.Module, adapters: dict[str, tuple[nn.Module, bool]], tp_mesh: DeviceMesh) -> None:
    """Each adapter split with its layer: beside a column-split layer A whole and B's rows (the layer's output
    columns) split, so B A x comes out split as the layer's output; beside a row-split layer A's columns (the
    layer's input, split) split and B whole, so B A x comes out as a partial sum that the layer's own reduction
    adds up with its output. The layer's forward computes both on DTensors."""
    for path, (adapter, by_columns) in adapters.items():
        placements = {"lora_a": Replicate() if by_columns else Shard(1),
                      "lora_b": Shard(0) if by_columns else Replicate()}
        for name, placement in placements.items():
            linear = cast(nn.Linear, getattr(adapter, name))
            weight = linear.weight
            linear.weight = nn.Parameter(distribute_tensor(weight.detach(), tp_mesh, [placement]),
                                         requires_grad=weight.requires_grad)
        layer.get_submodule(path)._modules["lora"] = adapter


def _column_split_attention(attention: nn.Module, tp_mesh: DeviceMesh) -> list[str]:
    """The attention's projections split by heads. Multi-head latent attention's: the per-head up-projections; its
    rotary key, one for all heads, is used by each rank's heads, so its gradient is summed over the ranks."""
    if not isinstance(attention, MultiLatentAttention):
        return ["q_proj", "k_proj", "v_proj"]
    attention.shared_key_gradient = SumGradientOverRanks(tp_mesh.get_group())
    return ["q_proj" if attention.q_proj is not None else "q_up_proj", "kv_up_proj"]


class SumGradientOverRanks(nn.Module):
    """Identity forward, the gradient summed over the tensor-parallel ranks backward (Megatron's
    copy-to-tensor-model-parallel-region), for a replicated tensor that each rank's heads use in part."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return _SumGradient.apply(tensor, self.group)


def _split_head(model: nn.Module, tp_mesh: DeviceMesh, residual, sequence_parallel: bool) -> None:
    """Final norm and the vocabulary head; logits stay DTensors sharded on the vocabulary."""
    logits = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "final_norm", None) is not None and sequence_parallel:
        plan["final_norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:  # GPT
        plan["output"] = logits
    if getattr(model, "lm_head", None) is not None:  # BERT: dense + norm on full rows, then the decoder
        plan["lm_head.output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        if sequence_parallel:
            plan["lm_head"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
    if getattr(model, "pooler", None) is not None and sequence_parallel:
        plan["pooler"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    if plan:
        parallelize_module(model, tp_mesh, plan)


def _tie_output_to_embedding(model: nn.Module) -> None:
    """Point a tied head at the split embedding weight again (both are Shard(0) over the vocabulary).

    A pipeline stage without the embedding keeps its own split copy (the pipeline keeps it in sync).
    """
    for module in model.modules():
        if isinstance(module, OutputLayer) and module.tied_to is not None:
            try:
                module.weight = model.get_parameter(module.tied_to)
            except AttributeError:
                pass


def _unsplit_subtrees(model: nn.Module) -> Iterator[nn.Module]:
    """The largest subtrees whose parameters are all still plain tensors (norms, position embeddings,
    BERT's head dense/pooler, MoE layers); a module mixing both kinds yields its plain leaves."""

    def plain(module: nn.Module) -> list[nn.Parameter]:
        return [p for p in module.parameters() if not isinstance(p, DTensor)]

    def visit(module: nn.Module) -> Iterator[nn.Module]:
        params = list(module.parameters())
        if params and len(plain(module)) == len(params):
            yield module
            return
        if isinstance(module, MoELayer):  # split shared experts: the router and experts replicated as one, since
            yield module  # the layer reads their weights outside their own forwards (ReplicatedParameters: plain only)
            return
        for child in module.children():
            yield from visit(child)
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            raise ValueError(
                f"{type(module).__name__} holds plain parameters beside split children; "
                "tensor parallelism cannot replicate them"
            )

    return visit(model)


# ---- styles ----


class ReplicatedParameters(ParallelStyle):
    """Parameters become replicated DTensors; the module computes on their local (full) values.

    The module sees plain tensors, so any module (an MoE layer, a norm) runs unchanged on replicated
    inputs; gradients flow back into the DTensor parameters and agree across ranks, because the
    inputs and the gradients arriving from split neighbours (all-reduced) agree. A module applied to this rank's
    own heads (--qk-layernorm's q/k norms) gets only their share of the gradient: `sum_gradients` all-reduces it
    over the tensor-parallel ranks (Megatron's copy-to-model-parallel-region: identity forward, sum backward).
    """

    def __init__(self, sum_gradients: bool = False) -> None:
        super().__init__()
        self.sum_gradients = sum_gradients

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # The module's plain parameters; those already split (an MoE layer's shared experts) keep their own style.
        owners = [
            (owner, name) for owner in module.modules() for name, param in owner.named_parameters(recurse=False)
            if not isinstance(param, DTensor)
        ]
        for owner, name in owners:
            param = owner._parameters[name]
            assert param is not None  # named_parameters lists only parameters that are set
            if not isinstance(param, DTensor):
                value = distribute_tensor(
                    param.detach(), device_mesh, [Replicate()], src_data_rank=self.src_data_rank
                )
                owner.register_parameter(name, nn.Parameter(value, requires_grad=param.requires_grad))
        saved: list[list[Any]] = []  # Parameters, or the local views forward puts in their place

        def localize(_module: nn.Module, _args: tuple) -> None:
            # Direct dict access: the local view is not a Parameter (it must stay in the autograd graph).
            saved.append([owner._parameters[name] for owner, name in owners])
            for owner, name in owners:
                param = owner._parameters[name]
                if isinstance(param, DTensor):
                    local = param.to_local()
                    if self.sum_gradients:
                        local = _SumGradient.apply(local, device_mesh.get_group())
                    owner._parameters[name] = local

        def restore(_module: nn.Module, _args: tuple, _output: object) -> None:
            for (owner, name), param in zip(owners, saved.pop(), strict=True):
                owner._parameters[name] = param

        module.register_forward_pre_hook(localize)
        module.register_forward_hook(restore, always_call=True)
        return module


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group`'s ranks."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class VocabParallelLoss(ParallelStyle):
    """The per-token cross-entropy on vocabulary-sharded logits (`loss_parallel`), returned as a plain
    [b, s] tensor so the loop can mask and sum it like the unsplit loss."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_local(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
            if isinstance(output, DTensor):
                return output.redistribute(placements=[Replicate()] * device_mesh.ndim).to_local()
            return output

        module.register_forward_hook(to_local)
        return module


_LOSS_PARALLEL = None


def _enable_loss_parallel() -> None:
    """Keep `loss_parallel` on for the process: it must also be on during backward, which the loop
    runs outside the model; it changes only cross-entropy on DTensors, i.e. this model's loss."""
    global _LOSS_PARALLEL
    if _LOSS_PARALLEL is None:
        _LOSS_PARALLEL = loss_parallel()
        _LOSS_PARALLEL.__enter__()


# ---- dropout RNG where a rank holds its own part ----


class ShardedDropoutRNG:
    """Forward hooks that run a module under a generator seeded per tensor-parallel rank.

    The seed is drawn from the shared stream (so ranks stay in lockstep, and recomputation under
    activation checkpointing, which restores the shared stream, redraws the same masks); the shared
    stream's state is restored after the module.
    """

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self.saved: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.enter)
        module.register_forward_hook(self.leave, always_call=True)

    def enter(self, module: nn.Module, _args: tuple) -> None:
        if not module.training:
            return
        seed = int(torch.randint(0, 2**62, (1,)).item())
        cuda = (
            torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self.saved.append((torch.get_rng_state(), cuda))
        torch.manual_seed((seed + self.tp_rank * _RNG_SALT) % 2**63)

    def leave(self, module: nn.Module, _args: tuple, _output: object) -> None:
        if not module.training or not self.saved:
            return
        cpu, cuda = self.saved.pop()
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def _fork_rng_where_sharded(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    config = cast(ModelConfig, model.config)  # the built-in model's (nn.Module's __getattr__ types it Tensor | Module)
    fork = ShardedDropoutRNG(tp_mesh.get_local_rank())
    for module in model.modules():
        if isinstance(module, (Attention, MultiLatentAttention)) and config.attention_dropout > 0:
            fork.attach(module)
        elif sequence_parallel and isinstance(module, TransformerLayer) and config.hidden_dropout > 0:
            fork.attach(module.dropout)
