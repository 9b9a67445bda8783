"""How `rapidtrain generate` runs a model: device, dtype, attention kernel, k-bit weights, compilation and batch
size, each checked against this machine (refused with the reason where it cannot take effect), and the line that
names them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rapidtrain.core.errors import UserError
from rapidtrain.models.attention_backends import KERNEL_OF_NAME, attention_problem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class GenerateError(UserError, ValueError):
    """A generate flag, prompt file or folder that cannot be used as given; the message says how to fix it."""


@dataclass(frozen=True)
class GenerateOptions:
    """`rapidtrain generate`'s own flags (command.py's parser documents each); generate has no training plan."""

    load: str
    iteration: int | None = None
    prompt: str | None = None
    input_file: str | None = None
    output_file: str | None = None
    batch_size: int = 1
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234
    kv_cache: bool = True
    device: str = "auto"
    split_layers: bool = False
    bf16: bool = False
    fp16: bool = False
    attention_backend: str = "auto"
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "nf4"
    bnb_4bit_compute_dtype: str | None = None
    bnb_4bit_use_double_quant: bool = False
    torch_compile: bool = False
    show_library_warnings: bool = False


@dataclass(frozen=True)
class FourBit:
    """bitsandbytes' 4-bit weights, in transformers' BitsAndBytesConfig terms: the number format (NF4 for normally
    distributed weights, FP4), the dtype the matmuls compute in, and whether the per-block scales are themselves
    quantised (double quantisation: about 0.4 bit a weight less)."""

    quant_type: Literal["nf4", "fp4"] = "nf4"
    compute_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    double_quant: bool = False

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return DTYPES[self.compute_dtype]

    def describe(self) -> str:
        double = ", double quantisation" if self.double_quant else ""
        return f"bitsandbytes {self.quant_type.upper()} 4-bit weights{double}, computed in {self.compute_dtype}"


COMPUTE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # HF's names → rapidtrain's


@dataclass(frozen=True)
class Runtime:
    """Where and how the model runs: `device` ("cpu", "cuda", "cuda:1"), `dtype` of the weights and activations,
    the --attention-backend name, 4/8-bit bitsandbytes weights (None: the dtype's), prompts per batch,
    `split_layers` (the layers spread over every visible GPU) and `compile` (the decoding step compiled, through a
    static KV cache)."""

    device: str = "cpu"
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    attention: str = "auto"
    load_in_bits: Literal[4, 8] | None = None
    batch_size: int = 1
    split_layers: bool = False
    compile: bool = False
    four_bit: FourBit | None = None  # --load-in-4bit's format (HF's bnb_4bit_* names)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type


def _device(options: GenerateOptions) -> str:
    if options.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return options.device


def _precision_problems(options: GenerateOptions, device_type: str) -> list[str]:
    found = []
    if options.bf16 and options.fp16:
        found.append("--bf16 and --fp16 both choose the dtype: give one")
    if options.fp16 and device_type == "cpu":
        found.append("--fp16 on a CPU: CPUs have no native fp16 arithmetic (PyTorch emulates it, slower than fp32); "
                     "use --bf16 where the CPU has AVX512-BF16/AMX, or fp32 (no flag)")
    if options.bf16 and device_type == "cpu" and not torch.cpu._is_avx512_bf16_supported():
        found.append("--bf16 on this CPU: it has no native bf16 instructions (AVX512-BF16 or AMX), so bf16 would be "
                     "emulated and slower than fp32: drop --bf16")
    if options.bf16 and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        found.append("--bf16: this GPU has no bf16 arithmetic (before Ampere): use --fp16")
    return found


def _quantization_problems(options: GenerateOptions) -> list[str]:
    four_bit_flags = [flag for flag, given in (
        ("--bnb-4bit-quant-type", options.bnb_4bit_quant_type != "nf4"),
        ("--bnb-4bit-compute-dtype", options.bnb_4bit_compute_dtype is not None),
        ("--bnb-4bit-use-double-quant", options.bnb_4bit_use_double_quant)) if given]
    if four_bit_flags and not options.load_in_4bit:
        return [f"{', '.join(four_bit_flags)} set the format of --load-in-4bit's weights: add --load-in-4bit, or drop "
                "them"]
    if not (options.load_in_4bit or options.load_in_8bit):
        return []
    if options.load_in_4bit and options.load_in_8bit:
        return ["--load-in-4bit and --load-in-8bit both choose the weights' width: give one"]
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return ["--load-in-4bit / --load-in-8bit quantise the weights with bitsandbytes, which is not installed: "
                "pip install 'rapidtrain[lowbit]'"]
    return []


def _device_problems(options: GenerateOptions, device: str) -> list[str]:
    found = []
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        found.append(f"--device {options.device}: no CUDA device here (torch {torch.__version__}); use --device cpu")
    elif torch.device(device).type not in ("cpu", "cuda"):
        found.append(f"--device {options.device}: generate runs on cpu or cuda[:N]")
    if options.split_layers and torch.cuda.device_count() < 2:
        found.append(f"--split-layers spreads the model's layers over several GPUs; this machine has "
                     f"{torch.cuda.device_count()}: drop it (one device holds the whole model)")
    return found


def _compile_problems(options: GenerateOptions, builtin: bool) -> list[str]:
    """--torch-compile compiles the built-in GPT's one-token step over a static KV cache, attending under a mask."""
    if not options.torch_compile:
        return []
    found = []
    if not builtin:
        found.append("--torch-compile compiles the built-in GPT's decoding step over rapidtrain's static KV cache; "
                     "a Hugging Face folder decodes through transformers' own cache: drop --torch-compile")
    if not options.kv_cache:
        found.append("--torch-compile compiles the cached one-token decoding step; --no-kv-cache recomputes a "
                     "growing sequence (new shapes every step): drop one of them")
    if builtin and KERNEL_OF_NAME[options.attention_backend] not in ("auto", "sdpa", "eager"):
        found.append(f"--torch-compile with --attention-backend {options.attention_backend}: the compiled step "
                     "attends over the whole static cache under a mask of its written slots, which only sdpa "
                     "(auto) and eager take: use one of them")
    if options.split_layers:
        found.append("--torch-compile with --split-layers: the compiled step's CUDA graphs (reduce-overhead) "
                     "capture one device, and the split model's step runs on several: drop one of them")
    return found


def resolve_runtime(options: GenerateOptions, builtin: bool) -> Runtime:
    """The Runtime the flags ask for, or GenerateError naming every flag that cannot take effect here."""
    device = _device(options)
    found = _device_problems(options, device)
    device_type = torch.device(device).type if not found else "cpu"
    found += _precision_problems(options, device_type) + _quantization_problems(options)
    if options.batch_size < 1:
        found.append(f"--batch-size {options.batch_size} must be at least 1")
    half = options.bf16 or options.fp16
    padded = f"--batch-size {options.batch_size} (prompts of different lengths padded under a mask)"
    attention = attention_problem(options.attention_backend, device_type, builtin, 0.0, half, training=False,
                                  masked_by=padded if options.batch_size > 1 else None)
    if attention:
        found.append(attention)
    found += _compile_problems(options, builtin)
    if found:
        raise GenerateError("rapidtrain generate: " + "; ".join(found))
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16" if options.bf16 else "fp16" if options.fp16 else "fp32"
    bits: Literal[4, 8] | None = 4 if options.load_in_4bit else 8 if options.load_in_8bit else None
    four_bit = None
    if bits == 4:  # the matmuls compute in the model's dtype unless told otherwise (transformers' default: fp32)
        compute = COMPUTE_DTYPES[options.bnb_4bit_compute_dtype] if options.bnb_4bit_compute_dtype else dtype
        four_bit = FourBit(options.bnb_4bit_quant_type, compute, options.bnb_4bit_use_double_quant)  # type: ignore[arg-type]
    return Runtime(device, dtype, options.attention_backend, bits, options.batch_size,
                   options.split_layers, options.torch_compile, four_bit)
