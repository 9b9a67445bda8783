"""--attention-backend: Megatron's and Hugging Face's names for the attention kernel, the kernel each name runs
on a device (built-in models) or the `attn_implementation` it passes (Hugging Face models), and why a name is
refused where its kernel cannot run. Free of torch, so the rules and the plan can ask it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

# One flag takes both vocabularies: they name the same choice (which kernel computes softmax(QKᵀ/√d)V), a
# Megatron script passes `--attention-backend auto` and a Hugging Face user thinks in attn_implementation's names.
MEGATRON_NAMES = ("auto", "flash", "fused", "unfused", "local")
HUGGING_FACE_NAMES = ("eager", "sdpa", "flash_attention_2", "flex_attention")
NAMES = MEGATRON_NAMES + HUGGING_FACE_NAMES

# The built-in models' kernels (rapidtrain/models/attention.py runs them).
Kernel = Literal["auto", "sdpa", "sdpa_flash", "sdpa_cudnn", "eager", "flex"]
KERNEL_OF_NAME: dict[str, Kernel] = {
    "auto": "auto",
    "sdpa": "sdpa",
    "flash": "sdpa_flash",
    "flash_attention_2": "sdpa_flash",  # PyTorch's flash backend is FlashAttention-2's algorithm
    "fused": "sdpa_cudnn",  # Megatron's fused is Transformer Engine's cuDNN fused attention
    "unfused": "eager",
    "local": "eager",  # Megatron's own (non-TE) DotProductAttention: explicit softmax(QKᵀ)V
    "eager": "eager",
    "flex_attention": "flex",
}
# What a Hugging Face model is loaded with (None: transformers' own default, sdpa where the model has it).
HF_IMPLEMENTATION_OF_NAME: dict[str, str | None] = {
    "auto": None, "sdpa": "sdpa", "eager": "eager", "unfused": "eager", "local": "eager",
    "flash": "flash_attention_2", "flash_attention_2": "flash_attention_2", "flex_attention": "flex_attention",
}

# The longest key sequence at which rapidtrain's short-sequence kernel (models/attention.py's short_attention) beats
# PyTorch's CPU flash kernel in bf16, measured on a 2-core Zen 4 with AVX512-BF16, 2 threads, 4 × 6 heads × 64,
# causal, forward + backward: 5.1 against 12.5 ms at 256 keys, 15.9 against 29.5 at 384, 35.5 against 43.0 at 512,
# 139 against 90 at 1,024 (the [s, s] scores leave the caches).
SHORT_KERNEL_MAX_KEYS = 512


def short_kernel_description(dtype: str) -> str:
    """What the plan says runs where short_kernel_runs: its matmuls in the run's dtype (bf16, or fp32 with attention
    dropout: an fp32 run's scores are not rounded to bf16)."""
    rounding = ", the scores rounded to bf16 as in Megatron's unfused attention" if dtype == "bf16" else ""
    return (f"rapidtrain's short-sequence attention (models/attention.py's short_attention): batched {dtype} matmuls "
            f"around one fused softmax (fp32 inside){rounding}, the [s, s] probabilities (and dropout's keep-mask) "
            "kept for backward; grouped-query heads stacked, K and V not repeated")


KERNEL_DESCRIPTIONS: dict[Kernel, str] = {
    "auto": "torch scaled_dot_product_attention, PyTorch's dispatcher picking the kernel (CUDA: flash, "
            "memory-efficient or cuDNN; CPU: its flash kernel); on a CPU in bf16 over at most "
            f"{SHORT_KERNEL_MAX_KEYS} keys per query, or with attention dropout, rapidtrain's short-sequence "
            "attention (batched matmuls around one fused softmax, the [s, s] probabilities kept for backward)",
    "sdpa": "torch scaled_dot_product_attention, PyTorch's dispatcher picks the kernel (CUDA: flash, "
            "memory-efficient or cuDNN; CPU: its flash kernel, the math kernel with dropout)",
    "sdpa_flash": "torch scaled_dot_product_attention restricted to SDPBackend.FLASH_ATTENTION (CUDA: "
                  "FlashAttention-2; CPU: PyTorch's flash-attention CPU kernel)",
    "sdpa_cudnn": "torch scaled_dot_product_attention restricted to SDPBackend.CUDNN_ATTENTION (cuDNN fused "
                  "attention)",
    "eager": "explicit softmax(QKᵀ/√d)·V (fp32 softmax; materializes the [s, s] scores per head)",
    "flex": "torch FlexAttention with a block-sparse BlockMask (compiled on CUDA; eager on CPU, forward only)",
}

# Why the built-in models run that kernel for that name (the plan's "because").
WHY_KERNEL = {
    "auto": "Megatron's auto, the fastest kernel that takes the inputs: on a CPU in bf16 at short sequences "
            "materializing the scores is faster than PyTorch's flash kernel (2.4× at 256 keys, measured), and with "
            "attention dropout than SDPA's math path (PyTorch's CPU flash kernel has no dropout); elsewhere "
            "PyTorch's SDPA dispatcher decides",
    "sdpa": "Hugging Face's sdpa is torch's scaled_dot_product_attention",
    "flash": "Megatron's flash (FlashAttention), PyTorch's own build of it",
    "flash_attention_2": "Hugging Face's flash_attention_2; the built-in models run PyTorch's FlashAttention-2 "
                         "kernel, not the flash_attn package",
    "fused": "Megatron's fused is Transformer Engine's cuDNN fused attention",
    "unfused": "Megatron's unfused attention is the explicit softmax(QKᵀ)V",
    "local": "Megatron's local (its own, non-Transformer-Engine) attention is the explicit softmax(QKᵀ)V",
    "eager": "Hugging Face's eager attention is the explicit softmax(QKᵀ)V",
    "flex_attention": "Hugging Face's flex_attention is torch's FlexAttention",
}


@dataclass(frozen=True)
class AttentionSettings:
    """The plan's answer to --attention-backend: the name given, the built-in models' kernel, the Hugging
    Face `attn_implementation` (None: transformers' default), and whether packed documents are masked
    through document ids (FlexAttention's BlockMask) instead of a dense [s, s] mask."""

    name: str = "auto"
    kernel: Kernel = "auto"
    hf_implementation: str | None = None
    document_ids: bool = False

    def describe(self, builtin: bool, short: bool = False, dtype: str = "bf16") -> tuple[str, str]:
        """(what serves attention, why) for the plan; `short`: the run's attention is short_kernel_runs's, in
        `dtype`."""
        if not builtin:
            what = (f"transformers attn_implementation={self.hf_implementation!r}" if self.hf_implementation
                    else "transformers' default attn_implementation (sdpa where the model has it, else eager)")
            return what, f"--attention-backend {self.name}" + (
                f" (Megatron's name; Hugging Face's {self.hf_implementation})"
                if self.name in MEGATRON_NAMES and self.hf_implementation else "")
        what = short_kernel_description(dtype) if short else KERNEL_DESCRIPTIONS[self.kernel]
        if self.document_ids:
            what += "; --reset-attention-mask as a BlockMask from document ids (causal AND same document), " \
                    "no dense [s, s] mask"
        return what, f"--attention-backend {self.name}: {WHY_KERNEL[self.name]}"


def resolve(name: str, reset_attention_mask: bool = False) -> AttentionSettings:
    kernel = KERNEL_OF_NAME[name]
    return AttentionSettings(name, kernel, HF_IMPLEMENTATION_OF_NAME.get(name),
                             document_ids=reset_attention_mask and kernel == "flex")


def short_kernel_runs(kernel: Kernel, device_type: str, dtype: str, queries: int, keys: int, dropout: bool = False,
                      alibi: bool = False, sink: bool = False) -> bool:
    """Whether `kernel` runs rapidtrain's short-sequence attention for this call (or, asked by the plan, for the
    run's attention): auto, on a CPU, self-attention (decoding after cached tokens and context parallelism's
    all-gathered keys go to SDPA) without ALiBi or attention sinks (SDPA takes them as a float mask), and either
    in bf16 over at most SHORT_KERNEL_MAX_KEYS keys, or with attention dropout in bf16 or fp32 at any length: there
    PyTorch's CPU flash kernel cannot run (it has no dropout) and SDPA takes its math path, which materializes the
    scores too, in fp32, and draws its mask with bernoulli_ (measured with dropout 0.1, forward + backward, 4 × 6 heads
    × 64, 2 threads: fp32 30.7 against 24.1 ms at 256 keys, 636 against 545 at 1,024; bf16 695 against 289 at 1,024)."""
    if kernel != "auto" or device_type != "cpu" or queries != keys or alibi or sink:
        return False
    return (dtype == "bf16" and keys <= SHORT_KERNEL_MAX_KEYS) or (dropout and dtype in ("bf16", "fp32"))


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def attention_problem(name: str, device_type: str, builtin: bool, attention_dropout: float,
                      half_precision: bool, training: bool = True, masked_by: str | None = None) -> str | None:
    """Why `--attention-backend name` cannot run here, with the fix; None where it can. `masked_by`: the flag that
    makes the built-in model attend under a dense mask (CUDA's flash kernel takes none), or None."""
    flag = f"--attention-backend {name}"
    if not builtin:
        implementation = HF_IMPLEMENTATION_OF_NAME.get(name, "missing")
        if implementation == "missing":
            return (f"{flag} is Megatron's cuDNN fused attention of the built-in models; a Hugging Face model "
                    "takes eager, sdpa, flash_attention_2 or flex_attention (or auto)")
        if implementation == "flash_attention_2" and (device_type != "cuda" or not flash_attn_installed()):
            return (f"{flag} loads the Hugging Face model with attn_implementation='flash_attention_2', which "
                    "needs a CUDA device and the flash_attn package (pip install flash-attn)"
                    + (f"; this run is on {device_type}" if device_type != "cuda" else "; it is not installed")
                    + ": choose sdpa or eager")
        if implementation == "flex_attention" and device_type == "cpu" and training:
            return (f"{flag}: FlexAttention has no backward pass on CPU in this torch, so a CPU run cannot train "
                    "with it: choose sdpa or eager on CPU, flex_attention on CUDA")
        return None
    kernel = KERNEL_OF_NAME[name]
    if kernel == "sdpa_cudnn" and device_type != "cuda":
        return f"{flag} is cuDNN's fused attention, a CUDA kernel: on {device_type} choose auto, flash or unfused"
    if kernel in ("sdpa_flash", "sdpa_cudnn") and device_type == "cuda" and not half_precision:
        return (f"{flag}: the CUDA {'flash' if kernel == 'sdpa_flash' else 'cuDNN'} attention kernel computes in "
                "fp16/bf16 only: add --bf16 or --fp16, or choose auto (memory-efficient attention takes fp32)")
    if kernel == "sdpa_flash" and device_type == "cuda" and masked_by:
        return (f"{flag} with {masked_by}: CUDA's flash attention kernel takes no attention mask, and "
                f"{masked_by} attends under one; choose auto (PyTorch picks a kernel that takes the mask)")
    if kernel == "sdpa_flash" and device_type == "cpu" and attention_dropout > 0 and training:
        return (f"{flag}: PyTorch's CPU flash-attention kernel has no dropout, and --attention-dropout is "
                f"{attention_dropout:g}: pass --attention-dropout 0, or choose auto (the math kernel with dropout)")
    if kernel == "flex" and device_type == "cpu" and training:
        return (f"{flag}: FlexAttention has no backward pass on CPU in this torch, so a CPU run cannot train with "
                "it: choose auto, flash or eager on CPU, flex_attention on CUDA")
    if kernel == "flex" and attention_dropout > 0 and training:
        return (f"{flag}: FlexAttention has no attention dropout, and --attention-dropout is "
                f"{attention_dropout:g}: pass --attention-dropout 0 or choose another backend")
    return None
