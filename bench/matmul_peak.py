"""Measure this machine's dense matmul peak (fp32, bf16, fp16) on CPU or CUDA: the denominator of MFU.

    python bench/matmul_peak.py                       # fp32 and bf16, 2048², the best device here
    python bench/matmul_peak.py --device cpu --size 4096 --dtypes fp32 bf16 fp16

Other benchmarks call `measure_peak_tflops(dtype, device)`, and `measure_gemm_tflops(shapes, ...)` for the rate
of a model's own matrix products (its linear layers' forward and backward at the batch's token count): how
far small GEMMs fall below the square peak, the ceiling of any implementation's MFU at that shape.
"""

from __future__ import annotations

import argparse
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_matmuls(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, count: int) -> float:
    _synchronize(a.device)
    start = time.perf_counter()
    for _ in range(count):
        torch.matmul(a, b, out=out)
    _synchronize(a.device)
    return time.perf_counter() - start


def measure_peak_tflops(
    dtype: torch.dtype,
    device: torch.device | str,
    size: int = 2048,
    min_seconds: float = 0.5,
    repeats: int = 3,
) -> float:
    """Best TFLOP/s of `repeats` timed runs of size×size @ size×size products (2·size³ FLOPs each).

    Each run lasts at least `min_seconds`; the best run is the peak (others lose time to noise).
    On a loaded machine the number is low: compare it with the load average.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds_one = max(_timed_matmuls(a, b, out, 1), 1e-6)  # warm-up, and a first estimate
    if seconds_one >= min_seconds:
        # A dtype without fast kernels here (fp16 on most CPUs) takes minutes: one more run is enough.
        return 2.0 * size**3 / min(seconds_one, _timed_matmuls(a, b, out, 1)) / 1e12
    count = max(1, int(min_seconds / seconds_one))
    best = min(_timed_matmuls(a, b, out, count) / count for _ in range(repeats))
    return 2.0 * size**3 / best / 1e12


def linear_gemm_shapes(hidden: int, ffn: int, vocab: int, layers: int, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every matrix product a GPT's linear layers run in one training step (QKV, projection, fc1,
    fc2 per layer, the head once): each as forward x·Wᵀ, input gradient dy·W and weight gradient dyᵀ·x."""
    shapes = []
    for fan_in, fan_out, count in ((hidden, 3 * hidden, layers), (hidden, hidden, layers), (hidden, ffn, layers),
                                   (ffn, hidden, layers), (hidden, vocab, 1)):
        shapes += [(tokens, fan_in, fan_out), (tokens, fan_out, fan_in), (fan_out, tokens, fan_in)] * count
    return shapes


def measure_gemm_tflops(shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device | str,
                        repeats: int = 5) -> float:
    """TFLOP/s of running each (m, k, n) product of `shapes` once, best of `repeats` passes after a warm-up."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    operands = [(torch.randn(m, k, device=device, generator=generator).to(dtype),
                 torch.randn(k, n, device=device, generator=generator).to(dtype)) for m, k, n in shapes]
    flops = sum(2.0 * m * k * n for m, k, n in shapes)

    def one_pass() -> float:
        _synchronize(device)
        start = time.perf_counter()
        for a, b in operands:
            torch.matmul(a, b)
        _synchronize(device)
        return time.perf_counter() - start

    one_pass()
    return flops / min(one_pass() for _ in range(repeats)) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (default: cuda if present)",
    )
    parser.add_argument("--size", type=int, default=2048, help="matrix side (default 2048)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=sorted(DTYPES),
        default=["fp32", "bf16"],
        help="default fp32 bf16; fp16 on a CPU without fp16 kernels takes minutes (about 0.1 GFLOP/s)",
    )
    parser.add_argument("--min-seconds", type=float, default=0.5, help="length of each timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best is reported")
    parser.add_argument("--allow-tf32", action="store_true", help="let CUDA fp32 products use TF32")
    args = parser.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
    where = f"{args.device} ({torch.get_num_threads()} threads)" if args.device == "cpu" else args.device
    if args.device.startswith("cuda"):
        where = f"{args.device} ({torch.cuda.get_device_name(torch.device(args.device))})"
    print(
        f"matmul peak, {args.size}x{args.size} @ {args.size}x{args.size} on {where}, torch {torch.__version__}"
    )
    for name in args.dtypes:
        tflops = measure_peak_tflops(DTYPES[name], args.device, args.size, args.min_seconds, args.repeats)
        print(f"  {name:>5}: {tflops * 1000:10.1f} GFLOP/s")


if __name__ == "__main__":
    main()
