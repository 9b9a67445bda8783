"""GPT dataset: --split parsing, Megatron's doc/sample/shuffle indices, the .npy cache, samples, blending."""

from __future__ import annotations

import hashlib
import os
import socket

import numpy as np
import pytest
import torch

from rapidtrain.data.blending import (
    BlendedDataset,
    DataPathError,
    build_blending_indices,
    component_num_samples,
    parse_data_path,
)
from rapidtrain.data.gpt_dataset import (
    GPTDatasetConfig,
    build_document_index,
    build_gpt_datasets,
    build_gpt_indices,
    build_sample_index,
    build_shuffle_index,
    ltor_masks_and_position_ids,
    num_epochs,
    separate_last_epoch,
    train_valid_test_num_samples,
)
from rapidtrain.data.index_cache import DataConfigError
from rapidtrain.data.indexed import IndexedDatasetBuilder, MissingDataFileError
from rapidtrain.data.splits import parse_split, split_document_ranges

EOD = 0


def write_corpus(prefix: str, documents: list[list[int]]) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for tokens in documents:
        builder.add_item(tokens)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def random_documents(count: int, seed: int, max_len: int = 40) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    # Every document ends with EOD, as preprocess_data.py --append-eod writes them.
    return [list(rng.randint(1, 500, size=rng.randint(1, max_len))) + [EOD] for _ in range(count)]


def megatron_walk(sizes, doc_idx, seq_length, epochs, tokens_per_epoch):
    """Megatron's helpers.cpp build_sample_idx, one document at a time, as an independent reference."""
    num_samples = (epochs * tokens_per_epoch - 1) // seq_length
    out = [(0, 0)]
    position, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[doc_idx[position]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                position, offset = position + 1, 0
        out.append((position, offset))
    return np.array(out)


# --- --split and sample counts ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("969, 30, 1", [0.969, 0.030, 0.001]),
        ("8/1/1", [0.8, 0.1, 0.1]),
        ("1 1", [0.5, 0.5, 0.0]),
        ("100", [1.0, 0.0, 0.0]),
    ],
)
def test_parse_split_takes_numbers_whatever_the_separators(text, expected):
    assert parse_split(text) == pytest.approx(expected)


def test_parse_split_rejects_bad_strings_naming_the_flag():
    for bad in ("", "a,b", "1,2,3,4", "0,0,0"):
        with pytest.raises(DataConfigError, match="--split"):
            parse_split(bad)


def test_split_document_ranges_round_cumulative_bounds():
    assert split_document_ranges(10, "8,1,1") == [(0, 8), (8, 9), (9, 10)]
    assert split_document_ranges(1000, "969, 30, 1") == [(0, 969), (969, 999), (999, 1000)]
    # 0.5·5 = 2.5 rounds half to even (Python's round, as Megatron): 2.
    assert split_document_ranges(5, "1 1") == [(0, 2), (2, 5), (5, 5)]
    # 0.7·7 = 4.9 → 5, 0.9·7 = 6.3 → 6.
    assert split_document_ranges(7, "70/20/10") == [(0, 5), (5, 6), (6, 7)]


def test_train_valid_test_num_samples_as_megatron_counts_them():
    # train 100 × 8; valid (100 // 20 + 1) × 5 × 8 = 240; test 5 × 8.
    assert train_valid_test_num_samples(100, 20, 5, 8) == (800, 240, 40)


# --- index arrays, hand-worked -----------------------------------------------------------------


def test_num_epochs_is_smallest_covering_samples_times_length_plus_one():
    assert num_epochs(10, 4, 4) == 2  # 4·4 + 1 = 17 tokens > 10
    assert num_epochs(10, 4, 2) == 1  # 9 tokens
    assert num_epochs(10, 3, 3) == 1  # exactly 10
    assert num_epochs(10, 3, 4) == 2  # 13
    assert num_epochs(10, 4, 0) == 1
    with pytest.raises(DataConfigError):
        num_epochs(1, 4, 1)


def test_separate_last_epoch_below_eighty_percent():
    # T=100, s=10, n=10: 2 epochs; 9 samples come before the last, 1 from it; 1 < int(0.8·9) = 7.
    assert separate_last_epoch(10, 100, 10, 2) is True
    # T=10, s=4, n=4: 2 from the last epoch, int(0.8·2) = 1.
    assert separate_last_epoch(4, 10, 4, 2) is False
    assert separate_last_epoch(1, 100, 10, 1) is False


def test_document_index_tiles_epochs_and_shuffles_once():
    doc_idx = build_document_index(np.array([5, 6, 7]), 2, np.random.RandomState(3))
    expected = np.array([5, 6, 7, 5, 6, 7], dtype=np.int32)
    np.random.RandomState(3).shuffle(expected)
    assert doc_idx.dtype == np.int32
    np.testing.assert_array_equal(doc_idx, expected)


def test_document_index_separate_last_epoch_keeps_each_epoch_whole():
    doc_idx = build_document_index(np.arange(4), 3, np.random.RandomState(0), separate_last=True)
    assert sorted(doc_idx[:8]) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sorted(doc_idx[8:]) == [0, 1, 2, 3]


def test_sample_index_hand_worked():
    # Documents 0,1,2 of 3,5,2 tokens, laid out in doc_idx order [2,0,1,2,0,1]:
    # positions 0-1 doc2 | 2-4 doc0 | 5-9 doc1 | 10-11 doc2 | 12-14 doc0 | 15-19 doc1.
    # 2 epochs × 10 tokens, seq 4: (20 - 1) // 4 = 4 samples starting at positions 0, 4, 8, 12, 16.
    sizes = np.array([3, 5, 2], dtype=np.int32)
    doc_idx = np.array([2, 0, 1, 2, 0, 1], dtype=np.int32)
    sample_idx = build_sample_index(sizes, doc_idx, 4, 2, 10)
    np.testing.assert_array_equal(sample_idx, [[0, 0], [1, 2], [2, 3], [4, 0], [5, 1]])


def test_sample_index_matches_megatron_walk_with_empty_documents():
    rng = np.random.RandomState(0)
    for trial in range(20):
        sizes = rng.randint(0, 12, size=15).astype(np.int32)
        sizes[0] = max(sizes[0], 2)
        docs = np.arange(15)
        seq_length = int(rng.randint(2, 9))
        epochs = int(rng.randint(1, 4))
        tokens = int(sizes.sum())
        doc_idx = build_document_index(docs, epochs, rng)
        ours = build_sample_index(sizes, doc_idx, seq_length, epochs, tokens)
        theirs = megatron_walk(sizes, doc_idx, seq_length, epochs, tokens)
        np.testing.assert_array_equal(ours, theirs, err_msg=f"trial {trial}")


def test_shuffle_index_permutes_the_two_parts_separately():
    shuffle = build_shuffle_index(3, 5, np.random.RandomState(1))
    first, last = np.arange(3, dtype=np.uint32), np.arange(3, 5, dtype=np.uint32)
    rng = np.random.RandomState(1)
    rng.shuffle(first)
    rng.shuffle(last)
    assert shuffle.dtype == np.uint32
    np.testing.assert_array_equal(shuffle, np.concatenate([first, last]))


def test_build_gpt_indices_separates_last_epoch_in_shuffle():
    sizes = np.full(10, 10, dtype=np.int32)  # T = 100
    arrays = build_gpt_indices(sizes, np.arange(10), num_samples=10, seq_length=10, seed=5)
    assert len(arrays["document_index"]) == 20
    assert len(arrays["sample_index"]) == (200 - 1) // 10 + 1
    shuffle = arrays["shuffle_index"]
    assert sorted(shuffle[:9]) == list(range(9))
    assert sorted(shuffle[9:]) == list(range(9, 19))


# --- masks -------------------------------------------------------------------------------------


def test_masks_reset_positions_and_attention_after_eod():
    tokens = np.array([5, 6, EOD, 7, 8, EOD, 9])
    labels = np.array([6, EOD, 7, 8, EOD, 9, 3])
    out = ltor_masks_and_position_ids(tokens, labels, EOD, True, True, True)
    np.testing.assert_array_equal(out["position_ids"], [0, 1, 2, 0, 1, 2, 0])
    np.testing.assert_array_equal(out["loss_mask"], [1, 0, 1, 1, 0, 1, 1])
    mask = out["attention_mask"]
    assert mask.shape == (1, 7, 7) and mask.dtype == bool
    # Row 4 (token 8) sees tokens 3 and 4 only; row 2 (first EOD) sees 0..2.
    np.testing.assert_array_equal(~mask[0, 4], [0, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(~mask[0, 2], [1, 1, 1, 0, 0, 0, 0])
    plain = ltor_masks_and_position_ids(tokens, labels, EOD, False, False, False)
    np.testing.assert_array_equal(plain["position_ids"], np.arange(7))
    assert plain["loss_mask"].sum() == 7 and "attention_mask" not in plain


# --- datasets from real files ------------------------------------------------------------------


def make_config(prefix: str, **overrides) -> GPTDatasetConfig:
    settings = dict(data_prefix=[prefix], split="8,1,1", seq_length=16, seed=1234, eod=EOD)
    settings.update(overrides)
    return GPTDatasetConfig(**settings)


def test_samples_are_consecutive_windows_sharing_one_token(tmp_path):
    documents = random_documents(50, seed=0)
    prefix = write_corpus(str(tmp_path / "corpus"), documents)
    train, valid, test = build_gpt_datasets(make_config(prefix), (100, 10, 10))
    assert len(train) >= 100 and len(valid) >= 10 and len(test) >= 10
    # The train split holds documents [0, 40); its document order is doc_idx; flatten it.
    flat = np.concatenate([documents[d] for d in train.document_index])
    for i in range(len(train)):
        k = int(train.shuffle_index[i])
        np.testing.assert_array_equal(train.sample_tokens(i), flat[k * 16 : k * 16 + 17])
    item = train[0]
    assert set(item) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert item["tokens"].dtype == np.int64 and item["tokens"].shape == (16,)
    np.testing.assert_array_equal(item["tokens"][1:], item["labels"][:-1])
    assert set(np.unique(np.asarray(train.document_index))) == set(range(40))
    assert set(np.unique(np.asarray(test.document_index))) == {45, 46, 47, 48, 49}


def test_eod_mask_loss_and_attention_mask_in_items(tmp_path):
    prefix = write_corpus(str(tmp_path / "c"), random_documents(30, seed=1, max_len=6))
    config = make_config(prefix, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    train, _, _ = build_gpt_datasets(config, (20, 2, 2))
    item = train[3]
    np.testing.assert_array_equal(item["loss_mask"] == 0, item["labels"] == EOD)
    assert item["attention_mask"].shape == (1, 16, 16)
    assert (item["loss_mask"] == 0).any()


def test_cache_reused_and_identical_across_builds(tmp_path):
    prefix = write_corpus(str(tmp_path / "corpus"), random_documents(40, seed=2))
    first, _, _ = build_gpt_datasets(make_config(prefix), (64, 8, 8))
    second, _, _ = build_gpt_datasets(make_config(prefix), (64, 8, 8))
    assert first.built_indices and not second.built_indices
    assert isinstance(second.sample_index, np.memmap)
    key = hashlib.md5(first.description.encode()).hexdigest()
    cached = sorted(os.listdir(tmp_path / "cache"))
    assert f"{key}-GPTDataset-train-sample_index.npy" in cached
    elsewhere, _, _ = build_gpt_datasets(make_config(prefix, cache_dir=str(tmp_path / "other")), (64, 8, 8))
    assert elsewhere.built_indices
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
        np.testing.assert_array_equal(getattr(first, name), getattr(elsewhere, name))
    different, _, _ = build_gpt_datasets(make_config(prefix, seed=7), (64, 8, 8))
    assert different.built_indices
    assert not np.array_equal(first.shuffle_index, different.shuffle_index)


def _rank_worker(rank: int, world: int, port: int, prefix: str, out_dir: str, shared: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    cache = os.path.join(out_dir, "cache" if shared else f"cache{rank}")
    train, _, _ = build_gpt_datasets(make_config(prefix, cache_dir=cache), (64, 8, 8))
    np.save(os.path.join(out_dir, f"sample{rank}.npy"), np.asarray(train.sample_index))
    np.save(os.path.join(out_dir, f"shuffle{rank}.npy"), np.asarray(train.shuffle_index))
    np.save(os.path.join(out_dir, f"built{rank}.npy"), np.array(train.built_indices))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("shared", [True, False])
def test_ranks_get_identical_indices_rank0_builds(tmp_path, shared):
    prefix = write_corpus(str(tmp_path / "corpus"), random_documents(40, seed=3))
    with socket.socket() as probe:  # a free port: other test runs may share this machine
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.start_processes(
        _rank_worker, args=(2, port, prefix, str(tmp_path), shared), nprocs=2, start_method="fork"
    )
    for name in ("sample", "shuffle"):
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}0.npy"), np.load(tmp_path / f"{name}1.npy"))
    assert np.load(tmp_path / "built0.npy")
    # On a shared file system rank 1 only reads; on separate ones it rebuilds the same arrays.
    assert bool(np.load(tmp_path / "built1.npy")) is (not shared)


def test_missing_prefix_names_data_path(tmp_path):
    with pytest.raises(MissingDataFileError, match="--data-path"):
        build_gpt_datasets(make_config(str(tmp_path / "nothing")), (1, 1, 1))


def test_unmapped_bin_is_refused_not_ignored(tmp_path):
    prefix = write_corpus(str(tmp_path / "c"), random_documents(10, seed=4))
    with pytest.raises(DataConfigError, match="mmap_bin=False"):
        build_gpt_datasets(make_config(prefix, mmap_bin=False), (8, 0, 0))


def test_empty_split_is_none(tmp_path):
    prefix = write_corpus(str(tmp_path / "c"), random_documents(10, seed=4))
    train, valid, test = build_gpt_datasets(make_config(prefix, split="1,0,0"), (8, 0, 0))
    assert train is not None and valid is None and test is None


# --- blending ----------------------------------------------------------------------------------


def test_parse_data_path_pairs_and_normalizes():
    assert parse_data_path(["corpus"]) == (["corpus"], [1.0])
    assert parse_data_path(["3", "a", "1", "b"]) == (["a", "b"], [0.75, 0.25])
    assert parse_data_path(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    for bad in (["1", "a", "b"], ["x", "a", "1", "b"], []):
        with pytest.raises(DataPathError, match="--data-path"):
            parse_data_path(bad)


def test_blending_index_greedy_hand_worked():
    # weights .5/.25/.25, error = weight × max(i, 1) − count, largest wins, ties to the lowest index:
    # i=0: .5 .25 .25 → 0 | i=1: −.5 .25 .25 → 1 | i=2: 0 −.5 .5 → 2 | i=3: .5 −.25 −.25 → 0
    # i=4: 0 0 0 → 0 | i=5: −.5 .25 .25 → 1
    dataset_index, sample_index = build_blending_indices([0.5, 0.25, 0.25], 6)
    np.testing.assert_array_equal(dataset_index, [0, 1, 2, 0, 0, 1])
    np.testing.assert_array_equal(sample_index, [0, 0, 0, 1, 2, 1])


def test_blend_components_get_margin_and_fractions_follow_weights(tmp_path):
    assert component_num_samples([0.7, 0.3], [1000, 10, 0]) == [
        [704, 8, 0],
        [302, 4, 0],
    ]  # ceil(0.7·1000·1.005) = ceil(703.5)
    a = write_corpus(str(tmp_path / "a"), random_documents(30, seed=5))
    b = write_corpus(str(tmp_path / "b"), random_documents(30, seed=6))
    config = make_config(a, data_prefix=["0.7", a, "0.3", b])
    train, valid, _ = build_gpt_datasets(config, (200, 20, 20))
    assert isinstance(train, BlendedDataset) and len(train) == 200 and len(valid) == 20
    counts = np.bincount(train.dataset_index)
    assert counts.tolist() == [140, 60]
    assert len(train.datasets[0]) >= 141 and len(train.datasets[1]) >= 61
    again, _, _ = build_gpt_datasets(config, (200, 20, 20))
    assert train.built_indices and not again.built_indices
    assert any("BlendedDataset-dataset_index" in name for name in os.listdir(tmp_path / "cache"))
    np.testing.assert_array_equal(again.dataset_sample_index, train.dataset_sample_index)
    np.testing.assert_array_equal(
        train[5]["tokens"], train.datasets[train.dataset_index[5]][train.dataset_sample_index[5]]["tokens"]
    )
