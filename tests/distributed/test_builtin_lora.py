"""LoRA adapters on the built-in Llama-shaped GPT: under tensor parallelism 2 (adapters split with their layers) and
pipeline parallelism 2 they give one process's losses, only the adapters train (the base checkpoint's weights come
back bitwise), and the checkpoint read whole folds the adapters into the weights (W + alpha / r · B A).

The 2-rank trainings run in one torchrun launch (tests/distributed/pretrain_runs.py); the base model and the
one-process reference run in the test process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.parallel_runs import RUNS, train_here
from tests.distributed.test_llama_layouts import LLAMA_SHAPE, TRAINING, data_flags
from tests.launch import read_losses, relative_difference, torchrun

TOLERANCE = 1e-5  # fp32, relative
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2", "--train-iters", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data) -> Path:
    out = tmp_path_factory.mktemp("builtin_lora")
    llama = LLAMA_SHAPE + TRAINING + data_flags(demo_data)
    train_here(llama + ["--train-iters", "2", "--save", str(out / "base")])
    lora = llama + LORA + ["--load", str(out / "base"), "--finetune"]

    def log(name: str) -> list[str]:
        return ["--loss-log-file", str(out / f"{name}.txt")]

    two_ranks = [lora + ["--tensor-model-parallel-size", "2", "--save", str(out / "tp2"), *log("tp2")],
                 lora + ["--pipeline-model-parallel-size", "2", *log("pp2")]]
    (out / "runs.json").write_text(json.dumps(two_ranks))
    torchrun(2, RUNS, [str(out / "runs.json")], timeout=900, warm=True)
    train_here(lora + log("single"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_lora_on_the_builtin_llama_matches_one_process(runs, layout):
    """Three iterations from the base checkpoint (--finetune): TP 2 (A whole / B split beside q, k, v, fc1 and the
    gate; A split / B whole beside o_proj and fc2) and PP 2 reach one process's losses within 1e-5."""
    losses = read_losses(runs / f"{layout}.txt")
    assert sorted(losses) == [1, 2, 3]
    assert relative_difference(losses, read_losses(runs / "single.txt")) < TOLERANCE


@pytest.mark.slow
def test_only_the_adapters_train_and_the_export_folds_them_in(runs):
    from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state

    base = consolidated_model_state(checkpoint_directory(runs / "base"))
    raw = consolidated_model_state(checkpoint_directory(runs / "tp2"), merge_lora=False)
    adapters = {name for name in raw if ".lora." in name}
    assert len(adapters) == 2 * 7 * 2  # A and B beside 7 linear layers in each of 2 layers
    assert all(torch.equal(raw[name], base[name]) for name in base)  # the base is frozen
    assert all(raw[name].abs().max() > 0 for name in adapters if "lora_b" in name)  # B left zero: it trained
    merged = consolidated_model_state(checkpoint_directory(runs / "tp2"))
    assert merged.keys() == base.keys()
    layer = "layers.1.mlp.fc2"
    expected = base[f"{layer}.weight"] + 2.0 * raw[f"{layer}.lora.lora_b.weight"] @ raw[f"{layer}.lora.lora_a.weight"]
    assert torch.allclose(merged[f"{layer}.weight"], expected, atol=1e-7)
    assert not torch.equal(merged[f"{layer}.weight"], base[f"{layer}.weight"])
