"""The Llama-shaped built-in GPT (RMSNorm, SwiGLU, grouped-query attention, rope, no biases, untied output) on
2 ranks: tensor, pipeline and (its MoE variant) expert parallelism give one process's losses, a run resumes
exactly, and continued
pretraining from a Hugging Face Llama folder runs under pipeline parallelism and gives its weights back out of
a tensor-parallel checkpoint, resharded and exported.

All 2-rank trainings run in one torchrun launch (tests/distributed/pretrain_runs.py); the one-process
references run in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.distributed.parallel_runs import RUNS, train_here
from tests.launch import REPO, child_env, read_grad_norms, read_losses, relative_difference, torchrun

TOLERANCE = 1e-5  # fp32, relative
LLAMA_SHAPE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --normalization RMSNorm "
               "--swiglu --group-query-attention --num-query-groups 2 --disable-bias-linear "
               "--position-embedding-type rope --rotary-base 50000 --untie-embeddings-and-output-weights").split()
TRAINING = ("--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --eval-iters 0 --micro-batch-size 2 "
            "--global-batch-size 4 --lr 1e-3 --lr-warmup-iters 1 --log-interval 1").split()


def data_flags(demo_data) -> list[str]:
    # The demo vocabulary (2,005 ids) pads to 2048 at TP 1 and 2: every layout builds the same embedding.
    return ["--data-path", demo_data.data_prefix, "--tokenizer-type", demo_data.tokenizer_type,
            "--tokenizer-model", demo_data.tokenizer_model, "--make-vocab-size-divisible-by", "512"]


def save_hf_llama(folder: Path) -> Path:
    """A tiny Llama with the demo tokenizer's padded vocabulary, random weights, written by save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                         rope_theta=50000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(folder)
    return folder


@dataclass
class Runs:
    out: Path
    hf: Path
    launch_output: str

    def losses(self, name: str) -> dict[int, float]:
        return read_losses(self.out / f"{name}.txt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data) -> Runs:
    out = tmp_path_factory.mktemp("llama_layouts")
    hf = save_hf_llama(out / "hf_llama")
    llama = LLAMA_SHAPE + TRAINING + data_flags(demo_data) + ["--train-iters", "4"]
    moe = llama + ["--num-experts", "4", "--moe-router-topk", "2"]  # SwiGLU experts without biases
    from_hf = ["--pretrained-model-name-or-path", str(hf), *TRAINING, *data_flags(demo_data)]

    def log(name: str) -> list[str]:
        return ["--loss-log-file", str(out / f"{name}.txt")]

    two_ranks = [
        llama + ["--tensor-model-parallel-size", "2", "--save", str(out / "tp2"), *log("tp2")],
        llama + ["--tensor-model-parallel-size", "2", "--exit-interval", "2", "--save", str(out / "tp2_cut"),
                 *log("tp2_resumed")],
        llama + ["--tensor-model-parallel-size", "2", "--load", str(out / "tp2_cut"), *log("tp2_resumed")],
        llama + ["--pipeline-model-parallel-size", "2", "--save", str(out / "pp2"), *log("pp2")],
        moe + ["--expert-model-parallel-size", "2", *log("moe_ep2")],
        from_hf + ["--pipeline-model-parallel-size", "2", "--train-iters", "3", *log("hf_pp2")],
        # lr 0: the weights stay the Hugging Face ones, through a tensor-parallel save
        from_hf + ["--tensor-model-parallel-size", "2", "--train-iters", "1", "--lr", "0", "--min-lr", "0",
                   "--lr-warmup-iters", "0", "--save", str(out / "hf_tp2_lr0")],
    ]
    (out / "runs.json").write_text(json.dumps(two_ranks))
    result = torchrun(2, RUNS, [str(out / "runs.json")], timeout=1200, warm=True)
    train_here(llama + log("single"))
    train_here(moe + log("moe_single"))
    train_here(from_hf + ["--train-iters", "3", *log("hf_single")])
    return Runs(out, hf, result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_llama_tensor_and_pipeline_parallel_match_one_process(runs, layout):
    """4 iterations, 2 micro-batches each: TP 2 (query groups split 1 + 1) and PP 2 (a layer per stage, the
    untied head on the last) give one process's losses and global gradient norms within 1e-5."""
    losses = runs.losses(layout)
    assert sorted(losses) == [1, 2, 3, 4]
    assert relative_difference(losses, runs.losses("single")) < TOLERANCE
    norms = read_grad_norms(runs.out / f"{layout}.txt")
    assert relative_difference(norms, read_grad_norms(runs.out / "single.txt")) < TOLERANCE


@pytest.mark.slow
def test_llama_moe_expert_parallel_matches_one_process(runs):
    """Top-2 of 4 SwiGLU experts in both layers, sharded 2 + 2 over the ranks (DP 2 × EP 2): one process's losses
    and gradient norms (the expert weights w1, w_gate, w2 without biases, sliced by expert)."""
    assert "expert parallel 2" in runs.launch_output
    losses = runs.losses("moe_ep2")
    assert sorted(losses) == [1, 2, 3, 4]
    assert relative_difference(losses, runs.losses("moe_single")) < TOLERANCE
    norms = read_grad_norms(runs.out / "moe_ep2.txt")
    assert relative_difference(norms, read_grad_norms(runs.out / "moe_single.txt")) < TOLERANCE


@pytest.mark.slow
def test_llama_resumes_exactly_under_tensor_parallelism(runs):
    """Saved at iteration 2 (--exit-interval) and resumed: iterations 3 and 4 are bitwise the uninterrupted run's."""
    assert runs.losses("tp2_resumed") == runs.losses("tp2")


@pytest.mark.slow
def test_continued_pretraining_from_hugging_face_llama_under_pipeline_parallelism(runs):
    """The run's plan names the folder, and PP 2 from the Hugging Face weights gives one process's losses."""
    assert f"built-in GPT (Llama-family) initialised from Hugging Face weights in {runs.hf}" in runs.launch_output
    losses = runs.losses("hf_pp2")
    assert sorted(losses) == [1, 2, 3]
    assert relative_difference(losses, runs.losses("hf_single")) < TOLERANCE
    assert losses != runs.losses("single")  # other weights than the seeded model's


@pytest.mark.slow
def test_hugging_face_weights_come_back_out_of_a_tensor_parallel_checkpoint(runs, tmp_path):
    """Loaded under TP 2, saved as DCP shards (lr 0 keeps them), consolidated in one process and exported with
    scripts/convert_checkpoint.py --hf: every tensor is bitwise the original folder's, and transformers loads it."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    export = tmp_path / "export"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), "--load", str(runs.out / "hf_tp2_lr0"),
         "--output", str(export), "--hf"],
        capture_output=True, text=True, env=child_env(), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Hugging Face llama model" in result.stdout
    original, exported = load_file(runs.hf / "model.safetensors"), load_file(export / "hf" / "model.safetensors")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    reloaded = LlamaForCausalLM.from_pretrained(export / "hf")
    assert reloaded.config.num_key_value_heads == 2 and not reloaded.config.tie_word_embeddings


@pytest.mark.slow
def test_checkpoints_saved_under_tp2_and_pp2_generate_in_one_process(runs, capsys):
    """`rapidtrain generate` loads each checkpoint whole (DCP reshards the TP shards and the PP stages): the two
    runs' weights give the same logits (within fp32 noise) and the same greedy text."""
    import argparse

    from rapidtrain import cli
    from rapidtrain.train.generation import load_for_generation

    prompt = torch.tensor([[5, 17, 300, 42, 7]])
    logits, texts = [], []
    for name in ("tp2", "pp2"):
        model, _ = load_for_generation(argparse.Namespace(load=str(runs.out / name), iteration=None), [])
        assert model.config.query_groups == 2 and model.config.swiglu
        with torch.no_grad():
            logits.append(model(prompt))
        assert cli.main(["generate", "--load", str(runs.out / name), "--prompt", "The first", "--max-new-tokens",
                         "16"]) == 0
        texts.append(capsys.readouterr().out)
    assert (logits[0] - logits[1]).abs().max() < 1e-4
    assert texts[0] == texts[1] and texts[0].startswith("The first")
