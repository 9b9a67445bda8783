"""LoRA adapters (peft) and k-bit loading of the frozen base (bitsandbytes, QLoRA) for the black-box fine-tuning, and
rapidtrain's own adapters on the built-in GPT/Llama/MoE models (`add_builtin_lora`), which tensor, pipeline and data
parallelism split and wrap as they do the layers beside them (parallel/tensor_parallel.py), and which are folded into
the weights when a checkpoint is read whole (`merge_adapters`).

`LoraSettings` is the plan's part (flags `--lora-rank`, `--lora-alpha`, `--lora-dropout`, `--lora-target-modules`,
`--load-in-4bit`, `--load-in-8bit`); `quantization_config` and `add_lora` do what it says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

# QLoRA's recipe (Dettmers et al., 2023): 4-bit NormalFloat weights, their scales quantised again.
QUANT_TYPE_4BIT = "nf4"


@dataclass(frozen=True)
class LoraSettings:
    """Adapters of rank `rank` (0: full fine-tuning) scaled by alpha / rank, on `target_modules` (empty: peft's
    default for the architecture, else every linear layer), with dropout on their input; `load_in_bits` 4 or 8
    loads the frozen base quantised by bitsandbytes (None: the base stays fp32)."""

    rank: int = 0
    alpha: float | None = None  # None: 2 × rank
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    load_in_bits: Literal[4, 8] | None = None
    builtin: bool = False  # rapidtrain's adapters on the built-in model, not peft's on a Hugging Face one

    @property
    def scaling_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    def describe(self) -> str:
        """In words, for the plan."""
        if self.builtin:
            targets = ", ".join(self.target_modules) if self.target_modules and self.target_modules != (
                "all-linear",) else "linear layers of attention and the MLPs"
            return (f"LoRA r={self.rank}, alpha={self.scaling_alpha:g} (scale {self.scaling_alpha / self.rank:g}), "
                    f"dropout={self.dropout:g} on the built-in model's {targets}: A [r, in] from the base's init, "
                    "B [out, r] zero; everything else frozen; split with its layer under tensor parallelism; folded "
                    "into the weights when a checkpoint is exported")
        targets = ", ".join(self.target_modules) if self.target_modules else (
            "peft's default modules for the architecture (every linear layer where peft has none)")
        text = (f"peft LoRA r={self.rank}, alpha={self.scaling_alpha:g} (scale {self.scaling_alpha / self.rank:g}), "
                f"dropout={self.dropout:g} on {targets}; base weights frozen, adapters and the task head train")
        return text


def describe_quantization(bits: int, compute_dtype: str) -> str:
    """The k-bit base in words, for the plan."""
    if bits == 4:
        return (f"bitsandbytes 4-bit {QUANT_TYPE_4BIT.upper()} base weights with double quantisation, computed in "
                f"{compute_dtype} (transformers BitsAndBytesConfig), prepared by peft's "
                "prepare_model_for_kbit_training: QLoRA")
    return ("bitsandbytes LLM.int8() 8-bit base weights (transformers BitsAndBytesConfig), prepared by peft's "
            "prepare_model_for_kbit_training")


def quantization_config(bits: int, compute_dtype: torch.dtype) -> Any:
    """transformers' BitsAndBytesConfig for a 4-bit (NF4, double quantisation) or 8-bit base."""
    from transformers import BitsAndBytesConfig

    if bits == 4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=QUANT_TYPE_4BIT,
                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def keep_new_layers_unquantised(model: nn.Module) -> list[str]:
    """Layers the checkpoint does not hold (a new pooler, say) are initialised by transformers after loading, as
    plain fp32 weights inside bitsandbytes' modules, which cannot run them: there is no pretrained weight to
    quantise, so they become ordinary `nn.Linear` layers again. Returns their names."""
    import bitsandbytes as bnb

    restored = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            quantised = isinstance(child, bnb.nn.Linear4bit | bnb.nn.Linear8bitLt)
            if quantised and type(child.weight) in (nn.Parameter, torch.Tensor):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device=child.weight.device, dtype=child.weight.dtype)
                linear.weight = nn.Parameter(child.weight.data)
                if child.bias is not None:
                    linear.bias = nn.Parameter(child.bias.data)
                setattr(parent, name, linear)
                restored.append(f"{parent_name}.{name}".lstrip("."))
    return restored


def prepare_quantised(model: nn.Module) -> nn.Module:
    """peft's k-bit preparation: norms and other small weights in fp32, the base frozen. Gradient checkpointing is
    left to the plan's --checkpoint-activations (peft would otherwise turn it on by itself)."""
    from peft import prepare_model_for_kbit_training

    keep_new_layers_unquantised(model)
    keep_training_layout(model)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def keep_training_layout(model: nn.Module) -> None:
    """bitsandbytes (0.50) repacks a 4-bit layer's weight for its AVX512-BF16 inference kernel the first time the
    layer runs in eval mode on such a CPU, and does not undo it when training resumes: the next training step then
    fails inside matmul_4bit. Evaluation between epochs is part of fine-tuning, so the layers keep the layout they
    train with (evaluation runs the training kernel)."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def add_lora(model: nn.Module, settings: LoraSettings, task_type: str | None) -> nn.Module:
    """peft LoRA adapters as `settings` say; only adapters and the task head train."""
    from peft import LoraConfig, get_peft_model

    def config(targets: Any) -> LoraConfig:
        # peft annotates lora_alpha as int but only divides it by r, so a fractional alpha works.
        return LoraConfig(r=settings.rank, lora_alpha=settings.scaling_alpha,  # type: ignore[arg-type]
                          lora_dropout=settings.dropout,
                          task_type=task_type, target_modules=targets)

    if settings.target_modules:
        targets = list(settings.target_modules)
        try:
            return get_peft_model(model, config(targets[0] if targets == ["all-linear"] else targets))
        except ValueError as error:  # peft names the targets it did not find
            linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise SystemExit(
                f"rapidtrain: --lora-target-modules {' '.join(targets)}: {error}. This model's linear layers are "
                f"named {', '.join(linear)}; name some of them, or all-linear."
            ) from None
    try:
        return get_peft_model(model, config(None))
    except ValueError:  # no default target modules for this architecture
        return get_peft_model(model, config("all-linear"))


def _quantised_layers(model: nn.Module) -> dict[str, nn.Module]:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return {}
    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


def is_quantised(model: nn.Module) -> bool:
    """Whether the model has bitsandbytes 4/8-bit layers (a --load-in-4bit / --load-in-8bit base)."""
    return bool(_quantised_layers(model))


def dequantised_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with every 4/8-bit weight turned back into its fp32 matrix (what the quantised layer
    computes with), and the quantisation bookkeeping left out: what an exported full-precision model loads."""
    import bitsandbytes.functional as F

    layers = _quantised_layers(model)
    state = {}
    for name, value in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        # Any: bitsandbytes' layers and their Params4bit / Int8Params weights carry untyped attributes.
        layer: Any = layers.get(owner)
        if layer is None:
            state[name] = value.detach().float() if value.is_floating_point() else value
        elif leaf == "weight":
            weight = layer.weight
            if hasattr(weight, "quant_state"):
                matrix = F.dequantize_4bit(weight.data, weight.quant_state)
            else:
                # The row scales move from the weight to the layer's state at its first forward.
                scales = weight.SCB if getattr(weight, "SCB", None) is not None else layer.state.SCB
                matrix = F.int8_vectorwise_dequant(weight.data, scales)
            state[name] = matrix.reshape(layer.out_features, layer.in_features).float().cpu()
        elif leaf == "bias":
            state[name] = value.detach().float()
    return state


# ---- rapidtrain's adapters on the built-in models ----

# The built-in layers' linear projections by their leaf names (attention, multi-head latent attention, MLPs and
# shared experts); routed experts are grouped weights, not linear layers, and the router stays as it is.
BUILTIN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_down_proj", "q_up_proj", "kv_down_proj", "kv_up_proj",
                   "fc1", "gate", "fc2")


class LoraAdapter(nn.Module):
    """scale · B(A(dropout(x))): the low-rank update beside a linear layer. A plain module of two linear layers, so
    tensor parallelism splits them as it splits their layer (A whole and B by rows beside a column-split layer, A by
    columns and B whole beside a row-split one) and DTensor computes the same sum."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float, dropout: float,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.lora_a = nn.Linear(in_features, rank, bias=False, device=device)
        self.lora_b = nn.Linear(rank, out_features, bias=False, device=device)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_b(self.lora_a(self.dropout(x))) * self.scale


class LoraLinear(nn.Linear):
    """A linear layer with its adapter (`lora`): the base's weight and bias stay the layer's own parameters, under
    their own names, so a checkpoint of the base model loads into it and tensor parallelism splits it as a linear."""

    lora: LoraAdapter

    @classmethod
    def wrapping(cls, base: nn.Linear, rank: int, scale: float, dropout: float) -> LoraLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = base.in_features, base.out_features
        layer.weight = base.weight
        layer.bias = base.bias
        layer.lora = LoraAdapter(base.in_features, base.out_features, rank, scale, dropout, base.weight.device)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora(x)


def add_builtin_lora(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Adapters on the built-in model's target layers, in place, and every other parameter frozen; returns the names
    of the adapted layers. Refuses target names the model has no linear layer by."""
    targets = set(settings.target_modules) - {"all-linear"} or set(BUILTIN_TARGETS)
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("built-in LoRA adapts a built-in GPT/BERT (its `layers`)")
    scale = settings.scaling_alpha / settings.rank
    adapted, seen = [], set()
    for parent_name, parent in list(layers.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                seen.add(name)
                if name in targets:
                    setattr(parent, name, LoraLinear.wrapping(child, settings.rank, scale, settings.dropout))
                    adapted.append(f"layers.{parent_name}.{name}")
    unknown = sorted(targets - seen) if set(settings.target_modules) - {"all-linear"} else []
    if unknown or not adapted:
        from rapidtrain.core.errors import UserError

        raise UserError(f"--lora-target-modules {' '.join(settings.target_modules)}: the built-in model has no "
                         f"linear layer named {', '.join(unknown) or 'so'}; its layers' linear layers are "
                         f"{', '.join(sorted(seen))} (or all-linear)")
    for name, param in model.named_parameters():
        param.requires_grad_(".lora." in f".{name}")
    return adapted


def is_adapter_weight(name: str) -> bool:
    return ".lora.lora_a." in name or ".lora.lora_b." in name


def merge_adapters(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The state of the plain model: each adapted layer's weight W + scale · B A, the adapters left out (what the
    Hugging Face export, generation and the Megatron export read)."""
    merged = {name: value for name, value in state.items() if not is_adapter_weight(name)}
    for name in state:
        if name.endswith(".lora.lora_a.weight"):
            layer = name[: -len(".lora.lora_a.weight")]
            a, b = state[name].float(), state[f"{layer}.lora.lora_b.weight"].float()
            weight = merged[f"{layer}.weight"]
            merged[f"{layer}.weight"] = (weight.float() + scale * (b @ a)).to(weight.dtype)
    return merged
