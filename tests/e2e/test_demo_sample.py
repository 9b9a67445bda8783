"""The demo ends with a sample from the model it trained: under tensor parallelism both ranks generate together and
rank 0 prints exactly what `rapidtrain generate` writes from the saved checkpoint; layouts whose ranks hold part
of the model say why they print none."""

from __future__ import annotations

import pytest

from rapidtrain.config import arguments, plan, settings
from rapidtrain.train.builtin_pretrainer import DEMO_PROMPT, DEMO_SAMPLE_TOKENS, demo_sample_unavailable
from tests.launch import TINY_GPT_SHAPE, pretrain

TINY = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--global-batch-size", "4", "--num-workers", "0",
        "--log-interval", "4", "--eval-iters", "0", "--lr", "1e-3", "--train-iters", "8"]


@pytest.mark.slow
def test_demo_prints_the_trained_models_greedy_sample(tmp_path, demo_data):
    from rapidtrain.train.generation import generate_sample, load_for_generation

    result = pretrain(2, TINY + ["--tensor-model-parallel-size", "2", "--save", str(tmp_path / "ck")], warm=True)
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith(" sample from the trained model"))
    printed = lines[header + 1].removeprefix("   ")
    assert printed.startswith(DEMO_PROMPT) and len(printed) > len(DEMO_PROMPT)
    assert sum(line.startswith(" sample from") for line in lines) == 1  # rank 0 only

    options = type("Options", (), {"load": str(tmp_path / "ck"), "iteration": None})()
    model, tokenizer = load_for_generation(options, [])  # the checkpoint, resharded into one process
    assert generate_sample(model, tokenizer, DEMO_PROMPT, DEMO_SAMPLE_TOKENS).split("\n")[0] == printed


def resolved(argv: list[str], world: int = 2) -> settings.Plan:
    args = arguments.parse_args(["--train-iters", "10", "--lr", "1e-4", *argv], entry="pretrain")
    return plan.from_args(args, settings.RunContext(world, "cpu"))


@pytest.mark.parametrize("flags, reason", [
    ([], ""),
    (["--tensor-model-parallel-size", "2"], ""),
    (["--oss-memory-optimization"], ""),
    (["--pipeline-model-parallel-size", "2"], "pipeline parallelism"),
    (["--fsdp-memory-optimization"], "fsdp partitioning shards the parameters"),
    (["--zero-3-memory-optimization"], "zero-3 partitioning shards the parameters"),
    (["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192"], "the NullTokenizer reads token ids"),
])
def test_layouts_that_cannot_sample_on_one_rank_say_why(flags, reason):
    found = demo_sample_unavailable(resolved(flags))
    assert (reason in found and found) if reason else found == ""


def test_a_mock_data_run_with_the_null_tokenizer_ends_cleanly(tmp_path, capsys):
    """--mock-data --tokenizer-type NullTokenizer trains and saves, then says why it prints no sample (it ended in a
    traceback: the NullTokenizer cannot read the demo prompt's text)."""
    from rapidtrain.pretrain import main

    main(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
          "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "2",
          "--num-workers", "0", "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
          "--vocab-size", "8192", "--save", str(tmp_path / "ck")], entry="pretrain")
    out = capsys.readouterr().out
    assert "saved checkpoint at iteration       2" in out
    assert "sample: not generated here (the NullTokenizer reads token ids" in out and "--prompt 'ID ID ...'" in out
