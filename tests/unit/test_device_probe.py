"""The device probe (core/device_probe.py) answers as torch does, without importing torch: checked against torch on
the machine that runs the tests, and on machines described by a folder tree (/dev, /proc) for what this one is not
(GPU nodes, containers, ROCm, CUDA_VISIBLE_DEVICES)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from rapidtrain.core import device_probe
from rapidtrain.core.device_probe import Probe, probe
from tests.launch import REPO, child_env

AVX512_AMX = "fpu sse avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16 amx_tile amx_bf16"
AVX2_ONLY = "fpu sse avx avx2 fma"


def machine(tmp_path: Path, gpus: dict[int, str] | None = None, nodes: list[int] | None = None,
            flags: str = AVX2_ONLY, kfd: bool = False) -> Path:
    """A root folder with the files the probe reads: /dev/nvidiaN nodes, the driver's per-GPU information files,
    /proc/cpuinfo."""
    gpus = gpus or {}
    (tmp_path / "dev").mkdir()
    for minor in gpus if nodes is None else nodes:
        (tmp_path / "dev" / f"nvidia{minor}").touch()
    (tmp_path / "dev" / "nvidiactl").touch()
    if kfd:
        (tmp_path / "dev" / "kfd").touch()
    for minor, model in gpus.items():
        folder = tmp_path / "proc" / "driver" / "nvidia" / "gpus" / f"0000:{minor + 0x18:02x}:00.0"
        folder.mkdir(parents=True)
        (folder / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 42\nDevice Minor: \t {minor}\n")
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "proc" / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
                                               f"flags\t\t: {flags}\n")
    return tmp_path


@pytest.fixture
def cuda_build(monkeypatch):
    monkeypatch.setattr(device_probe, "torch_built_with_cuda", lambda: True)


H100 = "NVIDIA H100 80GB HBM3"


def test_the_probe_answers_as_torch_does_on_this_machine():
    import torch

    found = probe()
    if sys.platform == "linux" and platform.machine() == "x86_64" and not torch.cuda.is_available():
        assert found is not None  # the plan and the launcher of a CPU machine never ask torch
    if found is None:
        pytest.skip("the probe leaves this machine to torch")
    cuda = torch.cuda.is_available()
    assert found.device_type == ("cuda" if cuda else "cpu")
    if cuda:
        assert (found.device_count, found.name) == (torch.cuda.device_count(), torch.cuda.get_device_name())
        assert found.native_bf16 == torch.cuda.is_bf16_supported(including_emulation=False)
    else:
        assert found.name == torch.backends.cpu.get_cpu_capability()
        assert found.native_bf16 == bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        assert device_probe.torch_built_with_cuda() == (torch.version.cuda is not None)


def test_plan_and_launcher_detection_imports_no_torch_where_the_probe_answers():
    code = ("import sys; from rapidtrain.config.settings import RunContext; from rapidtrain.core.device_probe import "
            "probe; ctx = RunContext.detect(); print(probe() is not None, 'torch' in sys.modules, ctx.device_type)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=child_env(),
                            timeout=120)
    answered, imported, _ = result.stdout.split()
    assert result.returncode == 0 and (answered == "False" or imported == "False"), result.stdout + result.stderr


def test_a_gpu_node_of_one_known_model(tmp_path, cuda_build):
    root = machine(tmp_path, {minor: H100 for minor in range(8)})
    assert probe(root, {}) == Probe("cuda", 8, H100, True)
    assert probe(root, {"CUDA_VISIBLE_DEVICES": "2,3"}) == Probe("cuda", 2, H100, True)
    assert probe(root, {"CUDA_VISIBLE_DEVICES": "6,7,9,1"}) == Probe("cuda", 2, H100, True)  # CUDA stops at 9


def test_a_container_counts_only_its_own_device_nodes(tmp_path, cuda_build):
    """The driver's /proc lists every GPU of the host; a container's /dev holds the nodes of its own."""
    root = machine(tmp_path, {minor: H100 for minor in range(8)}, nodes=[4, 5])
    assert probe(root, {}) == Probe("cuda", 2, H100, True)


def test_no_visible_gpu_or_a_cpu_build_of_torch_is_a_cpu_machine(tmp_path, cuda_build, monkeypatch):
    root = machine(tmp_path, {0: H100}, flags=AVX512_AMX)
    assert probe(root, {"CUDA_VISIBLE_DEVICES": ""}) == Probe("cpu", 0, "AVX512", True)
    monkeypatch.setattr(device_probe, "torch_built_with_cuda", lambda: False)
    assert probe(root, {}) == Probe("cpu", 0, "AVX512", True)


@pytest.mark.parametrize(("flags", "name", "native"), [
    (AVX512_AMX, "AVX512", True), (AVX2_ONLY, "AVX2", False), ("fpu sse avx", "DEFAULT", False),
    ("avx2 fma avx512f avx512dq avx512bw", "AVX2", False),  # no VL: torch does not dispatch AVX512 kernels
    ("avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16", "AVX512", True),
])
def test_cpu_instruction_set_and_native_bf16_from_its_flags(tmp_path, flags, name, native):
    assert probe(machine(tmp_path, flags=flags), {}) == Probe("cpu", 0, name, native)


@pytest.mark.parametrize("case", ["unknown model", "two models", "uuid", "rocm", "capability override", "arm",
                                  "missing information"])
def test_what_only_torch_can_answer_is_left_to_it(tmp_path, cuda_build, case):
    gpus = {0: H100, 1: "NVIDIA GeForce GTX 1080"} if case == "two models" else {
        0: "NVIDIA Tesla T4" if case == "unknown model" else H100}
    root = machine(tmp_path, gpus, nodes=[0, 1] if case == "missing information" else None, kfd=case == "rocm")
    env = {"CUDA_VISIBLE_DEVICES": "GPU-6f1e2c1a-0000"} if case == "uuid" else {}
    if case in ("capability override", "arm"):
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.update({"ATEN_CPU_CAPABILITY": "avx2"} if case == "capability override" else {})
        if case == "arm":
            (root / "proc" / "cpuinfo").write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16\n")
    assert probe(root, env) is None


def test_torch_version_file_is_read_as_text(tmp_path, monkeypatch):
    import importlib.machinery

    package = tmp_path / "torch"
    package.mkdir()
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.setattr(device_probe.importlib.util, "find_spec", lambda name: spec)
    for text, expected in [("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\nhip = None\n", True),
                           ("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n",
                            False),
                           ("cuda = None\nhip: Optional[str] = '6.2.4'\n", None), ("raise SystemExit\n", None)]:
        (package / "version.py").write_text(text)
        assert device_probe.torch_built_with_cuda() is expected, text
