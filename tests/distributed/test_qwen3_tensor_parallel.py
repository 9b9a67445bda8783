"""The Qwen3-shaped built-in GPT (--kv-channels apart from hidden / heads, --qk-layernorm, Llama 3.1 rope scaling)
under tensor parallelism on 2 ranks gives one process's losses and gradient norms: the q/k norms, held whole on each
rank and applied to its own heads, get their gradients summed over the ranks."""

from __future__ import annotations

import json

import pytest

from tests.distributed.parallel_runs import RUNS, train_here
from tests.distributed.test_llama_layouts import TOLERANCE, TRAINING, data_flags
from tests.launch import read_grad_norms, read_losses, relative_difference, torchrun

QWEN3_SHAPE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 24 --qk-layernorm "
               "--seq-length 64 --normalization RMSNorm --swiglu --group-query-attention --num-query-groups 2 "
               "--disable-bias-linear --position-embedding-type rope --rotary-base 1000000 --use-rope-scaling "
               "--untie-embeddings-and-output-weights --train-iters 4").split()


@pytest.mark.slow
def test_qwen3_shape_under_tensor_parallelism_matches_one_process(tmp_path, demo_data):
    flags = QWEN3_SHAPE + TRAINING + data_flags(demo_data)
    runs = [flags + ["--tensor-model-parallel-size", "2", "--loss-log-file", str(tmp_path / "tp2.txt")]]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    result = torchrun(2, RUNS, [str(tmp_path / "runs.json")], timeout=600, warm=True)
    assert '"tp": 2' in result.stdout or "TP 2" in result.stdout, result.stdout[:3000]
    train_here(flags + ["--loss-log-file", str(tmp_path / "single.txt")])
    losses = read_losses(tmp_path / "tp2.txt")
    assert sorted(losses) == [1, 2, 3, 4]
    assert relative_difference(losses, read_losses(tmp_path / "single.txt")) < TOLERANCE
    norms = read_grad_norms(tmp_path / "tp2.txt")
    assert relative_difference(norms, read_grad_norms(tmp_path / "single.txt")) < TOLERANCE
