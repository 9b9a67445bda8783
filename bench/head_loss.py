"""The output head + cross-entropy, forward and backward, alone: the chunked path (models/chunked_loss.py) at several
vocabulary block sizes against the plain path (logits, their fp32 copy, `cross_entropy`), time and peak memory; on
CUDA also the blocks' elementwise work compiled (what --torch-compile runs there), at the default and largest block.

    python bench/head_loss.py                      # GPU: GPT-3 XL's head (hidden 2048, vocabulary 50,304), 8k tokens
    python bench/head_loss.py --tokens 2048 --hidden 384 --device cpu --dtype fp32

Times are medians of --repeats runs after warm-up (CUDA events on a GPU); peak memory is the allocator's peak
above what the inputs hold (CUDA only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def run(o: argparse.Namespace) -> list[tuple[str, float, float | None]]:
    import torch
    import torch.nn.functional as F

    from rapidtrain.models.chunked_loss import block_size, chunked_head_cross_entropy

    device = torch.device(o.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[o.dtype]
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(o.tokens, o.hidden, generator=generator) * 0.5).to(device).requires_grad_()
    weight = (torch.randn(o.vocab, o.hidden, generator=generator) * 0.02).to(device).requires_grad_()
    labels = torch.randint(0, o.vocab, (o.tokens,), generator=generator).to(device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def plain() -> torch.Tensor:
        with autocast:
            logits = F.linear(hidden, weight)
        return F.cross_entropy(logits.float(), labels, reduction="none")

    def chunked(block: int, compiled: tuple[str, None] | None = None):
        def loss() -> torch.Tensor:
            with autocast:
                return chunked_head_cross_entropy(hidden, weight, None, labels, block, compiled=compiled)
        return loss

    default = block_size(o.vocab, o.tokens, device.type)
    variants = {"plain (fp32 logits)": plain, f"chunked, block {default} (default)": chunked(default)}
    for block in o.blocks:
        if block != default:
            variants[f"chunked, block {block}"] = chunked(block)
    if device.type == "cuda":  # the compiled blocks (the first two steps below compile them)
        for block in sorted({default, max([default, *o.blocks])}):
            variants[f"chunked + compiled blocks, block {block}"] = chunked(block, ("inductor", None))
    reference = None
    rows = []
    for name, loss_fn in variants.items():
        def step(loss_fn=loss_fn) -> torch.Tensor:
            hidden.grad = weight.grad = None
            losses = loss_fn()
            losses.mean().backward()
            return losses

        for _ in range(2):
            losses = step()
        if reference is None:
            reference = (losses.detach().float(), hidden.grad.float(), weight.grad.float())
        else:  # every variant computes the same function
            got = (losses.detach().float(), hidden.grad.float(), weight.grad.float())
            for mine, theirs in zip(got, reference, strict=True):
                error = ((mine - theirs).norm() / theirs.norm()).item()
                assert error < 2e-2, f"{name}: relative error {error:.2e} against the plain path"
        times = []
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(o.repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                step()
                times.append(time.perf_counter() - began)
        peak = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else None
        rows.append((name, statistics.median(times), peak))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--blocks", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    o = parser.parse_args(argv)
    import torch

    o.device = o.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = run(o)
    flops = 3 * 2 * o.tokens * o.hidden * o.vocab  # the head's matmuls, forward and backward
    print(f"head + cross-entropy, {o.tokens} tokens x hidden {o.hidden} x vocabulary {o.vocab}, {o.dtype}, "
          f"{torch.cuda.get_device_name() if o.device == 'cuda' else 'CPU'}; matmul work {flops / 1e12:.2f} TFLOP")
    print("| path | forward+backward ms | TFLOP/s | vs plain | peak memory above inputs |")
    print("|---|---|---|---|---|")
    plain_time = rows[0][1]
    for name, seconds, peak in rows:
        memory = f"{peak / 2**20:,.0f} MiB" if peak is not None else "n/a"
        print(f"| {name} | {seconds * 1e3:.2f} | {flops / seconds / 1e12:.0f} | {plain_time / seconds:.2f}x "
              f"| {memory} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
