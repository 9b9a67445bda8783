"""The optimizer behind `--optimizers` / `--optimizer`: apex's fused kernels where they fit, else torch's;
8-bit and 4-bit AdamW from bitsandbytes or torchao, whichever takes the layout's parameters.

`describe_optimizer` and `build_optimizer` share one resolution (`resolve_optimizer`), so the plan prints
exactly what runs, and the plan's memory estimate counts the state that implementation allocates.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rapidtrain.optim.param_names import STACKED_BIAS_SUFFIXES, WRAPPER_NAMES  # noqa: F401 (names read from here)
from rapidtrain.optim.state_bytes import StateKind

if TYPE_CHECKING:  # torch is imported where an optimizer is built: the plan resolves one without it
    import torch
    from torch import nn

    ParamsLike = nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]]
    Factory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]

OptimizerName = Literal[
    "apex_adam", "apex_lamb", "adamw", "adam", "adafactor", "sgd", "adamw_8bit", "paged_adamw_8bit", "adamw_4bit",
    "muon",
]
OPTIMIZER_NAMES: tuple[str, ...] = (
    "apex_adam", "apex_lamb", "adamw", "adam", "adafactor", "sgd", "adamw_8bit", "paged_adamw_8bit", "adamw_4bit",
    "muon",
)
LOW_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "adamw_4bit")


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer's own part of the plan (flags `--optimizers`, `--lr`, `--weight-decay`, ...).

    `dtensor_parameters` says whether the layout hands the optimizer DTensors (tensor parallelism, FSDP2,
    composable replicate) or plain tensors (one process, DDP, ZeroRedundancyOptimizer, DeepSpeed): apex's
    and bitsandbytes' kernels take plain tensors only, so the plan decides the implementation from it.
    """

    name: OptimizerName = "apex_adam"
    lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    dtensor_parameters: bool = False
    # Megatron-Core's --decoupled-lr / --decoupled-min-lr: the word embedding and the output layer follow the same
    # schedule from their own peak to their own floor (None: they share --lr / --min-lr).
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    # --optimizer muon (Megatron-Core's --muon-* flags; optim/muon.py): the layers' matrices' momentum, Nesterov,
    # Newton–Schulz steps and update scale.
    muon_momentum: float = 0.9
    muon_nesterov: bool = False
    muon_ns_steps: int = 5
    muon_scale_mode: str = "spectral"
    muon_extra_scale_factor: float = 1.0

    @property
    def decoupled(self) -> tuple[float, float] | None:
        """(peak, floor) of the embedding and output layer's rate, or None when they have no rate of their own."""
        if self.decoupled_lr is None:
            return None
        return self.decoupled_lr, self.decoupled_min_lr if self.decoupled_min_lr is not None else 0.0


# The built-in models' word embedding and output layers (GPT's head, BERT's masked-LM decoder; a pipeline stage's
# copy of a tied embedding is its `output.weight`): Megatron-Core's `is_embedding_or_output_parameter`.
EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output.weight", "lm_head.output.weight")


def is_embedding_or_output(name: str) -> bool:
    """Whether `name` (as a wrapped model lists it) is the input embedding or output layer weight."""
    bare = ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)
    return bare in EMBEDDING_OR_OUTPUT


def param_groups(model: nn.Module, weight_decay: float,
                 decoupled: tuple[float, float] | None = None) -> list[dict[str, Any]]:
    """Megatron's grouping: biases and 1-D parameters (norms) get no weight decay.

    Parameters keep the model's `named_parameters()` order (tied weights once); frozen ones are
    left out; empty groups are dropped. With `decoupled` (peak, floor), the word embedding and the
    output layer form groups of their own whose `max_lr` / `min_lr` the schedule follows instead of
    its own (Megatron-Core's --decoupled-lr).
    """
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        no_decay = param.ndim <= 1 or name.endswith(".bias") or name.endswith(STACKED_BIAS_SUFFIXES)
        own_rate = decoupled is not None and is_embedding_or_output(name)
        groups.setdefault((own_rate, no_decay), []).append(param)
    ordered = []
    for own_rate, no_decay in ((False, False), (False, True), (True, False), (True, True)):
        if groups.get((own_rate, no_decay)):
            group: dict[str, Any] = {"params": groups[(own_rate, no_decay)],
                                     "weight_decay": 0.0 if no_decay else weight_decay}
            if own_rate:
                assert decoupled is not None
                group["max_lr"], group["min_lr"] = decoupled
            ordered.append(group)
    return ordered


@functools.cache
def apex_optimizer_class(class_name: str) -> type | None:
    """`apex.optimizers.<class_name>` when NVIDIA apex with its CUDA extension imports, else None.

    A PyPI package also called `apex` is unrelated, so only the class itself and apex's compiled
    `amp_C` extension (without which the fused optimizers refuse to build) count as apex.
    """
    try:
        if importlib.util.find_spec("apex") is None or importlib.util.find_spec("amp_C") is None:
            return None
        module = importlib.import_module("apex.optimizers")
        found = getattr(module, class_name, None)
        return found if isinstance(found, type) else None
    except Exception:  # a broken or foreign `apex` must not stop training: fall back to torch
        return None


# Optimizers DeepSpeed builds from its config for ZeRO-Offload (DeepSpeedCPUAdam); the rules refuse others.
OFFLOAD_OPTIMIZERS = {"apex_adam": ("AdamW", True), "adamw": ("AdamW", True), "adam": ("Adam", False)}


def describe_offload_optimizer(settings: OptimizerSettings) -> str:
    """In words, for the plan: the optimizer DeepSpeed builds under --cpu-offload."""
    if settings.name not in OFFLOAD_OPTIMIZERS:
        return f"none: --cpu-offload cannot run {settings.name} (DeepSpeedCPUAdam implements Adam and AdamW)"
    kind, decoupled = OFFLOAD_OPTIMIZERS[settings.name]
    return (
        f"DeepSpeedCPUAdam ({kind}, {'decoupled' if decoupled else 'L2'} weight decay) on the CPU, built by "
        "DeepSpeed from the flags"
    )


def describe_optimizer(settings: OptimizerSettings, device_type: str) -> str:
    """In words, which implementation serves `settings.name` on `device_type` (for the plan)."""
    return resolve_optimizer(settings, device_type).description


def optimizer_param_groups(model: nn.Module, settings: OptimizerSettings) -> list[dict[str, Any]]:
    """`param_groups` for the settings' optimizer: under Muon, its matrices in groups of their own (`use_muon`)."""
    groups = param_groups(model, settings.weight_decay, settings.decoupled)
    if settings.name != "muon":
        return groups
    from rapidtrain.optim.muon import split_for_muon

    return split_for_muon(model, groups, settings.weight_decay, settings.muon_scale_mode,
                          settings.muon_extra_scale_factor)


def build_optimizer(
    model_or_params: ParamsLike, settings: OptimizerSettings, device_type: str
) -> tuple[torch.optim.Optimizer, str]:
    """Build the optimizer; returns it with the words `describe_optimizer` gives for it.

    A module is grouped by `optimizer_param_groups`; a list of tensors becomes one group with the
    settings' weight decay; a list of group dicts is used as given (weight decay filled in where
    a group lacks it).
    """
    groups = _as_param_groups(model_or_params, settings)
    resolution = resolve_optimizer(settings, device_type)
    return resolution.factory(groups), resolution.description


def _as_param_groups(model_or_params: ParamsLike, settings: OptimizerSettings) -> list[dict[str, Any]]:
    from torch import nn

    weight_decay = settings.weight_decay
    if isinstance(model_or_params, nn.Module):
        groups = optimizer_param_groups(model_or_params, settings)
    else:
        items: list[Any] = list(model_or_params)  # tensors or param-group dicts, told apart below
        if items and all(isinstance(item, dict) for item in items):
            groups = [{"weight_decay": weight_decay, **item} for item in items]
        else:
            groups = [{"params": [p for p in items if p.requires_grad], "weight_decay": weight_decay}]
    if not any(list(group["params"]) for group in groups):
        raise ValueError(
            "the optimizer got no trainable parameters: every parameter has requires_grad=False "
            "(check the model's freezing / PEFT settings)"
        )
    return groups


# Devices where torch's Adam/AdamW `fused=True` kernels exist (torch ≥ 2.4 has them on CPU).
FUSED_DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class Resolution:
    """What serves an optimizer name: how to build it, the plan's words, and the state it keeps."""

    factory: Factory
    description: str
    state: StateKind
    fused_adam: bool = False  # torch's fused Adam/AdamW: what optim/flat_buffers.py can step on flat buffers


# Measured with torch 2.13 (foreach, the path rapidtrain builds) under TP 2, FSDP and SDP on 2 ranks: the first step
# raises "in-place operations that require placement changes are not supported ... _NormPartial". The single-tensor
# path squares the norms in place too (read, not run).
ADAFACTOR_ON_DTENSORS = (
    "torch's Adafactor factors its second moment with in-place operations on each gradient's row and column norms, "
    "which DTensor cannot keep sharded, and this layout's parameters are DTensors (tensor parallelism, "
    "--fsdp-memory-optimization, --oss-sdp-memory-optimization, ZeRO under tensor parallelism): its first step "
    "would fail. Use --optimizer adamw with this layout, or Adafactor with DDP, --oss-memory-optimization, or "
    "pipeline or expert parallelism alone")


class OptimizerUnavailable(ValueError):
    """The chosen optimizer has no implementation for this layout and device; the message says why."""


def resolve_optimizer(settings: OptimizerSettings, device_type: str) -> Resolution:
    """The one place that decides the implementation: used by the plan, the memory estimate and the build."""
    s = settings
    if s.name not in OPTIMIZER_NAMES:
        raise ValueError(f"--optimizers {s.name!r} is not known; choose one of {', '.join(OPTIMIZER_NAMES)}")
    if s.name in ("apex_adam", "apex_lamb"):
        return _resolve_apex(s, device_type)
    if s.name in LOW_BIT_OPTIMIZERS:
        return _resolve_low_bit(s, device_type)
    if s.name == "muon":
        return _resolve_muon(s, device_type)
    adam = {"betas": (s.adam_beta1, s.adam_beta2), "eps": s.adam_eps}
    if s.name == "adamw":
        return _torch_optimizer("AdamW", s.lr, device_type, adam, state="adam")
    if s.name == "adam":
        return _torch_optimizer(
            "Adam", s.lr, device_type, adam, state="adam", note=" (L2 weight decay; adamw decouples it)"
        )
    if s.name == "sgd":
        return _torch_optimizer(
            "SGD",
            s.lr,
            device_type,
            {"momentum": s.sgd_momentum},
            state="sgd_momentum" if s.sgd_momentum else "none",
            shown=f"momentum={s.sgd_momentum}, ",
            # DTensor (tensor/fully sharded parameters) has no sharding rule for the fused SGD kernel.
            has_fused_kernel=False,
        )
    if s.dtensor_parameters:  # the rule adafactor-plain-tensors refuses this before a run; a safety net
        raise OptimizerUnavailable(f"--optimizer adafactor: {ADAFACTOR_ON_DTENSORS}")
    # torch's Adafactor has no fused kernel; foreach is its fast path on every device.
    return _torch_optimizer(
        "Adafactor", s.lr, device_type, {}, state="adafactor", has_fused_kernel=False, note=ADAFACTOR_LR_MEANING
    )


# What --lr means to torch's Adafactor, said in the plan and --help: users coming from Hugging Face Trainer (whose
# Adafactor runs with scale_parameter=False, relative_step=False) would otherwise take ~1/RMS smaller steps unawares.
ADAFACTOR_LR_MEANING = (
    ": each step moves a parameter by min(--lr, 1/sqrt(step)) x max(1e-3, the parameter's RMS) (torch's rule: --lr is "
    "relative to the weights' size), where Hugging Face Trainer's Adafactor (scale_parameter=False, "
    "relative_step=False) moves by --lr itself; at weights of RMS 0.02 the same --lr is a 50x smaller step here")


def _resolve_apex(s: OptimizerSettings, device_type: str) -> Resolution:
    """apex FusedAdam/FusedLAMB only where its kernels fit: apex imports, CUDA, plain-tensor parameters."""
    apex_class_name = "FusedAdam" if s.name == "apex_adam" else "FusedLAMB"
    apex_class = apex_optimizer_class(apex_class_name)
    betas = (s.adam_beta1, s.adam_beta2)
    if apex_class is not None and device_type == "cuda" and not s.dtensor_parameters:
        return Resolution(
            lambda groups: apex_class(groups, lr=s.lr, betas=betas, eps=s.adam_eps, weight_decay=s.weight_decay),
            f"apex {apex_class_name}",
            "adam",
        )
    if apex_class is None:
        why = "apex not installed"
    elif device_type != "cuda":
        why = f"apex {apex_class_name} needs CUDA"
    else:
        why = (f"apex {apex_class_name}'s multi-tensor kernels take plain tensors, and this layout's parameters "
               "are DTensors (tensor parallel / FSDP2 / replicate)")
    if s.name == "apex_adam":
        # FusedAdam's default adam_w_mode=True is decoupled weight decay: torch's AdamW.
        adam = {"betas": betas, "eps": s.adam_eps}
        return _torch_optimizer("AdamW", s.lr, device_type, adam, state="adam", note=f" ({why})")

    def lamb(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        from rapidtrain.optim.lamb import LAMB

        return LAMB(groups, lr=s.lr, betas=betas, eps=s.adam_eps, weight_decay=s.weight_decay)

    return Resolution(
        lamb,
        f"rapidtrain LAMB with apex FusedLAMB's update rule ({why})",
        "adam",
    )


def _resolve_muon(s: OptimizerSettings, device_type: str) -> Resolution:
    """torch.optim.Muon for the layers' matrices, torch's AdamW (fused where it has kernels) for the rest."""
    from rapidtrain.optim.muon import build_muon_with_adamw

    fused = device_type in FUSED_DEVICES
    muon = {"lr": s.lr, "momentum": s.muon_momentum, "nesterov": s.muon_nesterov, "ns_steps": s.muon_ns_steps,
            "adjust_lr_fn": "original"}
    adamw = {"lr": s.lr, "betas": (s.adam_beta1, s.adam_beta2), "eps": s.adam_eps,
             **({"fused": True} if fused else {"foreach": True})}
    description = (
        f"torch.optim.Muon(momentum={s.muon_momentum}, nesterov={s.muon_nesterov}, ns_steps={s.muon_ns_steps}, "
        f"quintic Newton–Schulz in bfloat16; update × {s.muon_scale_mode} scale × {s.muon_extra_scale_factor:g}) "
        "for the transformer layers' 2-D weights and each MoE expert's matrix; torch.optim.AdamW("
        f"{'fused' if fused else 'foreach'}=True) for the embeddings, output head, norms and biases"
        + ("; each sharded matrix (DTensor) gathered whole for its step: three all-gathers of it per step (weight, "
           "gradient, momentum), the Newton–Schulz computed on every rank, each rank keeping its shard "
           "(Megatron's --muon-tp-mode duplicated)" if s.dtensor_parameters else ""))
    # "adam" bounds the state of any split (the plan's estimate counts Muon's momentum exactly: config/memory.py).
    return Resolution(lambda groups: build_muon_with_adamw(groups, muon, adamw), description, "adam")


# The first bitsandbytes release verified here to step its 8-bit optimizers and run its 4/8-bit layers on a CPU
# (0.50.2 is verified; older releases were CUDA-only for these).
BITSANDBYTES_CPU_VERSION = (0, 50)


def _version(package: str) -> tuple[int, ...] | None:
    """The installed version as numbers, or None when the package is not installed."""
    if importlib.util.find_spec(package) is None:
        return None
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def bitsandbytes_problem(device_type: str, dtensor_parameters: bool = False, kernels: str = "optimizer") -> str | None:
    """Why bitsandbytes' `kernels` (optimizer, or 4/8-bit layer) cannot serve here, or None when they can."""
    version = _version("bitsandbytes")
    if version is None:
        return "bitsandbytes is not installed (pip install bitsandbytes)"
    if dtensor_parameters:
        # Measured with 0.50.2: its 8-bit kernels refuse DTensors ("got mixed torch.Tensor and DTensor").
        return "bitsandbytes' kernels take plain tensors, and this layout's parameters are DTensors"
    if device_type == "cpu" and version < BITSANDBYTES_CPU_VERSION:
        return (f"bitsandbytes {'.'.join(map(str, version))} has no CPU {kernels} kernels "
                f"(≥ {'.'.join(map(str, BITSANDBYTES_CPU_VERSION))} has)")
    return None


def torchao_problem(name: str, dtensor_parameters: bool) -> str | None:
    """Why torchao's low-bit AdamW cannot serve `name` here, or None when it can."""
    if _version("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    if name == "paged_adamw_8bit":
        return "torchao has no paged optimizer"
    if name == "adamw_4bit" and dtensor_parameters:
        # Measured with torchao 0.18: AdamW4bit's step fails on FSDP2 and tensor-parallel DTensors.
        return "torchao's AdamW4bit fails on DTensor parameters (its 8-bit AdamW works with them)"
    return None


def low_bit_optimizer_problem(settings: OptimizerSettings, device_type: str) -> str | None:
    """Why no library serves the low-bit optimizer `settings.name` on this layout and device (None: one does)."""
    name = settings.name
    if name == "paged_adamw_8bit":
        if device_type != "cuda":
            return ("paging moves optimizer state between GPU and host memory through CUDA unified memory; "
                    f"on {device_type} there is nothing to page to (use --optimizer adamw_8bit)")
        problem = bitsandbytes_problem(device_type, settings.dtensor_parameters)
        return None if problem is None else f"only bitsandbytes has paged optimizers, and {problem}"
    if name == "adamw_4bit":
        return torchao_problem(name, settings.dtensor_parameters)
    bnb, ao = bitsandbytes_problem(device_type, settings.dtensor_parameters), torchao_problem(
        name, settings.dtensor_parameters)
    return None if bnb is None or ao is None else f"{bnb}; and {ao}"


def _resolve_low_bit(s: OptimizerSettings, device_type: str) -> Resolution:
    """bitsandbytes for plain tensors (its kernels are the reference 8-bit Adam), torchao for DTensors."""
    problem = low_bit_optimizer_problem(s, device_type)
    if problem is not None:
        raise OptimizerUnavailable(f"--optimizer {s.name}: {problem}")
    options = {"lr": s.lr, "betas": (s.adam_beta1, s.adam_beta2), "eps": s.adam_eps}
    if s.name in ("adamw_8bit", "paged_adamw_8bit") and bitsandbytes_problem(device_type, s.dtensor_parameters) is None:
        class_name = "PagedAdamW8bit" if s.name == "paged_adamw_8bit" else "AdamW8bit"

        def bitsandbytes_adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            import bitsandbytes

            return getattr(bitsandbytes.optim, class_name)(groups, **options)

        return Resolution(bitsandbytes_adamw, f"bitsandbytes {class_name} (block-wise 8-bit moments; tensors "
                          "under 4096 elements keep fp32 state)", "bitsandbytes_8bit")
    class_name = "AdamW4bit" if s.name == "adamw_4bit" else "AdamW8bit"

    def torchao_adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        import torchao.optim

        return getattr(torchao.optim, class_name)(groups, **options)

    why = ("bitsandbytes' kernels take plain tensors, and this layout's parameters are DTensors"
           if s.dtensor_parameters and s.name == "adamw_8bit" else "")
    bits = 4 if s.name == "adamw_4bit" else 8
    return Resolution(torchao_adamw, f"torchao {class_name} ({bits}-bit moments as tensor subclasses, each "
                      "parameter's step compiled by torch.compile)" + (f" ({why})" if why else ""),
                      "torchao_4bit" if bits == 4 else "torchao_8bit")


def _torch_optimizer(
    kind: str,
    lr: float,
    device_type: str,
    options: dict[str, Any],
    state: StateKind,
    shown: str = "",
    note: str = "",
    has_fused_kernel: bool = True,
) -> Resolution:
    """A torch optimizer on its fastest path: torch's fused kernels on CUDA and CPU, foreach elsewhere (`kind`: its
    class's name in torch.optim, looked up when the optimizer is built).

    On CPU the fused AdamW step is ~6× faster than foreach (14M parameters: 6 ms against 37 ms on 2
    cores; foreach is even slower than the per-tensor loop there), which is most of what a plain
    foreach loop loses to Hugging Face Trainer's default `adamw_torch_fused`.
    """
    fused = has_fused_kernel and device_type in FUSED_DEVICES
    speed = {"fused": True} if fused else {"foreach": True}
    (speed_name,) = speed
    description = f"torch.optim.{kind}({shown}{speed_name}=True){note}"

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        import torch

        return getattr(torch.optim, kind)(groups, lr=lr, **options, **speed)

    return Resolution(make, description, state, fused_adam=fused and kind in ("Adam", "AdamW"))


FLAT_BUFFERS = ("; parameters, gradients and moments in flat buffers, one fused update per parameter group and one "
                "norm and multiply for clipping (optim/flat_buffers.py)")


def runs_on_flat_buffers(settings: OptimizerSettings, device_type: str, *, one_process: bool, builtin_dense_model: bool,
                         loss_scaling: bool, own_engine: bool) -> bool:
    """Whether the step runs on flat buffers (optim/flat_buffers.py): torch's fused Adam/AdamW built from the flags,
    in one process (`one_process`: no data, tensor, pipeline, context or expert parallelism) whose engine is torch's
    (`own_engine` False: DeepSpeed and FairScale keep theirs), on the built-in dense GPT or BERT (every weight gets a
    gradient every step, so a zeroed gradient steps as a missing one would), without loss scaling."""
    if not (one_process and builtin_dense_model and not loss_scaling and not own_engine):
        return False
    try:
        return resolve_optimizer(settings, device_type).fused_adam
    except ValueError:
        return False
