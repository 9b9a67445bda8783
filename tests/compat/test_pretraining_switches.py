"""Switches of the built-in pretraining that Megatron's scripts pass: --data-iterator dynamic-shape changes the
shapes the model sees (GPT's unpacked documents, BERT's samples bucketed by length), a batch-size ramp-up trains
the same under every layout, --mmap-warmup reads the data, per-split data paths are read split by split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rapidtrain.train.builtin_pretrainer import MegatronPreTrainer
from rapidtrain.train.engine import Engine
from tests.launch import TINY_GPT_PARITY, pretrain, read_losses, relative_difference

RUNS = Path(__file__).resolve().parents[1] / "distributed" / "pretrain_runs.py"

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "64",
         "--micro-batch-size", "4", "--num-workers", "0", "--log-interval", "3", "--eval-iters", "1",
         "--eval-interval", "6", "--lr", "1e-3", "--train-iters", "6"]


class Recording(MegatronPreTrainer):
    """The built-in pretraining, recording the shape of every training micro-batch."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.shapes: list[tuple[int, ...]] = []

    def run_forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        if model.training:
            self.shapes.append(tuple((batch["tokens"] if "tokens" in batch else batch["text"]).shape))
        return super().run_forward_step(iter([batch]), model)


def shapes(*flags: str) -> list[tuple[int, ...]]:
    trainer = Recording(Engine(argv=[*SMALL, *flags], entry="pretrain"))
    trainer.train()
    return trainer.shapes


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_dynamic_shape_changes_the_shapes_the_model_sees(demo_data, model):
    """Without the switch every micro-batch is [4, 64]; with it the widths follow the samples (multiples of 8
    up to 64): GPT trains on single documents cut at 65 tokens, BERT on its samples bucketed by length (short
    ones drawn with --short-seq-prob)."""
    extra = ["--model-type", model, "--short-seq-prob", "0.5"]
    fixed = shapes(*extra)
    dynamic = shapes(*extra, "--data-iterator", "dynamic-shape")
    assert set(fixed) == {(4, 64)}
    widths = {width for _, width in dynamic}
    assert len(widths) > 1 and min(widths) < 64 and all(w % 8 == 0 and w <= 64 for w in widths)


def test_mmap_warmup_reads_the_data_first(demo_data, capsys):
    shapes("--data-path", demo_data.data_prefix, "--tokenizer-type", demo_data.tokenizer_type, "--tokenizer-model",
           demo_data.tokenizer_model, "--mmap-warmup", "--train-iters", "1", "--eval-iters", "0")
    assert "--mmap-warmup: read " in capsys.readouterr().out


def test_per_split_data_paths_are_read_split_by_split(demo_data, capsys):
    """--train-data-path / --valid-data-path (Megatron's separate splits): training and validation each read all
    of their own data; --split does not apply."""
    tokenizer = ["--tokenizer-type", demo_data.tokenizer_type, "--tokenizer-model", demo_data.tokenizer_model]
    trainer = Recording(Engine(argv=[*SMALL, *tokenizer, "--train-data-path", demo_data.data_prefix,
                                     "--valid-data-path", demo_data.data_prefix, "--eval-interval", "3"],
                               entry="pretrain"))
    trainer.train()
    assert trainer.test_ds is None and len(trainer.valid_ds) >= 4  # (6 // 3 + 1) × 1 eval batch × 4 samples
    assert "validation loss at iteration 6" in capsys.readouterr().out


RAMP_UP = [*TINY_GPT_PARITY, "--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2",
           "16", "--train-iters", "8", "--lr", "1e-3", "--log-interval", "1"]
RAMP_UP_LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"], "zero2": ["--zero-2-memory-optimization"],
                   "dp2": []}


@pytest.fixture(scope="module")
def ramp_up_runs(tmp_path_factory, demo_data):
    """The one-process reference, then the three 2-rank layouts one after another in one torchrun launch
    (tests/distributed/pretrain_runs.py): the launch's output, one section per run, each starting with its plan."""
    out = tmp_path_factory.mktemp("ramp_up")
    pretrain(1, RAMP_UP + ["--loss-log-file", str(out / "single.txt")], warm=True)
    runs = [RAMP_UP + flags + ["--loss-log-file", str(out / f"{name}.txt")] for name, flags in RAMP_UP_LAYOUTS.items()]
    (out / "runs.json").write_text(json.dumps(runs))
    launch = pretrain(2, [str(out / "runs.json")], script=RUNS, warm=True)
    sections = launch.stdout.split("rapidtrain plan —")[1:]
    assert len(sections) == len(RAMP_UP_LAYOUTS), launch.stdout[-3000:]
    return out, dict(zip(RAMP_UP_LAYOUTS, sections, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(RAMP_UP_LAYOUTS))
def test_batch_ramp_up_trains_the_same_under_every_layout(ramp_up_runs, layout):
    """--rampup-batch-size 2 2 16 to 8 over 8 iterations: one process (micro 1, accumulation 2 → 8) and two
    ranks (data parallel, pipeline 2, ZeRO-2) reach the same losses; the pipeline builds a schedule for each
    number of micro-batches."""
    out, printed = ramp_up_runs
    parallel = read_losses(out / f"{layout}.txt")
    assert sorted(parallel) == list(range(1, 9))
    assert relative_difference(parallel, read_losses(out / "single.txt")) < 1e-5
    assert "global batch size:     2 |" in printed[layout] and "global batch size:     8 |" in printed[layout]
