"""What the plan decides from the device: precision by native capability, TF32, the backends, the timeout and
the peak FLOP/s that MFU is measured against. The capability is given to the plan's context, as a run detects
it once; torch is not mocked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rapidtrain.config import arguments, plan, rules, settings
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.settings import DeviceCapability, RunContext
from rapidtrain.core.peak_flops import known_gpu, peak_flops

BASE = ["--train-iters", "10", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
AMX_CPU = DeviceCapability("AVX512", native_bf16=True)
AVX2_CPU = DeviceCapability("AVX2", native_bf16=False)
H100 = DeviceCapability("NVIDIA H100 80GB HBM3", native_bf16=True)
V100 = DeviceCapability("Tesla V100-SXM2-32GB", native_bf16=False)


def resolve(argv: list[str], capability: DeviceCapability, device: str = "cpu", world: int = 1) -> settings.Plan:
    args = arguments.parse_args(BASE + argv)
    return plan.from_args(args, RunContext(world, device, None, capability))  # type: ignore[arg-type]


# ---- precision by capability ----

def test_mixed_precision_is_bf16_on_a_cpu_with_native_bf16():
    resolved = resolve(["--mixed-precision"], AMX_CPU)
    assert resolved.precision.dtype == "bf16" and resolved.precision.loss_scaling == "none"
    assert "native bf16" in resolved.precision.reason and not resolved.warnings


def test_mixed_precision_is_fp32_on_a_cpu_without_native_bf16_and_says_why():
    resolved = resolve(["--mixed-precision"], AVX2_CPU)
    assert resolved.precision.dtype == "fp32"
    assert "AVX2" in resolved.precision.reason and "100 s" in resolved.precision.reason
    assert "resolves to fp32" in describe_plan(resolved)
    assert not resolved.warnings  # nothing to warn about: the plan chose what runs fast


def test_mixed_precision_is_fp16_with_dynamic_loss_scaling_on_cuda_whatever_the_gpu():
    """Rapidformer's meaning, kept on GPUs with native bf16 too; the plan says why, and there names --bf16."""
    for gpu in (H100, V100):
        resolved = resolve(["--mixed-precision"], gpu, device="cuda")
        precision = resolved.precision
        assert (precision.dtype, precision.loss_scaling) == ("fp16", "dynamic")
        assert "the meaning Rapidformer documents" in precision.reason and precision.reason in describe_plan(resolved)
        assert ("computes bf16 natively: --bf16 trains without loss scaling" in precision.reason) == gpu.native_bf16
        assert ("has no native bf16" in precision.reason) != gpu.native_bf16
    static = resolve(["--mixed-precision", "--loss-scale", "128"], H100, device="cuda").precision
    assert static.loss_scaling == "static 128" and "fp16 autocast with static 128 loss scaling" in static.reason


def test_explicit_bf16_on_a_cpu_without_native_bf16_runs_bf16_and_warns_with_the_cost():
    resolved = resolve(["--bf16"], AVX2_CPU)
    assert resolved.precision.dtype == "bf16"
    (warning,) = resolved.warnings
    assert "AVX2" in warning and "more than 100 s" in warning and "drop --bf16" in warning
    assert f"warning: {warning}" in describe_plan(resolved)


def test_explicit_bf16_on_a_gpu_without_native_bf16_warns_and_names_fp16():
    (warning,) = resolve(["--bf16"], V100, device="cuda").warnings
    assert "V100" in warning and "--fp16" in warning


def test_explicit_bf16_on_native_hardware_does_not_warn():
    assert not resolve(["--bf16"], AMX_CPU).warnings
    assert not resolve(["--bf16"], H100, device="cuda").warnings


def test_the_detected_capability_of_this_machine_is_consistent_with_torch():
    import torch

    detected = settings.detect_capability("cpu")
    assert detected.name == torch.backends.cpu.get_cpu_capability()
    assert detected.native_bf16 == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


# ---- TF32 ----

def test_tf32_applies_on_cuda_and_says_where():
    fp32 = resolve(["--tf32"], H100, device="cuda")
    assert fp32.switches.tf32
    assert "every fp32 matmul" in fp32.engine_for("--tf32").engine
    bf16 = resolve(["--tf32", "--bf16"], H100, device="cuda")
    assert bf16.switches.tf32 and "autocast keeps in fp32" in bf16.engine_for("--tf32").engine


def test_tf32_has_no_effect_on_a_cpu_and_the_plan_says_so():
    resolved = resolve(["--tf32"], AMX_CPU)
    assert not resolved.switches.tf32
    choice = resolved.engine_for("--tf32")
    assert choice.engine == "no effect" and "CPU" in choice.reason


def test_without_tf32_a_cuda_plan_says_it_is_off():
    resolved = resolve([], H100, device="cuda")
    assert not resolved.switches.tf32 and resolved.engine_for("TF32").engine.startswith("off")


# ---- backends and timeout ----

def test_backends_per_device_type_on_cuda_and_gloo_on_cpu():
    cuda = resolve([], H100, device="cuda", world=2)
    assert cuda.distributed.backend == "cpu:gloo,cuda:nccl"
    assert "cuda tensors → nccl" in describe_plan(cuda) and "cpu tensors → gloo" in describe_plan(cuda)
    assert resolve([], AMX_CPU, world=2).distributed.backend == "gloo"
    assert resolve(["--distributed-backend", "gloo"], H100, device="cuda").distributed.backend == "gloo"


def test_distributed_timeout_is_megatrons_ten_minutes_by_default_and_a_flag():
    assert resolve([], AMX_CPU).distributed.timeout_minutes == 10
    resolved = resolve(["--distributed-timeout-minutes", "60"], AMX_CPU)
    assert resolved.distributed.timeout_minutes == 60 and "after 60 minutes" in describe_plan(resolved)


def test_a_zero_timeout_is_refused_naming_the_flag():
    args = arguments.parse_args(BASE + ["--distributed-timeout-minutes", "0"])
    assert any("--distributed-timeout-minutes 0" in m for m in rules.violations(args, RunContext()))


# ---- peak FLOP/s and MFU ----

@pytest.mark.parametrize(
    "device_name,dtype,tf32,expected",
    [
        ("NVIDIA A100-SXM4-80GB", "bf16", False, 312.0),
        ("NVIDIA A100 80GB PCIe", "fp32", True, 156.0),
        ("NVIDIA A100-SXM4-40GB", "fp32", False, 19.5),
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989.0),
        ("NVIDIA H100 80GB HBM3", "fp16", False, 989.0),
        ("NVIDIA H100 80GB HBM3", "fp32", True, 494.0),
        ("NVIDIA H100 PCIe", "bf16", False, 756.0),
        ("NVIDIA H100 NVL", "bf16", False, 835.0),
        ("NVIDIA H200", "bf16", False, 989.0),
        ("NVIDIA H200", "fp32", True, 494.0),
        ("NVIDIA GH200 480GB", "bf16", False, 989.0),
        ("NVIDIA B200", "bf16", False, 2250.0),
        ("NVIDIA B200", "fp16", False, 2250.0),
        ("NVIDIA B200", "fp32", True, 1125.0),
    ],
)
def test_known_gpus_peaks_by_precision(device_name, dtype, tf32, expected):
    assert peak_flops("cuda", device_name, dtype, tf32, None).tflops == expected


def test_the_peak_is_in_the_plan_and_the_log_reports_mfu_on_a_known_gpu():
    resolved = resolve(["--bf16"], H100, device="cuda")
    assert resolved.logging.peak_tflops == 989.0
    assert "MFU: against 989 TFLOP/s" in describe_plan(resolved) and "H100 SXM" in describe_plan(resolved)


def test_peak_tflops_overrides_detection():
    resolved = resolve(["--bf16", "--peak-tflops", "700"], H100, device="cuda")
    assert resolved.logging.peak_tflops == 700.0 and "--peak-tflops 700" in resolved.logging.peak_source


def test_no_peak_on_a_cpu_or_an_unknown_gpu_and_the_plan_says_how_to_get_one():
    cpu = resolve([], AMX_CPU)
    assert cpu.logging.peak_tflops is None and "MFU: not reported" in describe_plan(cpu)
    unknown = resolve([], DeviceCapability("Tesla T4"), device="cuda")
    assert unknown.logging.peak_tflops is None and "Tesla T4" in unknown.logging.peak_source
    assert known_gpu("Tesla T4") is None


def test_plan_command_for_cuda_names_backends_optimizer_tf32_and_mfu():
    out = subprocess.run(
        [sys.executable, "-m", "rapidtrain.cli", "plan", *BASE, "--device", "cuda", "--device-name", "NVIDIA H100",
         "--world-size", "8", "--tensor-model-parallel-size", "2", "--bf16", "--tf32"],
        capture_output=True, text=True, check=True).stdout
    assert "cuda tensors → nccl" in out and "optimizer" in out
    assert "--tf32" in out and "autocast keeps in fp32" in out
    assert "MFU: against 989 TFLOP/s" in out


# ---- where the built-in model is built ----

@pytest.mark.parametrize(
    "flags,world,on_meta",
    [
        (["--fsdp-memory-optimization"], 2, True),
        (["--oss-sdp-memory-optimization"], 2, True),
        (["--zero-3-memory-optimization"], 2, True),
        (["--tensor-model-parallel-size", "2"], 2, True),
        (["--pipeline-model-parallel-size", "2"], 2, True),
        (["--pipeline-model-parallel-size", "2", "--zero-1-memory-optimization"], 4, True),
        ([], 2, False),  # DDP: every rank holds the whole model anyway
        (["--oss-memory-optimization"], 2, False),
        (["--zero-2-memory-optimization"], 2, False),
        (["--fsdp-memory-optimization"], 1, False),  # one rank: nothing to shard over
        (["--sharding-backend", "fairscale", "--oss-sdp-memory-optimization"], 2, False),  # ShardedDDP: whole
    ],
)
def test_sharded_layouts_build_the_builtin_model_on_meta(flags, world, on_meta):
    resolved = resolve(flags, AMX_CPU, world=world)
    assert resolved.switches.build_on_meta == on_meta
    construction = resolved.engine_for("model construction")
    assert (construction is not None and "meta device" in construction.engine or "zero.Init" in construction.engine
            ) if on_meta else (construction is None or "whole" in construction.engine)


def test_expert_parallelism_builds_whole_and_says_why():
    resolved = resolve(["--tensor-model-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size",
                        "2"], AMX_CPU, world=4)
    assert not resolved.switches.build_on_meta
    assert "expert parallelism" in resolved.engine_for("model construction").engine


def test_a_user_script_builds_its_own_model():
    args = arguments.parse_args(BASE + ["--fsdp-memory-optimization"])
    resolved = plan.from_args(args, RunContext(2, "cpu", "my_script.py", AMX_CPU))
    assert not resolved.switches.build_on_meta and resolved.engine_for("model construction") is None
