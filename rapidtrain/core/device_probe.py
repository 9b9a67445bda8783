"""What device this process would train on, read from the operating system without torch, or None where that cannot
be certain, and the caller asks torch. The processes that plan but do not train (`rapidtrain plan`, the launcher
before torchrun) then never initialise CUDA: on a GPU node that costs time and starts the driver's threads, and a
launcher with threads cannot fork its torchrun (core/shutdown.py: it execs a new interpreter instead, about 1 s).
Where the probe answers, `rapidtrain plan` imports no torch at all (parameter shapes come from models/counting.py),
unless NVIDIA apex is installed: checking that its fused optimizers load imports it, and it imports torch.

- CUDA: torch built with CUDA (its version file, read as text), NVIDIA device nodes (/dev/nvidiaN: a container sees
  only its own), each GPU's model from the driver (/proc/driver/nvidia/gpus/*/information), CUDA_VISIBLE_DEVICES
  as indices. The GPUs must be one known model (core/peak_flops.py), so that bf16 is known to be native.
- CPU (x86-64 Linux): the instruction set torch dispatches to (AVX512 needs F, BW, VL and DQ; AVX2 needs FMA too)
  and native bf16 (AVX512-BF16 or AMX tiles), from /proc/cpuinfo's flags.

Anything else (ROCm, another GPU model, CUDA_VISIBLE_DEVICES by UUID, ATEN_CPU_CAPABILITY set, Arm, macOS): None.
tests/unit/test_device_probe.py checks the answer against torch's on the machine that runs it.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from rapidtrain.core.peak_flops import known_gpu


@dataclass(frozen=True)
class Probe:
    device_type: str  # "cuda" or "cpu"
    device_count: int  # CUDA devices visible (0 on a CPU)
    name: str  # the GPU's model, or the CPU's instruction set ("AVX512", "AVX2", "DEFAULT")
    native_bf16: bool


def probe(root: Path = Path("/"), env: dict[str, str] | None = None) -> Probe | None:
    """The device, or None when only torch can tell. `root` and `env` let tests describe another machine."""
    env = dict(os.environ) if env is None else env
    cuda_build = torch_built_with_cuda()
    if cuda_build is None or (root / "dev" / "kfd").exists():  # unknown build, or an AMD GPU (ROCm's torch.cuda)
        return None
    gpus = nvidia_gpus(root) if cuda_build else {}
    if gpus is None:
        return None
    visible = visible_gpus(sorted(gpus), env)
    if visible is None:
        return None
    if visible:
        names = {gpus[minor] for minor in visible}
        if len(names) != 1 or known_gpu(next(iter(names))) is None:
            return None
        return Probe("cuda", len(visible), names.pop(), native_bf16=True)  # every known model is Ampere or newer
    return cpu_probe(root, env)


def torch_built_with_cuda() -> bool | None:
    """Whether the installed torch is a CUDA build, from torch/version.py read as text (never imported)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None
    cuda = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*(\S+)", text, re.MULTILINE)
    hip = re.search(r"^hip\s*(?::[^=\n]*)?=\s*(\S+)", text, re.MULTILINE)
    if cuda is None or (hip is not None and hip.group(1) != "None"):
        return None
    return cuda.group(1) != "None"


def nvidia_gpus(root: Path) -> dict[int, str] | None:
    """Device minor → model of the NVIDIA GPUs this process has a device node for, one it may open ({} without the
    driver)."""
    nodes = {int(match.group(1)) for path in (root / "dev").glob("nvidia*")
             if (match := re.fullmatch(r"nvidia(\d+)", path.name)) and os.access(path, os.R_OK | os.W_OK)}
    if not nodes:
        return {}
    models: dict[int, str] = {}
    for path in sorted((root / "proc" / "driver" / "nvidia" / "gpus").glob("*/information")):
        try:
            fields = dict(line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
        except OSError:
            return None
        minor, model = fields.get("Device Minor", "").strip(), fields.get("Model", "").strip()
        if minor.isdigit() and int(minor) in nodes and model:
            models[int(minor)] = model
    return models if len(models) == len(nodes) else None


def visible_gpus(minors: list[int], env: dict[str, str]) -> list[int] | None:
    """The minors CUDA_VISIBLE_DEVICES leaves (indices into the bus order, which device minors follow on a
    typical node); None when it names GPUs otherwise (UUIDs, MIG instances)."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return minors
    if given.strip() in ("", "-1"):
        return []
    chosen = []
    for item in given.split(","):
        if not item.strip().isdigit():
            return None
        index = int(item)
        if index >= len(minors):
            break  # CUDA stops at the first index that names no device
        chosen.append(minors[index])
    return chosen


def cpu_probe(root: Path, env: dict[str, str]) -> Probe | None:
    if "ATEN_CPU_CAPABILITY" in env:
        return None
    try:
        cpuinfo = (root / "proc" / "cpuinfo").read_text()
    except OSError:
        return None
    line = re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE)
    if line is None:  # not x86 (Arm's lines are "Features")
        return None
    flags = set(line.group(1).split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        name = "AVX512"
    elif {"avx2", "fma"} <= flags:
        name = "AVX2"
    else:
        name = "DEFAULT"
    return Probe("cpu", 0, name, native_bf16=bool({"avx512_bf16", "amx_tile"} & flags))
