"""The plan: batch arithmetic, precision resolution, engines per switch, memory per rank, `rapidtrain plan`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rapidtrain.config import arguments, plan, settings
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.resolve import parse_step_schedule
from rapidtrain.config.settings import Batches, RunContext

BASE = ["--train-iters", "10", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def resolve(argv: list[str], world: int = 1, device: str = "cpu") -> settings.Plan:
    return plan.from_args(arguments.parse_args(BASE + argv), RunContext(world, device))  # type: ignore[arg-type]


def test_batch_arithmetic():
    assert Batches.resolve(2, 16, 2) == Batches(2, 16, 4, data_parallel_size=2)
    assert Batches.resolve(4, None, 3) == Batches(4, 12, 1, data_parallel_size=3)  # default: micro × data parallel


def test_rampup_grows_the_global_batch_as_megatron():
    """--rampup-batch-size 4 4 96 to 16 with micro 2 × dp 2: (16 - 4) / 4 = 3 increments of 32 samples each."""
    batches = Batches.resolve(2, 16, 2, settings.BatchSchedule("rampup", start=4, increment=4, rampup_samples=96))
    sizes, consumed = [], 0
    for _ in range(12):
        sizes.append(batches.global_batch_at(consumed))
        consumed += sizes[-1]
    assert sizes == [4, 4, 4, 4, 4, 4, 4, 4, 8, 8, 8, 8]  # 32 samples at 4, then 8 from 32 consumed ...
    assert [batches.accumulation_steps_at(c) for c in (0, 32, 64, 97)] == [1, 2, 3, 4]
    # Megatron's update_train_iters: ramp-up iterations while consumed ≤ 96 (8 × 4 + 4 × 8 + 3 × 12 = 100, the
    # last one ending past 96), then whole final batches.
    assert batches.iterations_for_samples(96) == 15
    assert batches.samples_for_iterations(15) == 100
    assert batches.iterations_for_samples(100 + 3 * 16 + 5) == 18
    assert batches.samples_for_iterations(18) == 148


def test_step_schedule_in_tokens_as_megatron():
    steps = parse_step_schedule("0:4 1K:8, 2k:16", seq_length=100)  # thresholds in tokens → samples
    assert steps == ((0, 4), (10, 8), (20, 16))
    batches = Batches.resolve(1, None, 2, settings.BatchSchedule("steps", steps=steps))
    assert batches.global_batch_size == 16  # the largest of the schedule
    assert [batches.global_batch_at(c) for c in (0, 9, 10, 19, 20, 500)] == [4, 4, 8, 8, 16, 16]
    assert batches.samples_for_iterations(5) == 4 + 4 + 4 + 8 + 16  # 0, 4, 8 → 12 (8), 20 → 16
    for bad in ("1:4", "0:4 0:8", "0:x", "0-4"):
        with pytest.raises(ValueError):
            parse_step_schedule(bad, seq_length=1)


def test_sample_based_training_resolves_iterations_and_the_schedule_in_samples():
    args = arguments.parse_args(["--lr", "1e-4", "--train-samples", "100", "--lr-decay-samples", "80",
                                 "--lr-warmup-samples", "8", "--micro-batch-size", "2", "--global-batch-size", "8"])
    p = plan.from_args(args, RunContext(2, "cpu"))
    assert (p.training.train_iters, p.training.train_samples) == (12, 100)
    assert (p.schedule.decay_samples, p.schedule.warmup_samples) == (80, 8)
    assert "100 samples (--train-samples) = 12 iterations" in describe_plan(p)


def test_layout_in_megatron_order():
    p = resolve(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], world=8)
    assert (p.layout.data_parallel_size, p.layout.tensor_parallel_size, p.layout.pipeline_parallel_size) == (
        2,
        2,
        2,
    )
    assert p.layout.rank_grid() == [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
    ]  # tensor-parallel ranks are neighbours


def test_mixed_precision_resolves_to_bf16_on_cpu_and_fp16_on_cuda():
    cpu = resolve(["--mixed-precision"], device="cpu").precision
    assert cpu.dtype == "bf16" and cpu.loss_scaling == "none" and "CPU" in cpu.reason
    cuda = resolve(["--mixed-precision"], device="cuda").precision
    assert cuda.dtype == "fp16" and cuda.loss_scaling == "dynamic"
    assert resolve(["--fp16", "--loss-scale", "128"]).precision.loss_scaling == "static 128"


@pytest.mark.parametrize(
    "flags,world,switch,engine_words",
    [
        (["--zero-2-memory-optimization"], 2, "--zero-2-memory-optimization", "DeepSpeed ZeRO stage 2"),
        (["--zero-3-memory-optimization"], 2, "--zero-3-memory-optimization", "deepspeed.zero.Init"),
        (["--oss-memory-optimization"], 2, "--oss-memory-optimization", "ZeroRedundancyOptimizer"),
        (
            ["--oss-sdp-memory-optimization"],
            2,
            "--oss-sdp-memory-optimization",
            "reshard_after_forward=False",
        ),
        (["--fsdp-memory-optimization"], 2, "--fsdp-memory-optimization", "FSDP2 fully_shard"),
        (
            ["--zero-1-memory-optimization", "--tensor-model-parallel-size", "2"],
            4,
            "--zero-1-memory-optimization",
            "FSDP2 fully_shard over the data-parallel mesh dimension",
        ),
        (["--checkpoint-activations"], 1, "--checkpoint-activations", "torch.utils.checkpoint"),
        (["--onnx-runtime-training"], 1, "--onnx-runtime-training", "torch.compile"),
        (["--cpu-offload", "--zero-2-memory-optimization"], 2, "--cpu-offload", "DeepSpeedCPUAdam"),
        (["--bf16"], 1, "precision", "over bf16 copies of the linear layers' weights"),
        (["--bf16"], 2, "precision", "casts the fp32 linear weights to bf16 in every forward"),
        (["--bf16", "--torch-compile"], 1, "precision", "casts the fp32 linear weights to bf16 in every forward"),
    ],
)
def test_engine_per_switch(flags, world, switch, engine_words):
    choice = resolve(flags, world=world).engine_for(switch)
    assert choice is not None and engine_words in choice.engine


def test_onnx_runtime_substitute_says_why():
    choice = resolve(["--onnx-runtime-training"]).engine_for("--onnx-runtime-training")
    assert "onnxruntime" in choice.reason


def test_memory_follows_zero_paper():
    # fp32 Adam: 4 + 4 + 8 bytes per parameter (plus torch's 4-byte step counter per tensor); 2 data-parallel ranks.
    ddp = resolve([], world=2).memory
    n = ddp.total_params
    assert (ddp.param_bytes, ddp.grad_bytes) == (4 * n, 4 * n)
    assert ddp.optimizer_bytes == pytest.approx(8 * n, rel=1e-4)
    zero1 = resolve(["--zero-1-memory-optimization", "--bf16"], world=2).memory  # DeepSpeed: 2 + 2 + 12/N
    assert (zero1.param_bytes, zero1.grad_bytes) == (2 * n, 2 * n)
    assert zero1.optimizer_bytes == pytest.approx(6 * n, rel=1e-4)
    zero2 = resolve(["--zero-2-memory-optimization", "--bf16"], world=2).memory  # 2 + 14/N
    assert zero2.param_bytes + zero2.grad_bytes + zero2.optimizer_bytes == pytest.approx(2 * n + 14 * n / 2, rel=1e-4)
    zero3 = resolve(["--zero-3-memory-optimization", "--bf16"], world=2).memory  # 16/N
    assert zero3.param_bytes + zero3.grad_bytes + zero3.optimizer_bytes == pytest.approx(16 * n / 2, rel=1e-4)
    fp32 = resolve(["--zero-1-memory-optimization"], world=2).memory  # DeepSpeed's fp32 partition copy: 4 + 4 + 12/N
    assert fp32.optimizer_bytes == pytest.approx(6 * n, rel=1e-4)
    tp2 = resolve(["--tensor-model-parallel-size", "2"], world=2).memory
    assert tp2.param_bytes == pytest.approx(2 * n)  # parameters split over tensor-parallel ranks


def test_deepspeed_buffers_beyond_the_zero_accounting():
    # Reduce buckets of --zero-reduce-bucket-size 16-bit elements: two with --zero-overlap-comm (the default), one
    # without; none without contiguous gradients.
    buckets = ["--zero-reduce-bucket-size", "1000000", "--bf16"]
    zero1 = resolve(["--zero-1-memory-optimization", *buckets], world=2).memory
    assert zero1.engine_bytes == 2 * 2 * 1_000_000
    single = resolve(["--zero-1-memory-optimization", "--no-zero-overlap-comm", *buckets], world=2).memory
    assert single.engine_bytes == 2 * 1_000_000
    none = resolve(["--zero-1-memory-optimization", "--no-zero-contiguous-gradients", *buckets], world=2).memory
    assert none.engine_bytes == 0
    assert zero1.total_bytes == pytest.approx(zero1.param_bytes + zero1.grad_bytes + zero1.optimizer_bytes
                                              + zero1.engine_bytes)
    # ZeRO-2 on 8 ranks: beside its partition (n / 8) a rank holds whole the gradients of the tensors straddling
    # its ends, at most the two largest: the word embedding (1024 × 64, spanning several partitions: the ranks it
    # spans hold all of its gradient) and an MLP matrix (64 × 256).
    shape = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
    zero2 = resolve(["--zero-2-memory-optimization", *shape, *buckets], world=8).memory
    assert zero2.total_params == 169_728
    assert zero2.engine_bytes == 2 * (2 * 1_000_000 + 1024 * 64 + 64 * 256)
    # ZeRO-3: one reduce bucket, plus small parameters kept whole and the gathered head.
    zero3 = resolve(["--zero-3-memory-optimization", *buckets], world=2).memory
    assert zero3.engine_bytes > 2 * 1_000_000


def test_rapidtrain_plan_prints_accumulation_and_engines_for_8_ranks():
    argv = [
        "plan",
        "--world-size",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--zero-1-memory-optimization",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "16",
        *BASE,
    ]
    result = subprocess.run([sys.executable, "-m", "rapidtrain.cli", *argv], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "accumulation steps 4" in result.stdout
    assert "world 8 = data 2 × tensor 2 × pipeline 2" in result.stdout
    assert "DTensor parallelize_module" in result.stdout and "torch.distributed.pipelining" in result.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "rapidtrain.cli", *argv, "--json"], capture_output=True, text=True
    )
    data = json.loads(as_json.stdout)
    assert data["batches"]["accumulation_steps"] == 4 and data["layout"]["data_parallel_size"] == 2


def test_the_plan_records_the_flags_a_checkpoint_stores():
    """Checkpoints store the flags (as Megatron's store their args) from the plan: JSON values, the padded
    vocabulary of the built-in model included, the list of typed flags not."""
    flags = resolve(["--micro-batch-size", "2", "--data-path", "a", "b"]).checkpoint.flags
    assert flags["micro_batch_size"] == 2 and flags["train_iters"] == 10 and flags["data_path"] == ["a", "b"]
    assert flags["padded_vocab_size"] == 1024  # 1000 padded to a multiple of 128
    assert "given_flags" not in flags
    assert json.loads(json.dumps(flags)) == flags


def from_parsed(argv: list[str], ctx: RunContext) -> settings.Plan:
    return plan.from_args(arguments.parse_args(argv), ctx)


def test_a_deepspeed_bucket_larger_than_the_model_is_named_with_the_size_that_suffices():
    """DeepSpeed allocates --zero-reduce-bucket-size elements (two with overlap_comm) whatever the model: the plan
    warns when the bucket could never fill, and not once it is the model's size."""
    shape = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "2", "--zero-2-memory-optimization"]
    ctx = RunContext(world_size=2)
    plan = from_parsed(shape, ctx)
    parameters = plan.memory.parameters
    [warning] = [w for w in plan.warnings if "--zero-reduce-bucket-size" in w]
    assert "2 × 500,000,000 elements" in warning and f"--zero-reduce-bucket-size {parameters} is enough" in warning
    fitted = from_parsed([*shape, "--zero-reduce-bucket-size", str(parameters)], ctx)
    assert not [w for w in fitted.warnings if "bucket" in w]
    stage3 = from_parsed([*shape[:-1], "--zero-3-memory-optimization"], ctx)
    assert not [w for w in stage3.warnings if "bucket" in w]
