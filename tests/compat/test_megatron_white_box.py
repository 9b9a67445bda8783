"""A Megatron-shaped white-box script (user_scripts/megatron_gpt.py: model and dataset providers and a forward step
handed to `pretrain`) trains exactly as rapidtrain's own pretrain_gpt.py: the same losses and gradient norms, bit
for bit, in one process and under tensor parallelism; its loss function's dict is the log line's loss."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import REPO, read_grad_norms, read_losses, torchrun

WHITE_BOX = Path(__file__).resolve().parent / "user_scripts" / "megatron_gpt.py"
BUILT_IN = REPO / "rapidtrain" / "pretrain_gpt.py"


def flags(data, losses) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--num-workers", "0", "--log-interval", "1",
            "--eval-iters", "1", "--eval-interval", "3", "--lr", "1e-3", "--train-iters", "4",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--data-path", data.gpt_prefix, "--vocab-file",
            str(data.gpt_vocab), "--merge-file", str(data.gpt_merges), "--split", "949,50,1",
            "--loss-log-file", str(losses)]


@pytest.mark.parametrize("layout", [
    [],
    pytest.param(["--tensor-model-parallel-size", "2"], marks=pytest.mark.slow),
    pytest.param(["--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow),
], ids=["one-process", "tp2", "pp2"])
def test_megatron_white_box_script_matches_the_built_in_pretraining(megatron_data, tmp_path, layout):
    ranks = 2 if layout else 1
    script, built_in = tmp_path / "script.txt", tmp_path / "built_in.txt"
    run = torchrun(ranks, WHITE_BOX, flags(megatron_data, script) + layout, warm=True)
    torchrun(ranks, BUILT_IN, flags(megatron_data, built_in) + layout, warm=True)
    assert sorted(read_losses(script)) == [1, 2, 3, 4]
    assert read_losses(script) == read_losses(built_in)
    assert read_grad_norms(script) == read_grad_norms(built_in)
    assert "building GPT model ..." in run.stdout  # print_rank_0 from the script
    assert run.stdout.count("lm loss: ") == 4  # the loss function's {"lm loss": ...}, once per log line
    assert "validation loss at iteration 3 | lm loss value:" in run.stdout
