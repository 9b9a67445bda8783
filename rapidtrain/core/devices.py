"""The GPUs and links the step-time estimate knows: dense 16-bit peak, memory bandwidth, the NVLink bandwidth
inside a node and the InfiniBand bandwidth per GPU between nodes (NVIDIA's datasheets, DGX/HGX systems)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_tflops_16bit: float  # dense bf16/fp16 tensor-core peak, no sparsity
    memory_gib: float
    hbm_gb_per_s: float  # memory bandwidth
    intra_node_gb_per_s: float  # NVLink, per GPU and per direction
    inter_node_gb_per_s: float  # InfiniBand, one NIC per GPU, per direction
    link_names: str  # the links in words, for the plan's assumptions
    gpus_per_node: int = 8


# (name fragments that must all appear in the device's name, spec); more specific entries first.
DEVICES: tuple[tuple[tuple[str, ...], DeviceSpec], ...] = (
    (("B200",), DeviceSpec("B200", 2250.0, 180, 8000, 900, 50, "NVLink 5 (900 GB/s), InfiniBand NDR 400 Gb/s")),
    (("H200",), DeviceSpec("H200 SXM", 989.0, 141, 4800, 450, 50, "NVLink 4 (450 GB/s), InfiniBand NDR 400 Gb/s")),
    (("H100",), DeviceSpec("H100 SXM", 989.0, 80, 3350, 450, 50, "NVLink 4 (450 GB/s), InfiniBand NDR 400 Gb/s")),
    (("A100",), DeviceSpec("A100 SXM 80GB", 312.0, 80, 2039, 300, 25,
                           "NVLink 3 (300 GB/s), InfiniBand HDR 200 Gb/s")),
)


def device_spec(name: str) -> DeviceSpec | None:
    """The table's entry for a device name (torch.cuda.get_device_name() or --device-name), or None."""
    upper = name.upper()
    for fragments, spec in DEVICES:
        if all(fragment in upper for fragment in fragments):
            return spec
    return None


def known_device_names() -> str:
    return ", ".join(spec.name for _, spec in DEVICES)
