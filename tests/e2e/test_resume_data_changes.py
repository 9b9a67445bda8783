"""Resume checks the data: the checkpoint records the data settings and the data files' identity; a resume that
differs says so in one line each and continues where Megatron would (the consumed samples carry over; a changed
global batch continues from the saved position with iterations of the new size), and refuses where continuing is
wrong (another tokenizer; a schedule that would change), naming the flag that allows it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from rapidtrain.checkpoint.resume import ResumeError
from rapidtrain.data.indexed import IndexedDatasetBuilder
from tests.e2e.test_loaded_never_overwritten import folder_hash, train
from tests.launch import TINY_GPT_SHAPE

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
BASE = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--num-workers", "0", "--eval-iters", "0", "--lr", "1e-3",
        "--log-interval", "1", "--save-interval", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--lr-decay-samples", "400"]  # a schedule in samples: a longer run or another global batch keeps it


def write_corpus(prefix: Path, seed: int, documents: int = 60) -> None:
    rng = np.random.RandomState(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(documents):
        builder.add_document([list(rng.randint(0, 100, size=80)) + [100]])
    builder.finalize(f"{prefix}.idx")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """A run of 2 iterations of 4 samples on corpus A, saved; the tests copy its folder."""
    root = tmp_path_factory.mktemp("resume")
    for name, seed in (("a", 1), ("b", 2)):
        write_corpus(root / name, seed)
    flags = ["--data-path", str(root / "a"), "--data-cache-path", str(root / "cache"), "--global-batch-size", "4"]
    train([*BASE, *flags, "--train-samples", "8", "--save", str(root / "ck")])
    return {"root": root, "flags": flags}


def resumed(saved: dict, tmp_path: Path, changed: list[str], capsys) -> tuple[str, Path]:
    """Resume a copy of the saved run for 2 more iterations with `changed` flags (later ones win); its output."""
    folder = tmp_path / "ck"
    shutil.copytree(saved["root"] / "ck", folder)
    capsys.readouterr()
    train([*BASE, *saved["flags"], "--train-samples", "16", "--load", str(folder), "--save", str(folder), *changed])
    return capsys.readouterr().out, folder


def consumed_at(folder: Path, iteration: int) -> int:
    return json.loads((folder / f"iter_{iteration:07d}" / "common.json").read_text())["consumed_samples"]


@pytest.mark.parametrize(("changed", "said"), [
    (["--seq-length", "32", "--max-position-embeddings", "64"],
     "--seq-length changed since the checkpoint (checkpoint 64, now 32)"),
    (["--split", "90,10,0"], "--split changed since the checkpoint (checkpoint 969, 30, 1, now 90,10,0)"),
    (["--seed", "7"], "--seed changed since the checkpoint (checkpoint 1234, now 7)"),
    ("data-path b", "--data-path changed since the checkpoint"),
])
def test_a_resume_on_other_data_says_what_changed_and_continues_at_the_saved_sample(saved, tmp_path, capsys,
                                                                                   changed, said, one_thread):
    if changed == "data-path b":
        changed = ["--data-path", str(saved["root"] / "b")]
    output, folder = resumed(saved, tmp_path, changed, capsys)
    lines = [line for line in output.splitlines() if "changed since the checkpoint" in line]
    assert len(lines) == 1 and said in lines[0], output
    assert "the consumed samples (8) carry over" in lines[0]
    assert "loaded checkpoint" in output and "at iteration 2" in output
    assert consumed_at(folder, 4) == 16  # 8 carried over + 2 iterations of 4


def test_a_data_file_rewritten_in_place_is_named(saved, tmp_path, capsys, one_thread):
    """The same --data-path whose corpus was preprocessed again (other contents and size): each file is named."""
    prefix = tmp_path / "a"
    write_corpus(prefix, seed=1)
    flags = [*BASE, "--data-path", str(prefix), "--data-cache-path", str(tmp_path / "cache"),
             "--global-batch-size", "4", "--save", str(tmp_path / "ck")]
    train([*flags, "--train-samples", "8"])
    write_corpus(prefix, seed=3, documents=70)
    capsys.readouterr()
    train([*flags, "--train-samples", "16", "--load", str(tmp_path / "ck")])
    output = capsys.readouterr().out
    for suffix in (".bin", ".idx"):
        line = next(line for line in output.splitlines() if f"{prefix}{suffix} changed since the checkpoint" in line)
        assert "over the file's new contents" in line


def test_another_global_batch_continues_from_the_saved_sample_with_iterations_of_the_new_size(saved, tmp_path,
                                                                                             capsys, one_thread):
    """8 samples done in 2 iterations of 4; --train-samples 24 at 8 a batch leaves 2 iterations (to iteration 4),
    where counting from zero (24 // 8 = 3) would stop after one."""
    output, folder = resumed(saved, tmp_path, ["--global-batch-size", "8", "--train-samples", "24"], capsys)
    line = next(line for line in output.splitlines() if "--global-batch-size changed" in line)
    assert "(checkpoint 4, now 8)" in line and "after iteration 2 at consumed sample 8" in line
    assert "the run ends at iteration 4 (not 3)" in output
    assert consumed_at(folder, 4) == 24


def test_another_global_batch_under_an_iteration_schedule_is_refused_naming_the_values_and_megatrons_flags(
        saved, tmp_path, capsys, one_thread):
    """--lr-decay-iters is in iterations, the schedule in samples: a new global batch moves the decay's end (Megatron
    refuses too). The message names the values (not "checkpoint None") and the flags as Megatron's parser spells
    them; with --override-opt-param-scheduler the run continues from the saved sample."""
    flags = [*BASE[:-2], *saved["flags"], "--lr-decay-iters", "100", "--save", str(tmp_path / "ck")]
    train([*flags, "--train-iters", "2"])
    with pytest.raises(ResumeError) as refused:
        train([*flags, "--train-iters", "4", "--load", str(tmp_path / "ck"), "--global-batch-size", "8"])
    message = str(refused.value)
    assert "--global-batch-size (checkpoint 4, now 8)" in message and "None" not in message
    assert "--override-opt-param-scheduler" in message and "--use-checkpoint-opt-param-scheduler" in message
    # (another --save: the refused run above, in this process, still holds the first folder's lock)
    train([*flags, "--train-iters", "4", "--load", str(tmp_path / "ck"), "--global-batch-size", "8",
           "--override-opt-param-scheduler", "--save", str(tmp_path / "continued")])
    assert consumed_at(tmp_path / "continued", 4) == 8 + 2 * 8


def test_a_global_batch_left_to_default_then_given_is_compared_by_value(tmp_path, saved, capsys, one_thread):
    """The saved run had no --global-batch-size (micro 2 × 1 rank = 2): a resume giving 2 is the same run, and one
    giving 4 under an iteration schedule is refused naming 2 → 4 (it said "checkpoint None")."""
    flags = [*BASE[:-2], "--data-path", str(saved["root"] / "a"), "--data-cache-path", str(saved["root"] / "cache"),
             "--lr-decay-iters", "100", "--load", str(tmp_path / "ck")]
    train([*flags, "--train-iters", "2", "--save", str(tmp_path / "ck")])
    with pytest.raises(ResumeError) as refused:
        train([*flags, "--train-iters", "4", "--save", str(tmp_path / "other"), "--global-batch-size", "4"])
    assert "--global-batch-size (checkpoint 2, now 4)" in str(refused.value), refused.value
    capsys.readouterr()
    train([*flags, "--train-iters", "4", "--save", str(tmp_path / "same"), "--global-batch-size", "2"])
    output = capsys.readouterr().out
    assert "changed since the checkpoint" not in output and "at iteration 2" in output


def test_another_tokenizer_is_refused_before_loading_and_nothing_is_written(saved, tmp_path, capsys, one_thread):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({**{f"t{i}": i for i in range(99)}, "<|endoftext|>": 99}))
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")
    folder = tmp_path / "ck"
    shutil.copytree(saved["root"] / "ck", folder)
    before = folder_hash(folder)
    with pytest.raises(ResumeError) as refused:
        train([*BASE, *saved["flags"], "--train-samples", "16", "--load", str(folder), "--save", str(folder),
               "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges)])
    message = str(refused.value)
    assert "--tokenizer-type (checkpoint NullTokenizer, now GPT2BPETokenizer)" in message
    assert "--finetune" in message
    assert folder_hash(folder) == before
    assert os.listdir(folder)
