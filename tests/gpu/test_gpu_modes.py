"""Every mode that fits one GPU, trained through `torchrun --nproc-per-node 1 rapidtrain/pretrain.py` with NCCL.

Each run: the built-in GPT on the demo corpus, 30 iterations. It must finish, its losses must be finite and
fall, its plan must name the engine the mode promises and NCCL for CUDA tensors, and on a GPU rapidtrain knows
(A100, H100, H200, GH200, B200) every log line must carry MFU. Also: the demo pretraining job as a user first
runs it, and a Hugging Face fine-tune through the black-box `rapidtrain` command.

    python -m pytest tests/gpu -v          # skipped without CUDA
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import PRETRAIN, REPO, child_env, read_losses, torchrun

GPT = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
       "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "30", "--lr", "1e-3",
       "--lr-warmup-iters", "3", "--log-interval", "10", "--eval-iters", "0", "--num-workers", "2"]
# mode → (flags, words the plan or log must show)
MODES = {
    "ddp": ([], ["torch.optim.AdamW"]),
    "fsdp": (["--fsdp-memory-optimization"], ["FSDP2 fully_shard"]),
    "sdp": (["--oss-sdp-memory-optimization"], ["reshard_after_forward=False"]),
    "oss": (["--oss-memory-optimization"], ["ZeroRedundancyOptimizer"]),
    "zero1": (["--zero-1-memory-optimization"], ["DeepSpeed ZeRO stage 1"]),
    "zero2": (["--zero-2-memory-optimization"], ["DeepSpeed ZeRO stage 2"]),
    "zero3": (["--zero-3-memory-optimization"], ["DeepSpeed ZeRO stage 3", "deepspeed.zero.Init"]),
    "zero2_offload": (["--zero-2-memory-optimization", "--cpu-offload"], ["DeepSpeedCPUAdam"]),
    "fp16": (["--fp16", "--initial-loss-scale", "65536"], ["fp16 autocast", "dynamic loss scaling"]),
    "mixed_precision": (["--mixed-precision"], ["fp16"]),
    "bf16": (["--bf16"], ["torch.autocast(bf16)"]),
    "bf16_tf32": (["--bf16", "--tf32"], ["fp32_precision = 'tf32'"]),
    "zero2_bf16": (["--zero-2-memory-optimization", "--bf16"], ["DeepSpeed bf16 engine"]),
    "zero3_fp16": (["--zero-3-memory-optimization", "--fp16", "--initial-loss-scale", "65536"],
                   ["DeepSpeed fp16 engine"]),
    "compile": (["--torch-compile", "--bf16"], ["torch.compile(backend='inductor'"]),
    "activation_checkpointing": (["--checkpoint-activations", "--bf16"], ["torch.utils.checkpoint"]),
}


def known_gpu() -> bool:
    from rapidtrain.core.peak_flops import known_gpu as lookup

    return lookup(torch.cuda.get_device_name()) is not None


def torchrun_pretrain(flags: list[str], timeout: int = 1200) -> subprocess.CompletedProcess:
    return torchrun(1, PRETRAIN, flags, timeout=timeout)  # retried on EADDRINUSE, as the CPU suite's launches


def log_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if " iteration " in line and "consumed samples" in line]


def assert_trained(run: subprocess.CompletedProcess, losses: dict[int, float], iterations: int) -> None:
    assert sorted(losses)[-1] == iterations
    assert all(math.isfinite(v) for v in losses.values())
    values = [losses[i] for i in sorted(losses)]
    assert sum(values[-5:]) / 5 < values[0], f"the loss did not fall: {values[0]} → {values[-5:]}"
    assert "cuda tensors → nccl" in run.stdout
    lines = log_lines(run.stdout)
    assert lines, run.stdout[-3000:]
    if known_gpu():
        assert all("MFU:" in line for line in lines), lines[-1]


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_trains_on_one_gpu_with_nccl(mode, demo_data, tmp_path):
    flags, words = MODES[mode]
    losses_file = tmp_path / "losses.txt"
    run = torchrun_pretrain(GPT + flags + ["--loss-log-file", str(losses_file)])
    assert_trained(run, read_losses(losses_file), 30)
    for word in words:
        assert word in run.stdout, f"{word!r} not in the plan/log of {mode}"
    # torch.compile's notice that a frame was compiled again and again (each time costs a compilation)
    recompiles = [line for line in run.stderr.splitlines() if "recompil" in line.lower()]
    assert not recompiles, "\n".join(recompiles)[:3000] + "\n" + run.stderr[-3000:]


def test_fp16_skips_overflowing_steps_then_trains(demo_data, tmp_path):
    """At the default 2^32 scale the first steps overflow in fp16: skipped (counted in the log) while the scale
    halves, then trained; a later overflow is skipped too (seen on an H100: one at iteration 38 of 40), as
    Megatron's dynamic scaler does, but stays rare."""
    losses_file = tmp_path / "losses.txt"
    run = torchrun_pretrain(GPT + ["--fp16", "--train-iters", "40", "--loss-log-file", str(losses_file)])
    skipped = [int(line.split()[0]) for line in losses_file.read_text().splitlines() if line.split()[2] == "1"]
    leading = [i for n, i in enumerate(skipped, start=1) if i == n]
    assert leading and len(leading) < 30 and len(skipped) - len(leading) <= 3, skipped
    assert "number of skipped iterations" in run.stdout


def test_demo_pretraining_job_runs_as_documented(tmp_path):
    """`torchrun --nproc_per_node 1 rapidtrain/pretrain.py --train-iters 200`: the README's first run."""
    losses_file = tmp_path / "losses.txt"
    run = torchrun_pretrain(["--train-iters", "200", "--loss-log-file", str(losses_file)], timeout=1800)
    losses = read_losses(losses_file)
    assert_trained(run, losses, 200)
    assert losses[200] < losses[1] - 1.0
    assert "validation loss" in run.stdout or "lm loss value" in run.stdout


@pytest.fixture(scope="module")
def glue_bert(tmp_path_factory) -> Path:
    from rapidtrain.tasks import toy

    root = tmp_path_factory.mktemp("glue-bert")
    toy.write_glue_folder(root / "glue", "sst2", train=384, dev=128)
    texts = toy.texts_of(toy.sentiment_records(384, 0))
    toy.save_tiny_model("bert", root / "tiny-bert", toy.train_tokenizer(texts, root / "tok"))
    return root


@pytest.mark.parametrize("precision", ["--mixed-precision", "--bf16"])
def test_hugging_face_fine_tune_through_the_black_box_command(glue_bert, tmp_path, precision):
    """`rapidtrain --task sequence_classification` on a tiny BERT: --mixed-precision is fp16 with loss scaling on
    CUDA; both reach the accuracy the CPU test reaches."""
    import json

    command = [sys.executable, "-m", "rapidtrain.cli", "--nproc-per-node", "1", "--task", "sequence_classification",
               "--pretrained-model-name-or-path", str(glue_bert / "tiny-bert"), "--data-dir", str(glue_bert / "glue"),
               "--data-name", "sst2", "--epochs", "4", "--micro-batch-size", "16", "--global-batch-size", "32",
               "--lr", "3e-3", "--lr-warmup-fraction", "0.1", "--seq-length", "32", "--num-workers", "0",
               "--save", str(tmp_path), precision]
    run = subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    expected = "fp16" if precision == "--mixed-precision" else "bf16"
    assert f"precision: {expected}" in run.stdout
    accuracy = json.loads((tmp_path / "best" / "eval_results.json").read_text())["validation"]["accuracy"]
    assert accuracy >= 0.8  # chance is 0.5
