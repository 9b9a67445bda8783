"""BERT dataset: sample mapping over sentences, [CLS] A [SEP] B [SEP] layout, masking proportions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rapidtrain.data.bert_dataset import (
    BERTDatasetConfig,
    build_bert_datasets,
    build_samples_mapping,
    mask_tokens,
    truncate_pair,
)
from rapidtrain.data.index_cache import DataConfigError
from rapidtrain.data.indexed import IndexedDatasetBuilder

PAD, CLS, SEP, MASK = 0, 1, 2, 3
VOCAB = 2000
FIRST_WORD = 10


def write_sentences(prefix: str, documents: list[list[list[int]]]) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for sentences in documents:
        builder.add_document(sentences)
    builder.finalize(prefix + ".idx")
    return prefix


def random_documents(count: int, seed: int) -> list[list[list[int]]]:
    rng = np.random.RandomState(seed)
    return [
        [list(rng.randint(FIRST_WORD, VOCAB, size=rng.randint(3, 20))) for _ in range(rng.randint(1, 6))]
        for _ in range(count)
    ]


def make_config(prefix: str, **overrides) -> BERTDatasetConfig:
    settings = dict(
        data_prefix=[prefix],
        split="8,1,1",
        seq_length=64,
        seed=11,
        vocab_size=VOCAB,
        cls_id=CLS,
        sep_id=SEP,
        mask_id=MASK,
        pad_id=PAD,
        binary_head=True,
    )
    settings.update(overrides)
    return BERTDatasetConfig(**settings)


def test_samples_mapping_hand_worked():
    # Two documents: sentences [0, 3) of 4, 4, 4 tokens and [3, 5) of 10, 1 tokens; target 6 tokens.
    # Doc 0: after sentence 0 (4 < 6) go on; after sentence 1 (8 ≥ 6) only 1 sentence remains,
    # so no cut; the document ends: one sample [0, 3). Doc 1: [3, 5).
    mapping = build_samples_mapping(np.array([0, 3, 5]), np.array([4, 4, 4, 10, 1]), 1, 6, 0.0, 1, 2)
    assert sorted(map(tuple, mapping.tolist())) == [(0, 3, 6), (3, 5, 6)]
    # With 5 sentences of 4 tokens the document is cut after sentence 1 (8 ≥ 6, 3 remain).
    mapping = build_samples_mapping(np.array([0, 5]), np.full(5, 4), 1, 6, 0.0, 1, 2)
    assert sorted(map(tuple, mapping.tolist())) == [(0, 2, 6), (2, 5, 6)]
    # Enough samples needs whole epochs: 2 per epoch, 5 asked → 3 epochs → 6 rows.
    assert len(build_samples_mapping(np.array([0, 5]), np.full(5, 4), 5, 6, 0.0, 1, 2)) == 6


def test_samples_mapping_refuses_single_sentence_documents_for_binary_head():
    with pytest.raises(DataConfigError, match="--bert-binary-head"):
        build_samples_mapping(np.array([0, 1, 2]), np.array([5, 5]), 4, 10, 0.0, 1, 2)


def test_truncate_pair_trims_the_longer_segment():
    a, b = list(range(10)), [100, 101]
    assert truncate_pair(a, b, 6, np.random.RandomState(0)) is True
    assert len(a) == 4 and b == [100, 101]
    assert truncate_pair(a, b, 6, np.random.RandomState(0)) is False


def test_mask_tokens_count_and_specials_untouched():
    tokens = [CLS] + list(range(FIRST_WORD, FIRST_WORD + 38)) + [SEP]  # 40 tokens → round(6.0) = 6
    masked, positions = mask_tokens(tokens, {CLS, SEP}, 0.15, 20, VOCAB, MASK, np.random.RandomState(0))
    assert len(positions) == 6 and 0 not in positions and 39 not in positions
    changed = [i for i in range(40) if masked[i] != tokens[i]]
    assert set(changed) <= set(positions)


def test_items_layout_padding_and_determinism(tmp_path):
    prefix = write_sentences(str(tmp_path / "bert"), random_documents(60, seed=0))
    train, valid, test = build_bert_datasets(make_config(prefix), (50, 5, 5))
    assert len(train) >= 50 and valid is not None and test is not None
    item = train[7]
    assert {k: v.dtype for k, v in item.items()} == {
        "text": np.int64,
        "types": np.int64,
        "labels": np.int64,
        "loss_mask": np.float32,
        "padding_mask": np.int64,
        "is_random": np.int64,
        "truncated": np.int64,
    }
    n = int(item["padding_mask"].sum())
    text, types = item["text"], item["types"]
    assert text[0] == CLS and text[n - 1] == SEP and (text[n:] == PAD).all()
    seps = np.flatnonzero(text[:n] == SEP)
    assert len(seps) == 2  # [CLS] A [SEP] B [SEP]
    assert (types[: seps[0] + 1] == 0).all() and (types[seps[0] + 1 : n] == 1).all()
    masked = item["loss_mask"] == 1
    assert (item["labels"][~masked] == -1).all() and (item["labels"][masked] >= FIRST_WORD).all()
    again, _, _ = build_bert_datasets(make_config(prefix), (50, 5, 5))
    assert not again.built_indices
    for key in item:
        np.testing.assert_array_equal(item[key], again[7][key])


def test_masking_proportions_on_many_samples(tmp_path):
    prefix = write_sentences(str(tmp_path / "bert"), random_documents(300, seed=1))
    train, _, _ = build_bert_datasets(make_config(prefix, split="1,0,0"), (2000, 0, 0))
    chosen = replaced_by_mask = kept = random = tokens = is_random = 0
    for i in range(2000):
        item = train[i]
        n = int(item["padding_mask"].sum())
        target = int(train.samples_mapping[i][2])
        positions = np.flatnonzero(item["loss_mask"])
        # round(15% of the tokens), at least 1, at most ceil(15% of the target), never [CLS]/[SEP].
        assert len(positions) == min(max(1, round(n * 0.15)), math.ceil(0.15 * target), n - 3)
        tokens += n
        chosen += len(positions)
        original, now = item["labels"][positions], item["text"][positions]
        replaced_by_mask += int((now == MASK).sum())
        kept += int((now == original).sum())
        random += int(((now != MASK) & (now != original)).sum())
        is_random += int(item["is_random"])
    assert chosen / tokens == pytest.approx(0.15, abs=0.01)
    assert replaced_by_mask / chosen == pytest.approx(0.8, abs=0.02)
    assert kept / chosen == pytest.approx(0.1, abs=0.015)
    assert random / chosen == pytest.approx(0.1, abs=0.015)
    assert is_random / 2000 == pytest.approx(0.5, abs=0.04)


def test_short_seq_prob_draws_shorter_targets(tmp_path):
    prefix = write_sentences(str(tmp_path / "bert"), random_documents(300, seed=2))
    config = make_config(prefix, split="1,0,0", short_seq_prob=0.3)
    train, _, _ = build_bert_datasets(config, (500, 0, 0))
    targets = np.asarray(train.samples_mapping)[:, 2]
    short = (targets < config.max_tokens).mean()
    assert config.max_tokens == 61 and targets.max() == 61 and targets.min() >= 2
    assert short == pytest.approx(0.3, abs=0.06)


def test_without_binary_head_one_segment(tmp_path):
    documents = [[[FIRST_WORD + i] * 5] for i in range(20)]  # one sentence per document
    prefix = write_sentences(str(tmp_path / "bert"), documents)
    train, _, _ = build_bert_datasets(make_config(prefix, binary_head=False, short_seq_prob=0.0), (10, 1, 1))
    item = train[0]
    n = int(item["padding_mask"].sum())
    assert n == 7 and item["text"][n - 1] == SEP and (item["types"] == 0).all() and item["is_random"] == 0
