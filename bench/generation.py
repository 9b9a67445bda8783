"""Generation speed of `rapidtrain generate`'s decoding beside Hugging Face's `generate` on the same model.

A built-in GPT (Llama-family by default, random weights) is exported with the project's own exporter
(rapidtrain.models.hf_weights.save_hf_folder) and loaded back by transformers' AutoModelForCausalLM; both then decode
the same prompts greedily in one process, setting after setting (batch 1 and 4, fp32 and bf16 where the CPU has it
natively, sdpa and eager attention; then rapidtrain's --torch-compile, its static KV cache and compiled one-token
step, beside the same uncompiled HF generate; --no-compile skips those rows). The sides take turns run by run, so
load from other processes on a shared machine falls on both alike. Per setting and side: tokens/s over all new
tokens of the batch, time to first token (prefill + one token), and peak resident memory added while decoding (RSS
sampled every millisecond); and whether both chose the same tokens (required in fp32; in bf16 the two round
differently).

    python bench/generation.py                         # the default model (~30M parameters)
    python bench/generation.py --hidden-size 64 --num-layers 2 --vocab-size 256 --new-tokens 4 --repeats 1
    python bench/generation.py --hidden-size 256 --num-layers 4 --vocab-size 8192 --prompt-length 32 \
        --new-tokens 32                                # the shape issue 27 was measured at
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.machine import cpu_name  # noqa: E402


@dataclass(frozen=True)
class Setting:
    batch: int
    dtype: str
    attention: str
    compiled: bool = False  # rapidtrain's --torch-compile (static KV cache, compiled step); HF runs uncompiled

    @property
    def name(self) -> str:
        return f"batch {self.batch}, {self.dtype}, {self.attention}" + (", torch.compile" if self.compiled else "")


class PeakRss:
    """The largest resident set seen while the block runs, minus the resident set when it started (bytes)."""

    def __enter__(self) -> PeakRss:
        self.start = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    @property
    def added_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5,
                        help="Timed runs per side and setting, the sides taking turns (the best is kept).")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="Skip the rows of rapidtrain's --torch-compile (each compiles its step first).")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default).")
    parser.add_argument("--json", help="Also write the rows here.")
    return parser.parse_args(argv)


def build(args: argparse.Namespace, folder: Path) -> tuple[torch.nn.Module, Path]:
    """The built-in model and its Hugging Face export (written by the project's exporter)."""
    from rapidtrain.models import ModelConfig, build_model
    from rapidtrain.models.hf_weights import save_hf_folder

    shape = dict(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                 vocab_size=args.vocab_size, seq_length=args.prompt_length + args.new_tokens, hidden_dropout=0.0,
                 attention_dropout=0.0, max_position_embeddings=args.prompt_length + args.new_tokens)
    if args.family == "llama":
        shape |= dict(normalization="RMSNorm", swiglu=True, num_query_groups=args.num_attention_heads // 2,
                      add_bias_linear=False, position_embedding_type="rope", tie_embeddings=False)
    model = build_model(ModelConfig(**shape), seed=1).eval()
    save_hf_folder(model.state_dict(), model.config, folder)
    return model, folder


def rapidtrain_side(model: torch.nn.Module, setting: Setting):
    """A function prompt → new tokens [b, n] running rapidtrain's decoding loop on the built-in model."""
    import dataclasses

    from rapidtrain.models import build_model
    from rapidtrain.models.attention_backends import KERNEL_OF_NAME
    from rapidtrain.models.transformer import KVCache
    from rapidtrain.train.generation import Decoding, SamplingSettings, decode
    from rapidtrain.train.generation.decoding import builtin_forward
    from rapidtrain.train.generation.static import compiled_step, decode_static

    config = dataclasses.replace(model.config, attention_kernel=KERNEL_OF_NAME[setting.attention])
    copy = build_model(config, seed=None)
    copy.load_state_dict(model.state_dict())
    copy = copy.to(torch.bfloat16 if setting.dtype == "bf16" else torch.float32).eval()
    forward = builtin_forward(copy)
    if setting.compiled:
        step = compiled_step(copy, "cpu")

        def run_compiled(prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
            how = Decoding(SamplingSettings(new_tokens))
            return decode_static(forward, step, prompt, torch.ones_like(prompt), how)

        return run_compiled

    def run(prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return decode(forward, prompt, torch.ones_like(prompt), Decoding(SamplingSettings(new_tokens)), KVCache)

    return run


def hf_side(folder: Path, setting: Setting):
    """The same, through transformers' generate on the exported folder."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    dtype = torch.bfloat16 if setting.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                                 attn_implementation=setting.attention).eval()

    def run(prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[:, prompt.shape[1]:]

    return run


def measure(runs: dict[str, Callable], prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, dict]:
    """Per side: tokens/s and time to first token (best of `repeats`), peak memory added and the tokens chosen.
    The sides take turns run by run, so that load from other processes on a shared machine falls on each alike."""
    for run in runs.values():
        run(prompt, 2)  # warm-up: first-call allocations and dispatch
    first = {name: float("inf") for name in runs}
    best = {name: float("inf") for name in runs}
    peak = {name: 0.0 for name in runs}
    tokens: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            first[name] = min(first[name], _timed(run, prompt, 1)[0])
            with PeakRss() as rss:
                seconds, tokens[name] = _timed(run, prompt, new_tokens)
            best[name], peak[name] = min(best[name], seconds), max(peak[name], rss.added_mib)
    return {name: {"tokens_per_s": tokens[name].numel() / best[name], "first_token_ms": first[name] * 1000,
                   "peak_mib": peak[name], "tokens": tokens[name].tolist()} for name in runs}


def _timed(run, prompt: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    tokens = run(prompt, new_tokens)
    return time.perf_counter() - start, tokens


def settings(compiled: bool) -> list[Setting]:
    chosen = [Setting(1, "fp32", "sdpa"), Setting(4, "fp32", "sdpa"), Setting(1, "fp32", "eager")]
    dtypes = ["fp32"]
    if torch.cpu._is_avx512_bf16_supported():
        chosen += [Setting(1, "bf16", "sdpa"), Setting(4, "bf16", "sdpa")]
        dtypes.append("bf16")
    if compiled:
        chosen += [Setting(batch, dtype, "sdpa", compiled=True) for dtype in dtypes for batch in (1, 4)]
    return chosen


def bench(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model, folder = build(args, Path(tmp) / "hf")
        generator = torch.Generator().manual_seed(0)
        for setting in settings(args.compile):
            prompt = torch.randint(0, args.vocab_size, (setting.batch, args.prompt_length), generator=generator)
            runs = {"rapidtrain": rapidtrain_side(model, setting), "hf": hf_side(folder, setting)}
            measured = measure(runs, prompt, args.new_tokens, args.repeats)
            ours, theirs = measured["rapidtrain"], measured["hf"]
            rows.append({"setting": setting.name, "rapidtrain": ours, "hf": theirs,
                         "same_tokens": ours.pop("tokens") == theirs.pop("tokens")})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| setting | rapidtrain tok/s | HF tok/s | ratio | rapidtrain TTFT ms | HF TTFT ms | rapidtrain peak "
             "MiB | HF peak MiB | same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ours, theirs = row["rapidtrain"], row["hf"]
        lines.append(f"| {row['setting']} | {ours['tokens_per_s']:.0f} | {theirs['tokens_per_s']:.0f} | "
                     f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x | {ours['first_token_ms']:.1f} | "
                     f"{theirs['first_token_ms']:.1f} | {ours['peak_mib']:.1f} | {theirs['peak_mib']:.1f} | "
                     f"{'yes' if row['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = bench(args)
    print(f"generation: {args.family}, hidden {args.hidden_size}, {args.num_layers} layers, vocab {args.vocab_size}, "
          f"prompt {args.prompt_length} + {args.new_tokens} new tokens, greedy; CPU: {cpu_name()}, "
          f"{torch.get_num_threads()} threads; torch {torch.__version__}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    # fp32 must agree token for token; bf16 rounds differently in each implementation (rotary angles, norms), so a
    # near tie may go either way there: reported, not required.
    return 0 if all(row["same_tokens"] for row in rows if "fp32" in row["setting"]) else 1


if __name__ == "__main__":
    sys.exit(main())
