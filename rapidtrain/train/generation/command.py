"""`rapidtrain generate`: one prompt (--prompt) or a JSON-lines file of them (--input-file), decoded in batches of
--batch-size with left padding, printed and/or written as JSON lines (--output-file)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rapidtrain.config.flag_parser import FlagParser
from rapidtrain.core.library_warnings import quiet_library_messages
from rapidtrain.models.attention_backends import NAMES as ATTENTION_NAMES
from rapidtrain.train.generation.decoding import (
    Decoding,
    SamplingSettings,
    check_length,
    continuation,
    decode,
    left_padded,
)
from rapidtrain.train.generation.loading import LoadedModel, load_model
from rapidtrain.train.generation.runtime import COMPUTE_DTYPES, GenerateError, GenerateOptions, Runtime, resolve_runtime
from rapidtrain.train.generation.static import compile_mode, compiled_step, decode_static


def generation_parser() -> argparse.ArgumentParser:
    # rapidtrain's parser: float flags refuse NaN and infinity (--temperature nan passed every range check).
    parser = FlagParser(
        prog="rapidtrain generate",
        description="Continue prompts with a trained model: a rapidtrain checkpoint of the built-in GPT (its model "
                    "and tokenizer flags default to the saved ones; give them to override, e.g. --tokenizer-model "
                    "on another machine) or a Hugging Face folder (config.json + weights, loaded from local files).",
        allow_abbrev=False,
    )
    parser.add_argument("--load", required=True, help="A --save folder (its latest iteration), one iter_* folder, "
                                                      "or a Hugging Face folder.")
    parser.add_argument("--iteration", type=int, default=None, help="Load this iteration instead of the latest.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="Text to continue. It must tokenize to at least one token (a tokenizer "
                                         "that adds a begin-of-sequence token continues even an empty prompt).")
    source.add_argument("--input-file", help='JSON lines, one {"prompt": TEXT} per line.')
    parser.add_argument("--output-file", help='Write {"prompt": ..., "completion": ...} per line (JSON lines).')
    parser.add_argument("--batch-size", type=int, default=1, help="Prompts decoded together, left-padded (default 1).")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to add (default 32).")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; above 0: sample from softmax(logits / temperature).")
    parser.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely tokens (0: all).")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="Sample among the most likely tokens whose probability reaches p (1.0: all).")
    parser.add_argument("--seed", type=int, default=1234, help="Seed of the sampling generator.")
    parser.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                        help="Recompute the whole sequence each step instead of caching keys and values.")
    add_runtime_flags(parser)
    return parser


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("how the model runs")
    g.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when present, else cpu).")
    g.add_argument("--split-layers", action="store_true",
                   help="Spread the layers over every visible GPU (a model too large for one).")
    g.add_argument("--bf16", action="store_true", help="bf16 weights and activations (CUDA; a CPU with AVX512-BF16).")
    g.add_argument("--fp16", action="store_true", help="fp16 weights and activations (CUDA only).")
    g.add_argument("--attention-backend", choices=ATTENTION_NAMES, default="auto",
                   help="The attention kernel, as in training: auto/sdpa, flash, eager, flex_attention, ...")
    g.add_argument("--load-in-8bit", action="store_true", help="bitsandbytes LLM.int8() weights.")
    g.add_argument("--load-in-4bit", action="store_true",
                   help="bitsandbytes 4-bit weights (NF4 unless --bnb-4bit-quant-type fp4).")
    g.add_argument("--bnb-4bit-quant-type", choices=("nf4", "fp4"), default="nf4",
                   help="With --load-in-4bit: the 4-bit number format (transformers' bnb_4bit_quant_type; default "
                        "nf4, made for normally distributed weights).")
    g.add_argument("--bnb-4bit-compute-dtype", choices=tuple(COMPUTE_DTYPES),
                   help="With --load-in-4bit: the dtype the 4-bit matmuls compute in (transformers' "
                        "bnb_4bit_compute_dtype; default: the model's, --bf16/--fp16 or float32).")
    g.add_argument("--bnb-4bit-use-double-quant", action="store_true",
                   help="With --load-in-4bit: quantise the per-block scales too (transformers' "
                        "bnb_4bit_use_double_quant; about 0.4 bit a weight less).")
    g.add_argument("--torch-compile", action="store_true",
                   help="Decode through a static KV cache (prompt + --max-new-tokens slots) and compile the one-token "
                        "step with torch.compile (CUDA: mode reduce-overhead); built-in GPT, sdpa or eager attention.")
    g.add_argument("--show-library-warnings", action="store_true",
                   help="Show every message the libraries log (by default those that do not concern the user are "
                        "hidden, and repeats shown once: rapidtrain/core/library_warnings.py).")


def read_prompts(path: str) -> list[str]:
    """The prompts of a JSON-lines file; a bad line is named as FILE:LINE."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise GenerateError(f"rapidtrain generate: --input-file {path}: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise GenerateError(f"rapidtrain generate: --input-file {path}: not UTF-8 text (byte {error.start})") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise GenerateError(f"rapidtrain generate: {path}:{number}: not JSON ({error.msg})") from error
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise GenerateError(f'rapidtrain generate: {path}:{number}: expected {{"prompt": TEXT}}')
        prompts.append(row["prompt"])
    if not prompts:
        raise GenerateError(f"rapidtrain generate: --input-file {path} holds no prompts")
    return prompts


def tokenized(loaded: LoadedModel, prompts: list[str], source: str) -> list[list[int]]:
    ids = []
    for number, prompt in enumerate(prompts, start=1):
        tokens = loaded.tokenizer.tokenize(prompt)
        if not tokens:
            where = "--prompt" if source == "--prompt" else f"{source}:{number}"
            raise GenerateError(f"rapidtrain generate: {where}: the prompt is empty after tokenizing and this "
                                "tokenizer adds no begin-of-sequence token to start from: give some text")
        ids.append(tokens)
    return ids


def batches(items: list[list[int]], size: int) -> Iterator[list[list[int]]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


Decoder = Callable[[torch.Tensor, torch.Tensor, Decoding], torch.Tensor]


def decoder(loaded: LoadedModel, runtime: Runtime) -> Decoder:
    """(tokens, mask, how) → new tokens: the growing KV cache, or with --torch-compile the static cache and the
    compiled step (compiled at its first call, then reused by every batch)."""
    if not runtime.compile:
        return lambda tokens, mask, how: decode(loaded.forward, tokens, mask, how, loaded.new_cache)
    config: Any = loaded.model.config  # the built-in model's ModelConfig
    if config.position_embedding_type == "alibi" or config.sliding_window is not None:
        raise GenerateError("rapidtrain generate: --torch-compile: this model's ALiBi or sliding window measures "
                            "distances from the last cached key, which the static cache's step does not keep: "
                            "drop --torch-compile")
    step = compiled_step(loaded.model, runtime.device_type)
    return lambda tokens, mask, how: decode_static(loaded.forward, step, tokens, mask, how)


def completions(loaded: LoadedModel, prompts: list[list[int]], runtime: Runtime, how: Decoding) -> Iterator[str]:
    """Each prompt's continuation as text, in order, decoded runtime.batch_size at a time."""
    device = runtime.device if not runtime.split_layers else "cuda:0"
    run_batch = decoder(loaded, runtime)
    for batch in batches(prompts, runtime.batch_size):
        tokens, mask = left_padded(batch, loaded.pad_id, device)
        if loaded.builtin:
            check_length(loaded.model, tokens.shape[1], how.settings.max_new_tokens)
        new = run_batch(tokens, mask, how).tolist()
        for prompt, added in zip(batch, new, strict=True):
            yield continuation(loaded.tokenizer, prompt + added, len(prompt))


def first_line(loaded: LoadedModel, runtime: Runtime) -> str:
    placement = f"{torch.cuda.device_count()} GPUs, layers split" if runtime.split_layers else runtime.device
    compiled = (f"torch.compile (mode {compile_mode(runtime.device_type)}) of the one-token step, static KV cache"
                if runtime.compile else "none")
    return (f"rapidtrain generate: {loaded.name} | device {placement} | dtype {runtime.dtype} | attention "
            f"{loaded.attention} | batch size {runtime.batch_size} | quantization {loaded.quantization} | "
            f"weights {weight_bytes(loaded.model) / 2**20:,.2f} MiB | compile {compiled}")


def write_rows(path: str, prompts: list[str], texts: list[str]) -> None:
    try:
        with open(path, "w", encoding="utf-8") as out:
            for prompt, text in zip(prompts, texts, strict=True):
                out.write(json.dumps({"prompt": prompt, "completion": text}, ensure_ascii=False) + "\n")
    except OSError as error:
        raise GenerateError(f"rapidtrain generate: --output-file {path}: {error.strerror}") from error


def run(options: GenerateOptions, overrides: list[str]) -> int:
    quiet_library_messages(options.show_library_warnings)
    settings = SamplingSettings(options.max_new_tokens, options.temperature, options.top_k, options.top_p)
    if settings.problems():
        raise GenerateError("rapidtrain generate: " + "; ".join(settings.problems()))
    source = "--prompt" if options.prompt is not None else str(options.input_file)  # one of them (the parser)
    prompts = [options.prompt] if options.prompt is not None else read_prompts(source)
    loaded, runtime = load_model(options, lambda builtin: resolve_runtime(options, builtin), overrides)
    print(first_line(loaded, runtime), file=sys.stderr, flush=True)
    if runtime.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ids = tokenized(loaded, prompts, source)
    generator = torch.Generator(device=runtime.device if not runtime.split_layers else "cuda:0")
    how = Decoding(settings, loaded.tokenizer.vocab_size, loaded.tokenizer.eod, options.kv_cache,
                   generator.manual_seed(options.seed))
    texts = list(completions(loaded, ids, runtime, how))
    if options.output_file:
        write_rows(options.output_file, prompts, texts)
    if options.prompt is not None:
        print(options.prompt + texts[0])
    elif not options.output_file:
        for prompt, text in zip(prompts, texts, strict=True):
            print(json.dumps({"prompt": prompt, "completion": text}, ensure_ascii=False))
    print(f"rapidtrain generate: peak memory {peak_memory(runtime)}", file=sys.stderr, flush=True)
    return 0


def peak_memory(runtime: Runtime) -> str:
    """The process's peak: the GPU's allocations while decoding, or the process's resident set on a CPU."""
    if runtime.device_type == "cuda":
        return f"{torch.cuda.max_memory_allocated() / 2**20:,.1f} MiB allocated on the GPU while decoding"
    import resource

    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.1f} MiB resident (the whole process)"


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes the model's weights and buffers take as loaded (4-bit weights packed two to a byte)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def generate_command(argv: list[str]) -> int:
    """`rapidtrain generate ARGS`; user errors (flags, files, checkpoints) end with status 2 and one message."""
    from rapidtrain.checkpoint.checkpointer import CheckpointError
    from rapidtrain.core.errors import UserError

    namespace, overrides = generation_parser().parse_known_args(argv)
    options = GenerateOptions(**vars(namespace))
    try:
        return run(options, overrides)
    except (UserError, CheckpointError, ValueError) as error:
        message = str(error)
        print(message if message.startswith("rapidtrain generate:") else f"rapidtrain generate: {message}",
              file=sys.stderr)
        return 2
