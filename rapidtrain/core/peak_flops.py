"""Peak dense TFLOP/s of the GPUs rapidtrain knows, per precision, so that MFU is in every log line on them.

Numbers are NVIDIA's datasheet figures without sparsity (tensor cores for bf16/fp16/tf32, CUDA cores for fp32).
`--peak-tflops` overrides them (another GPU, a power cap, a measured peak).
"""

from __future__ import annotations

from dataclasses import dataclass

# (name fragments that must all appear in torch.cuda.get_device_name(), shown name, {precision: TFLOP/s}).
# More specific entries come first: "GH200" before "H200", "H100 PCIe" before "H100".
KNOWN_GPUS: tuple[tuple[tuple[str, ...], str, dict[str, float]], ...] = (
    (("GH200",), "GH200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    (("H200", "NVL"), "H200 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    (("H200",), "H200 SXM", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    (("H100", "PCIE"), "H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (("H100", "NVL"), "H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    (("H100",), "H100 SXM", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    (("B200",), "B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0, "fp32": 75.0}),
    (("A100",), "A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
)


@dataclass(frozen=True)
class PeakFlops:
    tflops: float | None
    source: str  # how the number was found, in words for the plan


def compute_precision(dtype: str, tf32: bool) -> str:
    """The precision the matmuls run in: the autocast dtype, or fp32 on TF32 tensor cores with --tf32."""
    if dtype in ("bf16", "fp16"):
        return dtype
    return "tf32" if tf32 else "fp32"


def known_gpu(device_name: str) -> tuple[str, dict[str, float]] | None:
    upper = device_name.upper()
    for fragments, shown, peaks in KNOWN_GPUS:
        if all(fragment in upper for fragment in fragments):
            return shown, peaks
    return None


def peak_flops(device_type: str, device_name: str, dtype: str, tf32: bool, given: float | None) -> PeakFlops:
    """The peak MFU is measured against: `--peak-tflops`, else the table's for a known GPU, else none."""
    precision = compute_precision(dtype, tf32)
    if given:
        return PeakFlops(given, f"--peak-tflops {given:g}")
    if device_type != "cuda":
        return PeakFlops(None, "no peak is known for a CPU: give --peak-tflops (bench/matmul_peak.py measures "
                               "one) to see MFU")
    found = known_gpu(device_name)
    if found is None:
        named = f"{device_name!r}" if device_name else "this GPU (not known until the run starts)"
        return PeakFlops(None, f"{named} is not in the table of known GPUs (A100, H100, H200, GH200, B200): give "
                               "--peak-tflops to see MFU")
    shown, peaks = found
    return PeakFlops(peaks[precision], f"{shown} dense {precision} peak (NVIDIA datasheet), detected")
