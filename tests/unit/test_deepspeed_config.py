"""DeepSpeed's configuration generated from the plan: batch arithmetic, clipping, ZeRO stage, precision and
ZeRO-Offload's optimizer; and DeepSpeed's own config parser accepts it."""

from __future__ import annotations

import pytest

from rapidtrain.config import arguments, plan
from rapidtrain.config.settings import RunContext
from rapidtrain.models.transformer import canonical_name
from rapidtrain.parallel.deepspeed import deepspeed_config, offload_optimizer_config

BASE = ["--train-iters", "10", "--lr", "1e-4", "--micro-batch-size", "2", "--global-batch-size", "8"]


def config_for(argv: list[str], world: int = 2, device: str = "cpu") -> dict:
    args = arguments.parse_args(BASE + argv)
    resolved = plan.from_args(args, RunContext(world, device))  # type: ignore[arg-type]
    return deepspeed_config(resolved, resolved.optimizer, resolved.clip_grad, resolved.loss_scale)


def test_batch_arithmetic_clipping_and_stage_come_from_the_plan():
    config = config_for(["--zero-2-memory-optimization"])
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
        config["train_batch_size"],
    ) == (2, 2, 8)
    assert config["gradient_clipping"] == 1.0
    assert config["zero_optimization"] == {  # DeepSpeed's documented bucket sizes, with communication overlapped
        "stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000}
    assert not {"bf16", "fp16", "optimizer", "scheduler"} & set(config)  # rapidtrain's optimizer and schedule


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_zero_flag_sets_its_stage(stage):
    assert config_for([f"--zero-{stage}-memory-optimization"])["zero_optimization"]["stage"] == stage


def test_clip_grad_zero_turns_clipping_off():
    assert config_for(["--zero-1-memory-optimization", "--clip-grad", "0"])["gradient_clipping"] == 0.0


@pytest.mark.parametrize("flag", ["--bf16", "--mixed-precision"])
def test_bf16_is_deepspeeds_bf16_mode_on_cpu(flag):
    assert config_for(["--zero-2-memory-optimization", flag])["bf16"] == {"enabled": True}


def test_fp16_carries_the_loss_scale_flags():
    dynamic = config_for(
        [
            "--zero-2-memory-optimization",
            "--fp16",
            "--loss-scale-window",
            "500",
            "--hysteresis",
            "3",
            "--min-loss-scale",
            "4",
            "--initial-loss-scale",
            "65536",
        ],
        device="cuda",
    )["fp16"]
    assert dynamic == {
        "enabled": True,
        "loss_scale": 0.0,
        "initial_scale_power": 16,
        "loss_scale_window": 500,
        "hysteresis": 3,
        "min_loss_scale": 4.0,
        "consecutive_hysteresis": False,
    }
    static = config_for(["--zero-2-memory-optimization", "--fp16", "--loss-scale", "128"], device="cuda")[
        "fp16"
    ]
    assert static["loss_scale"] == 128.0


def test_cpu_offload_has_deepspeed_build_cpu_adam_from_the_flags():
    config = config_for(
        [
            "--zero-2-memory-optimization",
            "--cpu-offload",
            "--lr",
            "3e-4",
            "--adam-beta2",
            "0.95",
            "--adam-eps",
            "1e-6",
            "--weight-decay",
            "0.1",
        ]
    )
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}  # CPU run
    assert config["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1, "adam_w_mode": True},
    }


def test_offload_keeps_l2_weight_decay_for_an_adam_settings_object():
    from rapidtrain.optim.optimizers import OptimizerSettings

    adam = offload_optimizer_config(OptimizerSettings(name="adam", lr=1e-3))
    assert adam["type"] == "Adam" and adam["params"]["adam_w_mode"] is False  # as torch.optim.Adam


def test_offload_refuses_an_optimizer_cpu_adam_cannot_run():
    from rapidtrain.optim.optimizers import OptimizerSettings

    with pytest.raises(ValueError, match="--cpu-offload"):
        offload_optimizer_config(OptimizerSettings(name="sgd"))


def test_config_needs_a_zero_plan():
    with pytest.raises(ValueError, match="not a DeepSpeed ZeRO stage"):
        config_for(["--fsdp-memory-optimization"])


def test_deepspeed_parses_the_generated_config():
    """DeepSpeed's own parser (one process: world size 1) checks the batch equation and reads every field."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(
        config_for(["--zero-2-memory-optimization", "--cpu-offload", "--bf16", "--clip-grad", "0.5"], world=1)
    )
    assert (parsed.train_batch_size, parsed.gradient_accumulation_steps) == (8, 4)
    assert parsed.zero_optimization_stage == 2 and parsed.gradient_clipping == 0.5
    assert parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
    assert parsed.zero_config.offload_optimizer.device == "cpu"
    assert parsed.optimizer_name == "adamw" and parsed.optimizer_params["lr"] == 1e-4


def test_checkpoint_names_drop_wrapper_prefixes():
    assert (
        canonical_name("layers.0._checkpoint_wrapped_module.mlp._orig_mod.fc1.weight")
        == "layers.0.mlp.fc1.weight"
    )


def test_fp16_loss_scaler_state_round_trips_in_rapidtrains_keys():
    """DeepSpeed's dynamic loss scaler is checkpointed as Megatron's (scale, growth, hysteresis) and continues
    the same after loading into a fresh scaler."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from rapidtrain.parallel.deepspeed_state import load_loss_scaler_state, loss_scaler_state

    def scaler(initial: float) -> DynamicLossScaler:
        return DynamicLossScaler(
            init_scale=initial, scale_window=3, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False
        )

    saved = scaler(2.0**16)
    for _ in range(5):
        saved.update_scale(False)
    state = loss_scaler_state(saved)
    assert state == {"scale": 2.0**17, "growth_tracker": 2, "hysteresis_tracker": 2}
    loaded = scaler(1.0)
    load_loss_scaler_state(loaded, state)
    scales = []
    for _ in range(4):
        saved.update_scale(False)
        loaded.update_scale(False)
        scales.append((saved.cur_scale, loaded.cur_scale))
    assert scales == [(2.0**17, 2.0**17), (2.0**18, 2.0**18), (2.0**18, 2.0**18), (2.0**18, 2.0**18)]


def test_communication_settings_come_from_the_flags():
    zero = config_for(["--zero-2-memory-optimization", "--no-zero-overlap-comm", "--no-zero-contiguous-gradients",
                       "--zero-reduce-bucket-size", "20000000", "--zero-allgather-bucket-size", "30000000"])[
        "zero_optimization"]
    assert (zero["overlap_comm"], zero["contiguous_gradients"]) == (False, False)
    assert (zero["reduce_bucket_size"], zero["allgather_bucket_size"]) == (20_000_000, 30_000_000)


def test_stage3_gets_its_prefetch_and_persistence_settings():
    zero = config_for(["--zero-3-memory-optimization", "--zero-stage3-prefetch-bucket-size", "1000",
                       "--zero-stage3-param-persistence-threshold", "10", "--zero-stage3-max-live-parameters", "99"])[
        "zero_optimization"]
    assert (zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"],
            zero["stage3_max_live_parameters"]) == (1000, 10, 99)
    assert "allgather_bucket_size" not in zero  # a stage 1/2 setting


def test_offload_pins_host_memory_on_cuda_only():
    flags = ["--zero-3-memory-optimization", "--cpu-offload", "--cpu-offload-params", "--bf16"]
    cuda = config_for(flags, device="cuda")["zero_optimization"]
    assert cuda["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert cuda["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert config_for(flags)["zero_optimization"]["offload_param"]["pin_memory"] is False


def test_nvme_offload_sends_optimizer_state_and_parameters_to_the_directory(tmp_path):
    config = config_for(["--zero-3-memory-optimization", "--nvme-offload-dir", str(tmp_path)])
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": False, "nvme_path": str(tmp_path)}
    # max_in_cpu 0: DeepSpeed's default (1e9 elements) would keep any model under a billion parameters in RAM.
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": False, "nvme_path": str(tmp_path),
                                     "max_in_cpu": 0}
    assert config["optimizer"]["type"] == "AdamW" and config["aio"]["block_size"] == 1_048_576


def test_nvme_buffers_hold_the_largest_parameter():
    from torch import nn

    from rapidtrain.parallel.deepspeed import NVME_MIN_BUFFER, size_nvme_buffers

    config = config_for(["--zero-3-memory-optimization", "--nvme-offload-dir", "d"])
    size_nvme_buffers(config, nn.Sequential(nn.Linear(512, 1024), nn.Linear(4, 4)), world_size=2)
    offload = config["zero_optimization"]["offload_param"]
    assert offload["buffer_size"] == max(512 * 1024, NVME_MIN_BUFFER)
    # One shard is large enough to be swapped (512 × 1024 / 2 ranks ≥ one 1 MiB block): one buffer serves it.
    assert offload["buffer_count"] == 1
    many = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])  # 12 swapped shards, window 50e6 / 1M + 2
    size_nvme_buffers(config, many, world_size=1)
    assert offload["buffer_count"] == 12


@pytest.mark.parametrize(
    "environment, world, expected",
    [
        ({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"}, 1, "cores"),  # torchrun's 1 is not a choice
        ({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}, 2, "half"),
        ({"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "2"}, 2, 3),  # a user's explicit count is kept
        ({}, 2, "half"),  # `rapidtrain plan` outside torchrun: the world shares this node
    ],
)
def test_cpu_adam_threads_are_the_cores_per_rank(monkeypatch, environment, world, expected):
    import os

    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "NNODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    cores = len(os.sched_getaffinity(0))
    want = {"cores": cores, "half": max(cores // 2, 1)}.get(expected, expected)
    args = arguments.parse_args(BASE + ["--zero-2-memory-optimization", "--cpu-offload"])
    resolved = plan.from_args(args, RunContext(world, "cpu"))
    assert resolved.zero.cpu_adam_threads == want
    threads = f"{want} OpenMP thread" + ("s" if want != 1 else "")
    assert f"DeepSpeedCPUAdam, {threads} per rank" in resolved.engine_for("--cpu-offload").engine
    without_offload = plan.from_args(arguments.parse_args(BASE + ["--zero-2-memory-optimization"]),
                                     RunContext(world, "cpu"))
    assert without_offload.zero.cpu_adam_threads is None  # no DeepSpeedCPUAdam, nothing to set


def test_deepspeed_parses_the_communication_and_offload_sections(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(config_for(["--zero-3-memory-optimization", "--nvme-offload-dir", str(tmp_path),
                                         "--zero-reduce-bucket-size", "12345"], world=1))
    zero = parsed.zero_config
    assert zero.overlap_comm and zero.contiguous_gradients and zero.reduce_bucket_size == 12345
    assert zero.offload_param.device == "nvme" and zero.offload_param.max_in_cpu == 0
    assert zero.offload_optimizer.device == "nvme"
