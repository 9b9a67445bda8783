"""Caches keyed on content and data checked when it changes under a run; checkpoint format versions (issue 25
item 4)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rapidtrain.checkpoint.checkpointer import FORMAT_VERSION, CheckpointError, load_checkpoint, verify_checkpoint
from rapidtrain.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from rapidtrain.data.indexed import DataFileError, IndexedDataset, IndexedDatasetBuilder


def write_corpus(prefix: str, seed: int) -> None:
    """40 documents of 30 tokens: the same counts for every seed, other tokens."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(40):
        builder.add_document([rng.integers(1, 500, size=30)])
    builder.finalize(prefix + ".idx")


def dataset(prefix: str) -> GPTDataset:
    indexed = IndexedDataset(prefix)
    config = GPTDatasetConfig(data_prefix=[prefix], split="1", seq_length=16, seed=1, eod=0)
    return GPTDataset(indexed, prefix, np.arange(len(indexed), dtype=np.int32), 50, config, "train")


def test_a_corpus_preprocessed_again_into_the_same_prefix_gets_a_new_index_cache(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix, seed=1)
    first = dataset(prefix)
    assert first.built_indices
    write_corpus(prefix, seed=2)  # same counts: a key of counts alone would reuse the first cache
    os.utime(prefix + ".idx", ns=(1, 1))  # even with the old modification time, the .idx hash differs
    second = dataset(prefix)
    assert second.built_indices and first.description != second.description
    assert dataset(prefix).built_indices is False  # unchanged files: the cache is reused


def test_a_data_file_rewritten_under_the_run_is_named(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix, seed=1)
    indexed = IndexedDataset(prefix)
    assert len(indexed.get(0)) == 30
    with open(prefix + ".bin", "r+b") as data:
        data.truncate(100)
    with pytest.raises(DataFileError, match=r"data file .*corpus\.bin changed while training"):
        indexed.get(3)


def fake_checkpoint(root, common_format=None, manifest_format=None):
    directory = root / "iter_0000005"
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(b"")
    (directory / "common.json").write_text(json.dumps({"format": common_format, "iteration": 5,
                                                       "consumed_samples": 10}))
    if manifest_format is not None:
        (directory / "manifest.json").write_text(json.dumps({"format": manifest_format, "files": {}}))
    (root / "latest_checkpointed_iteration.txt").write_text("5\n")
    return directory


@pytest.mark.parametrize("where", ["common", "manifest"])
def test_a_newer_checkpoint_format_is_refused_naming_both_versions(tmp_path, where):
    newer = FORMAT_VERSION + 1
    fake_checkpoint(tmp_path, common_format=newer if where == "common" else FORMAT_VERSION,
                    manifest_format=newer if where == "manifest" else None)
    with pytest.raises(CheckpointError, match=f"checkpoint format {newer}, newer than the format {FORMAT_VERSION}"):
        load_checkpoint(tmp_path, runner=None, lr_scheduler=None, model=None)


def test_an_older_manifest_format_is_read(tmp_path):
    directory = fake_checkpoint(tmp_path, common_format=1, manifest_format=1)
    assert verify_checkpoint(directory) is True
