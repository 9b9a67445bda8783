"""Activation recomputation of transformer layers, at Megatron's granularities (full layers, the attention core)
and torchtitan's op level (keep the outputs of expensive ops, recompute the rest), plus the measurement of
the activation bytes a forward pass leaves for backward."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from rapidtrain.models.attention import short_attention

if TYPE_CHECKING:
    from rapidtrain.config.settings import RecomputeSettings

# ---- op-level policy ----

def _ops(*names: str) -> set:
    """The aten overload packets among `names` that this torch build has (kernel sets differ by version)."""
    found = set()
    for name in names:
        namespace, _, op = name.rpartition(".")
        packet = getattr(getattr(torch.ops, namespace or "aten"), op, None)
        if packet is not None:
            found.add(packet)
    return found


# Outputs worth keeping: expensive to recompute (matmuls, attention kernels) or not recomputable without another
# round of communication (collectives). Everything else is cheap and memory-bound, so it is recomputed.
KEPT_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "linear",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
    "_c10d_functional.all_reduce", "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_gather_into_tensor", "_c10d_functional.all_to_all_single",
)


def _dropout_probability(op, args, kwargs) -> float:
    """An attention kernel's dropout_p (0 when it has none)."""
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" in kwargs:
        return float(kwargs["dropout_p"])
    index = names.index("dropout_p") if "dropout_p" in names else len(args)
    return float(args[index]) if index < len(args) else 0.0


def keep_expensive_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The op-level policy. Every op that draws random numbers is recomputed, attention kernels with dropout
    included: replayed in order from the RNG state checkpoint saved, they draw the same masks (a kept random op
    would be skipped in the replay and shift the draws of the ones after it)."""
    if op.overloadpacket not in KEPT_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if torch.Tag.nondeterministic_seeded in op.tags and _dropout_probability(op, args, kwargs) > 0:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def op_level_contexts():
    return create_selective_checkpoint_contexts(keep_expensive_outputs)


# ---- selective (attention core) ----

# The attention-core calls selective recompute runs under checkpoint: torch's SDPA, rapidtrain's short-sequence
# kernel (which a torch-function mode sees as it sees SDPA), FlexAttention.
ATTENTION_CORES: tuple[Callable, ...] = (torch.nn.functional.scaled_dot_product_attention, short_attention)
try:
    from torch.nn.attention.flex_attention import flex_attention

    ATTENTION_CORES += (flex_attention,)
except ImportError:  # an older torch without FlexAttention
    pass


class _RecomputeAttentionCore(TorchFunctionMode):
    """Inside a layer's forward, runs each attention-core call under torch.utils.checkpoint: its inputs (q, k,
    v, mask) stay saved, its outputs and internals are recomputed in backward. Intercepting the function, not
    editing the attention module, serves the built-in models and Hugging Face's sdpa/flex attention alike."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ATTENTION_CORES and torch.is_grad_enabled():
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


class SelectiveRecompute(ActivationWrapper):
    """Wraps one layer; its attention core is recomputed in backward. As torch's checkpoint_wrapper (the same base
    class), the wrapped layer sits under `_checkpoint_wrapped_module`, a prefix its state dict, parameter names and
    attribute lookups leave out, so checkpoints keep the plain layer's keys (get_state_dict walks `layer.ln1`)."""

    def forward(self, *args, **kwargs):
        with _RecomputeAttentionCore():
            return self._checkpoint_wrapped_module(*args, **kwargs)


# ---- applying ----

def wrapper_for(settings: RecomputeSettings) -> Callable[[nn.Module], nn.Module]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if settings.granularity == "selective":
        return SelectiveRecompute
    if settings.granularity == "op":
        return partial(checkpoint_wrapper, context_fn=op_level_contexts)
    return checkpoint_wrapper


def _wrap_children(model: nn.Module, chosen: Callable[[nn.Module, str, nn.Module], bool],
                   wrap: Callable[[nn.Module], nn.Module]) -> int:
    """Replace each child of `model`'s modules for which `chosen(parent, name, child)` by `wrap(child)`."""
    wrapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if chosen(parent, name, child):
                if isinstance(parent, nn.ModuleDict):
                    parent.update({name: wrap(child)})
                else:
                    setattr(parent, name, wrap(child))
                wrapped += 1
    return wrapped


def apply_recompute_modules(model: nn.Module, modules: tuple[str, ...]) -> int:
    """Megatron-Core's --recompute-modules other than core_attn, in the built-in models: each named part of every
    layer under torch's checkpoint_wrapper (its input kept, its output and internals recomputed in backward);
    moe_act recomputes the experts' activation between their two projections. mla_up_proj wraps nothing: a linear
    layer keeps only its input, which its weight's gradient needs anyway, and the up projections' outputs are what
    the attention core keeps (measured: the same bytes kept with and without it). Returns how many parts."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from rapidtrain.models.mlp import MLP
    from rapidtrain.models.moe import Experts, MoELayer
    from rapidtrain.models.transformer import TransformerLayer

    def chosen(parent: nn.Module, name: str, child: nn.Module) -> bool:
        if isinstance(parent, TransformerLayer):
            return (("layernorm" in modules and name in ("ln1", "ln2"))
                    or ("mlp" in modules and name == "mlp" and isinstance(child, MLP)))
        if isinstance(parent, MoELayer):
            return "shared_experts" in modules and "moe" not in modules and name == "shared_experts" \
                and child is not None
        return False  # mla_up_proj: nothing to recompute in the built-in MLA (the plan says why)

    wrapped = _wrap_children(model, chosen, checkpoint_wrapper)
    if "moe" in modules:
        wrapped += apply_moe_recompute(model)
    elif "moe_act" in modules:
        for module in model.modules():
            if isinstance(module, Experts):
                module.recompute_activation = True
                wrapped += 1
    return wrapped


def apply_recompute(model: nn.Module, blocks: list[nn.Module], settings: RecomputeSettings) -> int:
    """Replace the chosen `blocks` of `model` (in place) by their recomputing wrappers; returns how many. Under
    selective recompute, --recompute-modules other than core_attn wrap those parts of every layer first, and the
    layers take the attention core's wrapper only where core_attn is among them."""
    if settings.granularity == "selective" and settings.modules != ("core_attn",):
        parts = apply_recompute_modules(model, tuple(m for m in settings.modules if m != "core_attn"))
        if "core_attn" not in settings.modules:
            return parts
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if settings.granularity == "selective" and attention not in (None, "sdpa", "flex_attention"):
        from rapidtrain.core.errors import UserError

        # An eager attention computes the scores itself: there is no attention-core call to recompute.
        raise UserError(f"--recompute-granularity selective recomputes scaled_dot_product_attention / flex_attention "
                        f"calls, and this model's attention is {attention!r}: load it with sdpa attention, or use "
                        "--recompute-granularity op or full.")
    chosen = {id(blocks[i]) for i in settings.layers_of(len(blocks))}
    return _wrap_children(model, lambda parent, name, child: id(child) in chosen, wrapper_for(settings))


class OffloadActivations(ActivationWrapper):
    """Wraps one layer; the tensors its forward saves for backward go to host memory (pinned on CUDA) and come back
    when backward needs them (--cpu-offloading). The same base class as checkpoint_wrapper: state-dict keys and
    attribute lookups stay the plain layer's."""

    def forward(self, *args, **kwargs):
        pin = torch.cuda.is_available() and any(p.is_cuda for p in self._checkpoint_wrapped_module.parameters())
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return self._checkpoint_wrapped_module(*args, **kwargs)


def apply_activation_offload(model: nn.Module, blocks: list[nn.Module]) -> int:
    """Replace `blocks` of `model` (in place) by OffloadActivations wrappers; returns how many."""
    chosen = {id(block) for block in blocks}
    return _wrap_children(model, lambda parent, name, child: id(child) in chosen, OffloadActivations)


def apply_moe_recompute(model: nn.Module) -> int:
    """--moe-layer-recompute: every MoE layer of `model` (in place) under torch's checkpoint_wrapper, so backward
    recomputes routing, dispatch (its all-to-all under expert parallelism), experts and combine from the layer's
    input; the routing statistics are not counted twice (models/moe.py skips them while recomputing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from rapidtrain.models.moe import MoELayer

    # a MoE layer recomputed already (--moe-layer-recompute beside --recompute-modules moe) is not wrapped again
    return _wrap_children(model, lambda parent, name, child: isinstance(child, MoELayer)
                          and not isinstance(parent, ActivationWrapper), checkpoint_wrapper)


# ---- measuring ----

@contextmanager
def count_saved_activations(parameters: Iterator[torch.Tensor]) -> Iterator[dict]:
    """Counts the bytes of activation storage a forward pass leaves alive for backward, in `result["bytes"]`
    once the block ends (the graph must still be alive then: keep the loss).

    torch.autograd.graph.saved_tensors_hooks sees what autograd saves, but not what a checkpointed region keeps:
    inside one, checkpoint's own hooks replace the outer ones, and the region's inputs and op-level cache are
    held elsewhere. So every storage an op creates during the forward is recorded (weakly), and at the end the
    ones still alive, excluding parameters and the outputs themselves, are what the graph holds."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    param_storages = {StorageWeakRef(p.untyped_storage()) for p in parameters}
    created: dict[StorageWeakRef, int] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    ref = StorageWeakRef(t.untyped_storage())
                    if ref not in param_storages:
                        created.setdefault(ref, t.untyped_storage().nbytes())
            return out

    result: dict = {}
    with Record():
        yield result
    result["bytes"] = sum(n for ref, n in created.items() if not ref.expired())
    result["storages"] = sum(1 for ref in created if not ref.expired())
