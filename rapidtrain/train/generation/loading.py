"""What `rapidtrain generate --load DIR` reads: a rapidtrain checkpoint of the built-in GPT (any saved layout,
resharded into this process) or a Hugging Face folder (`convert_checkpoint.py --hf`'s export, a fine-tune's
`last/`/`best/` folder with LoRA merged, a peft adapter folder over a local base), with its tokenizer; then the
model placed, cast and quantised as the Runtime says. Nothing stored in the files runs."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rapidtrain.models.attention_backends import HF_IMPLEMENTATION_OF_NAME, KERNEL_DESCRIPTIONS, KERNEL_OF_NAME, Kernel
from rapidtrain.models.hf_config import refuse_pickled_weights, refuse_remote_code
from rapidtrain.models.transformer import KVCache
from rapidtrain.train.generation.decoding import Forward, builtin_forward
from rapidtrain.train.generation.runtime import FourBit, GenerateError, GenerateOptions, Runtime

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    """A model ready to decode: its forward and fresh-cache functions for the loop, its tokenizer, and the words
    the first line prints."""

    model: nn.Module
    tokenizer: Any
    forward: Forward
    new_cache: Callable[[], Any]
    name: str
    attention: str
    quantization: str
    builtin: bool

    @property
    def pad_id(self) -> int:
        for candidate in (getattr(self.tokenizer, "pad", None), self.tokenizer.eod):
            if candidate is not None:
                return int(candidate)
        return 0


def is_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()


# ---- rapidtrain checkpoints of the built-in GPT ----

# Flags generate passes on to the checkpoint's model and tokenizer; any other training flag would do nothing here.
MODEL_GROUPS = ("transformer", "acceleration: mixture of experts")


def _override_dests(parser: argparse.ArgumentParser) -> set[str]:
    from rapidtrain.data.tokenizer import TokenizerSettings

    dests = {f.name for f in dataclasses.fields(TokenizerSettings)}
    for group in parser._action_groups:
        if group.title in MODEL_GROUPS:
            dests |= {action.dest for action in group._group_actions}
    return dests


def parse_overrides(overrides: list[str]) -> tuple[dict[str, Any], set[str]]:
    """The training parser's reading of the flags generate does not own (model shape and tokenizer flags); a
    training flag that would have no effect on generation is refused, naming it."""
    from rapidtrain.config.arguments import build_parser, given_flags

    parser = build_parser()
    unknown = [flag for flag in overrides if flag.startswith("--") and parser._option_string_actions.get(
        flag.split("=")[0]) is None]
    if unknown:
        raise GenerateError(f"rapidtrain generate: unknown flag {unknown[0]}: see rapidtrain generate --help")
    values = vars(parser.parse_args(overrides))
    given = given_flags(parser, overrides)
    idle = sorted(given - _override_dests(parser))
    if idle:
        flags = ", ".join("--" + name.replace("_", "-") for name in idle)
        raise GenerateError(f"rapidtrain generate: {flags} set(s) training, which generate does not do: drop it "
                            "(generate takes its own flags, the model's shape flags and the tokenizer flags)")
    return values, given


def _builtin_tokenizer(common: dict[str, Any], args: argparse.Namespace, given: set[str]) -> Any:
    from rapidtrain.checkpoint.checkpointer import CheckpointError
    from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer

    saved = (common.get("plan") or {}).get("tokenizer")
    if saved is None and args.tokenizer_type is None:
        raise CheckpointError("the checkpoint was saved without a tokenizer: give the tokenizer flags")
    fields = {f.name for f in dataclasses.fields(TokenizerSettings)}
    settings = {name: value for name, value in (saved or {}).items() if name in fields}
    settings.update({name: getattr(args, name) for name in fields & given})  # the flags' names are the fields'
    if "tokenizer_type" not in settings:
        settings.update({name: getattr(args, name) for name in fields if hasattr(args, name)})
    return build_tokenizer(TokenizerSettings(**settings))


def load_for_generation(options: GenerateOptions | argparse.Namespace, overrides: list[str],
                        attention_kernel: Kernel = "sdpa") -> tuple[nn.Module, Any]:
    """The checkpoint's built-in GPT, whole, fp32, on the CPU in this process, and its tokenizer (as the run's
    plan saved them; tokenizer flags given override the saved files' paths, shape flags must agree with the
    checkpoint)."""
    from rapidtrain.checkpoint.checkpointer import CheckpointError, read_common
    from rapidtrain.checkpoint.compatibility import check_same_model
    from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state
    from rapidtrain.config.resolve import model_config_from_args
    from rapidtrain.config.saved_checkpoint import saved_model_config
    from rapidtrain.models import build_model

    directory = checkpoint_directory(options.load, options.iteration)
    config = saved_model_config(directory)
    script_model = (read_common(directory).get("plan") or {}).get("script_model")
    if script_model:  # the run's plan recorded the model a user script built
        raise CheckpointError(f"{directory} holds no built-in GPT: it holds a user script's own model "
                              f"({script_model}); generate runs the built-in GPT's checkpoints and Hugging Face "
                              "folders")
    if config is None or config.model_type != "gpt":
        raise CheckpointError(_not_builtin_message(directory, config))
    values, given = parse_overrides(overrides)
    common = read_common(directory)
    saved_args = common.get("args", {})
    args = argparse.Namespace(**(values | {k: v for k, v in saved_args.items() if k not in given}))
    if given & {f.name for f in dataclasses.fields(config)} | given & set(saved_args):
        wanted = model_config_from_args(args, config.vocab_size)
        check_same_model(dataclasses.asdict(config), dataclasses.asdict(wanted), directory)
    model = build_model(dataclasses.replace(config, attention_kernel=attention_kernel), seed=None)
    state = consolidated_model_state(directory)
    if set(state) != set(model.state_dict()):  # a user script's own model, saved with the flags' plan
        stored = ", ".join(sorted(state)[:3]) + (", ..." if len(state) > 3 else "")
        raise CheckpointError(f"{directory} holds no built-in GPT (its model's tensors are {stored}: a user script's "
                              "own model): generate runs the built-in GPT's checkpoints and Hugging Face folders")
    model.load_state_dict(state, strict=True)
    return model.eval(), _builtin_tokenizer(common, args, given)


def _not_builtin_message(directory: Path, config: Any) -> str:
    if config is not None:
        return (f"{directory} holds a built-in BERT: `rapidtrain generate` continues text with a causal model "
                "(the built-in GPT or a Hugging Face causal LM)")
    for name in ("last", "best"):
        if (directory.parent / name / "config.json").is_file():
            return (f"{directory} is a fine-tune of a Hugging Face model; its model (LoRA adapters merged) is the "
                    f"folder {directory.parent / name}: pass --load {directory.parent / name}")
    return (f"{directory} holds no built-in GPT (a user script's model, or a Hugging Face fine-tune's training "
            "state): generate loads the built-in GPT's checkpoints and Hugging Face folders (save_pretrained, "
            "a fine-tune's last/ or best/, scripts/convert_checkpoint.py --hf)")


# ---- Hugging Face folders ----


def _hf_tokenizer(folder: Path, overrides: list[str]) -> Any:
    from rapidtrain.data.tokenizer import HuggingFaceTokenizer, TokenizerSettings, build_tokenizer

    values, given = parse_overrides(overrides)
    if "tokenizer_type" in given:
        fields = {f.name for f in dataclasses.fields(TokenizerSettings)}
        return build_tokenizer(TokenizerSettings(**{name: values[name] for name in fields if name in values}))
    if any((folder / name).exists() for name in TOKENIZER_FILES):
        return HuggingFaceTokenizer(str(folder))
    raise GenerateError(f"rapidtrain generate: {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): "
                        "give the tokenizer the model was trained with, e.g. --tokenizer-type SentencePieceTokenizer "
                        "--tokenizer-model FILE")


def _adapter_base(folder: Path) -> Path:
    path = folder / "adapter_config.json"
    try:
        base = json.loads(path.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as error:  # ValueError: not JSON or not UTF-8; a list has no .get
        raise GenerateError(f"rapidtrain generate: {path}: damaged ({type(error).__name__}: {error}); pass the "
                            "fine-tune's merged last/ or best/ folder instead") from None
    if not isinstance(base, str) or not base or not (Path(base) / "config.json").is_file():
        raise GenerateError(f"rapidtrain generate: {folder} is a LoRA adapter over {base!r}, which is not a local "
                            "Hugging Face folder here: pass the fine-tune's merged last/ or best/ folder instead")
    return Path(base)


def _hf_load_options(runtime: Runtime) -> dict[str, Any]:
    options: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False, "dtype": runtime.torch_dtype,
                               "device_map": "auto" if runtime.split_layers else {"": runtime.device}}
    implementation = HF_IMPLEMENTATION_OF_NAME[runtime.attention]
    if implementation:
        options["attn_implementation"] = implementation
    if runtime.load_in_bits == 4 and runtime.four_bit:
        from transformers import BitsAndBytesConfig

        fmt = runtime.four_bit
        options["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=fmt.quant_type, bnb_4bit_use_double_quant=fmt.double_quant,
            bnb_4bit_compute_dtype=fmt.torch_compute_dtype)
    elif runtime.load_in_bits:
        from rapidtrain.models.lora import quantization_config

        options["quantization_config"] = quantization_config(runtime.load_in_bits, runtime.torch_dtype)
    return options


def load_hf_model(folder: Path, runtime: Runtime) -> nn.Module:
    """AutoModelForCausalLM from the local folder (safetensors, or .bin through weights_only loading), never
    remote code; a peft adapter folder is merged into its local base."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the first line already says what is loaded
    adapter = not (folder / "config.json").is_file()
    base = _adapter_base(folder) if adapter else folder
    refuse_remote_code(base, "--load")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, **_hf_load_options(runtime))
    except pickle.UnpicklingError as error:  # a pytorch_model.bin holding more than tensors
        raise refuse_pickled_weights(base, error) from None
    except (OSError, ValueError, KeyError) as error:
        raise GenerateError(f"rapidtrain generate: --load {folder}: transformers cannot load it as a causal "
                            f"language model from local files ({str(error).splitlines()[0]})") from error
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    return model.eval()


def hf_forward(model: nn.Module) -> Forward:
    """The Hugging Face model as the loop calls it: the last position's logits only (logits_to_keep=1)."""
    # Newer transformers name the cache argument `cache` in some models (GPT-2) and deprecate past_key_values there.
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Any) -> torch.Tensor:
        out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=cache is not None,
                    logits_to_keep=1, **{cache_name: cache})
        return out.logits

    return forward


def load_hf(folder: Path, runtime: Runtime, overrides: list[str]) -> LoadedModel:
    from transformers import DynamicCache

    tokenizer = _hf_tokenizer(folder, overrides)
    model = load_hf_model(folder, runtime)
    quantization = "none"
    if runtime.four_bit:
        quantization = runtime.four_bit.describe()
    elif runtime.load_in_bits:
        from rapidtrain.models.lora import describe_quantization

        quantization = describe_quantization(runtime.load_in_bits, runtime.dtype).split(" (")[0]
    config: Any = model.config  # a transformers PretrainedConfig (nn.Module types attributes as Tensor | Module)
    return LoadedModel(model, tokenizer, hf_forward(model), lambda: DynamicCache(config=config),
                       f"transformers {type(model).__name__} from {folder}",
                       f"attn_implementation={config._attn_implementation}", quantization, builtin=False)


# ---- the built-in GPT, placed, cast, quantised ----


def quantize_linear_layers(model: nn.Module, bits: int, compute_dtype: torch.dtype,
                           four_bit: FourBit | None = None) -> int:
    """Swap every nn.Linear of the transformer layers for its bitsandbytes 4-bit (`four_bit`'s format, NF4 by
    default) or 8-bit (LLM.int8) version;
    the embeddings and output head keep their dtype (as transformers does). The weights are quantised when the
    layer moves to its device. Returns how many layers were swapped."""
    import bitsandbytes as bnb

    swapped = 0
    blocks: Any = model.layers  # the built-in GPT's ModuleDict of layers
    for module in list(blocks.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            bias = child.bias is not None
            layer: nn.Module
            if bits == 4:
                fmt = four_bit or FourBit()
                compute = fmt.torch_compute_dtype if four_bit else compute_dtype
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=bias, compute_dtype=compute,
                                          quant_type=fmt.quant_type, compress_statistics=fmt.double_quant)
                layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type=fmt.quant_type,
                                                 compress_statistics=fmt.double_quant)
            else:
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=bias, has_fp16_weights=False)
                layer.weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
            if bias:
                layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, child_name, layer)
            swapped += 1
    return swapped


def _move_inputs(device: torch.device) -> Callable:
    def hook(_module: nn.Module, args: tuple) -> tuple:
        moved = (a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        return tuple(tuple(t.to(device) for t in a) if isinstance(a, tuple) else a for a in moved)

    return hook


def split_layers(model: nn.Module, devices: list[torch.device]) -> None:
    """Layers in equal consecutive runs over `devices`; embedding, final norm and head on the first device (the
    head may share the embedding's weight). Each layer moves its inputs to its own device; the KV cache of a layer
    lives where the layer does."""
    blocks: Any = model.layers  # the built-in GPT's ModuleDict of layers
    layers = list(blocks.values())
    model.to(devices[0])
    for index, layer in enumerate(layers):
        device = devices[index * len(devices) // len(layers)]
        layer.to(device)
        layer.register_forward_pre_hook(_move_inputs(device))
    head: Any = model.final_norm if model.final_norm is not None else model.output
    head.register_forward_pre_hook(_move_inputs(devices[0]))


def load_builtin(options: GenerateOptions, runtime: Runtime, overrides: list[str]) -> LoadedModel:
    kernel = KERNEL_OF_NAME[runtime.attention]
    model, tokenizer = load_for_generation(options, overrides, attention_kernel=kernel)
    model.to(runtime.torch_dtype)
    quantization = "none"
    if runtime.load_in_bits:
        swapped = quantize_linear_layers(model, runtime.load_in_bits, runtime.torch_dtype, runtime.four_bit)
        kind = runtime.four_bit.describe() if runtime.four_bit else "bitsandbytes LLM.int8() 8-bit weights"
        quantization = f"{kind} in {swapped} linear layers (embeddings and head {runtime.dtype})"
    if runtime.split_layers:
        split_layers(model, [torch.device("cuda", i) for i in range(torch.cuda.device_count())])
    else:
        model.to(runtime.device)
    config: Any = model.config  # the built-in model's ModelConfig
    name = f"{config.architecture} from {options.load}"
    attention = f"{runtime.attention}: {KERNEL_DESCRIPTIONS[kernel]}"
    return LoadedModel(model, tokenizer, builtin_forward(model), KVCache, name, attention, quantization, builtin=True)


def load_model(options: GenerateOptions, runtime_of: Callable[[bool], Runtime],
               overrides: list[str]) -> tuple[LoadedModel, Runtime]:
    """A Hugging Face folder or a rapidtrain checkpoint, as --load names it, run as the flags ask."""
    folder = Path(options.load)
    if is_hf_folder(folder):
        runtime = runtime_of(False)
        return load_hf(folder, runtime, overrides), runtime
    runtime = runtime_of(True)
    return load_builtin(options, runtime, overrides), runtime
