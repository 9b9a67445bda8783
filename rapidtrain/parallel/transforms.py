"""The model transforms every layout applies, in one fixed order: tensor parallel → activation
checkpointing → graph compilation. Written once; the plain, pipeline and DeepSpeed paths call
`apply_transforms` before their own data-parallel wrapping."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from torch import nn

if TYPE_CHECKING:
    from rapidtrain.config.settings import Plan, Switches
    from rapidtrain.parallel.mesh import ParallelMesh


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the built-in models' `layers`, or a Hugging Face model's largest ModuleList."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    candidates = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not candidates:
        return []
    return list(max(candidates, key=lambda m: _parameter_count(cast(nn.Module, m))))


def recompute_blocks(model: nn.Module) -> list[nn.Module]:
    """What --checkpoint-activations recomputes: the transformer blocks, else (a user's own model) the largest
    nn.Sequential of one repeated module class, else the instances of the model's own class it repeats most by
    parameters (a user's `Block` held as separate attributes); [] when nothing repeats."""
    blocks = transformer_blocks(model)
    if blocks:
        return blocks
    sequences = [m for m in model.modules() if isinstance(m, nn.Sequential) and len(m) > 1
                 and len({type(child) for child in m}) == 1 and _parameter_count(m) > 0]
    if sequences:
        return list(max(sequences, key=lambda m: _parameter_count(cast(nn.Module, m))))
    return repeated_module_type(model)


def repeated_module_type(model: nn.Module) -> list[nn.Module]:
    """The outermost instances of the model's own module class (torch.nn's building blocks aside) used at least
    twice, the class holding the most parameters chosen; [] when no such class repeats."""
    by_type: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        kind = type(module)
        if module is model or kind.__module__.startswith("torch.") or _parameter_count(module) == 0:
            continue
        by_type.setdefault(kind, []).append(module)
    repeated = {kind: found for kind, found in by_type.items() if len(found) > 1}
    if not repeated:
        return []
    kind = max(repeated, key=lambda k: sum(_parameter_count(m) for m in repeated[k]))
    inner = {id(sub) for block in repeated[kind] for sub in block.modules() if sub is not block}
    return [block for block in repeated[kind] if id(block) not in inner]


def _replace_blocks(model: nn.Module, wrap: Callable[[nn.Module], nn.Module], chosen: list[nn.Module]) -> None:
    blocks = set(map(id, chosen))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in blocks:
                if isinstance(parent, nn.ModuleDict):
                    parent.update({name: wrap(child)})
                else:
                    setattr(parent, name, wrap(child))


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every transformer block in backward (torch.utils.checkpoint, non-reentrant)."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is not None:  # Hugging Face models know their own blocks
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = recompute_blocks(model)
    if not blocks:  # accepted and doing nothing would be a silent switch
        from rapidtrain.core.errors import UserError

        raise UserError(f"--checkpoint-activations: {type(model).__name__} has no repeated blocks to recompute (no "
                        "nn.ModuleList or nn.Sequential of layers, and no module class of its own used twice). Hold "
                        "the model's layers in an nn.ModuleList (as `layers`), or drop --checkpoint-activations.")
    # The wrapper's prefix is stripped by torch.distributed.checkpoint, so checkpoints keep their names.
    _replace_blocks(model, checkpoint_wrapper, blocks)


def apply_compile(model: nn.Module, backend: str = "inductor", mode: str | None = None) -> None:
    """torch.compile each block in place (module.compile keeps parameter names for checkpoints), with the
    plan's backend and mode (--torch-compile-backend, --torch-compile-mode); the built-in loss's chunked blocks
    too, on CUDA (models/chunked_loss.py: on the CPU they stay eager, bit for bit the uncompiled run's)."""
    from rapidtrain.models.transformer import TokenCrossEntropy

    for module in model.modules():
        if isinstance(module, TokenCrossEntropy):
            module.compiled = (backend, mode)
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(backend=backend, mode=mode)
    if not blocks:
        model.compile(backend=backend, mode=mode)


def apply_graph_optimization(model: nn.Module, switches: Switches) -> nn.Module:
    """--torch-compile and --onnx-runtime-training. ONNX Runtime's ORTModule serves --onnx-runtime-training only
    when an installed onnxruntime-training imports with this torch (its last release, 1.19.2, does not with torch
    2.13); otherwise torch.compile serves it, with the backend and mode of --torch-compile-backend /
    --torch-compile-mode, and the plan says which and why."""
    if switches.compile == "ortmodule":
        from onnxruntime.training.ortmodule import ORTModule

        return ORTModule(model)
    apply_compile(model, backend=switches.compile_backend, mode=switches.compile_mode)
    return model


def apply_transforms(model: nn.Module, plan: Plan, mesh: ParallelMesh) -> nn.Module:
    """(Context parallel →) tensor parallel → activation checkpointing → compile, as the plan says; returns the
    model to wrap. Context parallelism replaces the attention cores first, so every later transform (and the
    recomputation of a checkpointed layer) runs the exchange."""
    layout, switches = plan.layout, plan.switches
    if layout.context_parallel_size > 1:
        from rapidtrain.parallel.context_parallel import apply_to_plan

        apply_to_plan(model, plan, mesh)
    if layout.tensor_parallel_size > 1:
        from rapidtrain.parallel.tensor_parallel import apply_tensor_parallel

        tp_mesh = mesh.submesh("tp")
        assert tp_mesh is not None  # a tensor-parallel layout has the tp dimension
        apply_tensor_parallel(model, tp_mesh, sequence_parallel=layout.sequence_parallel)
    recompute = switches.recompute
    if recompute.offload_layers:
        from rapidtrain.parallel.recompute import apply_activation_offload

        apply_activation_offload(model, recompute_blocks(model)[:recompute.offload_layers])
    if recompute.moe_layers_recomputed:  # inside each layer first: a layer's wrapper then holds the wrapped MoE
        from rapidtrain.parallel.recompute import apply_moe_recompute

        apply_moe_recompute(model)
    if recompute.granularity == "full" and recompute.method == "uniform":
        apply_activation_checkpointing(model)
    elif recompute.enabled:
        from rapidtrain.parallel.recompute import apply_recompute

        apply_recompute(model, recompute_blocks(model), recompute)
    if switches.compile != "none":
        model = apply_graph_optimization(model, switches)
    return model
