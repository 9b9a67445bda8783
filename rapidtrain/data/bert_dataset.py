"""BERT pretraining samples from Megatron indexed data (sentences = sequences, documents = the doc
index): [CLS] A [SEP] B [SEP] pairs, masked LM with 80/10/10 replacement, optional next-sentence labels."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rapidtrain.data.blending import build_blended_splits
from rapidtrain.data.gpt_dataset import SPLIT_NAMES, open_indexed_dataset
from rapidtrain.data.index_cache import (
    DataConfigError,
    check_index_memory,
    index_cache_dir,
    load_or_build_cached_indices,
)
from rapidtrain.data.splits import split_document_ranges

# Megatron skips multi-sentence documents holding a sentence longer than this.
LONG_SENTENCE_LEN = 512


@dataclass
class BERTDatasetConfig:
    """Settings of the BERT pretraining data (--data-path, --split, --seq-length, --mask-prob ...).

    The special ids and vocab size come from the tokenizer; `binary_head` (--bert-binary-head) adds
    next-sentence pairs, which need documents of 2+ sentences.
    """

    data_prefix: list[str]
    split: str
    seq_length: int
    seed: int
    vocab_size: int
    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    binary_head: bool = False
    data_impl: str = "mmap"
    cache_dir: str | None = None

    @property
    def max_tokens(self) -> int:
        """Tokens of A and B together: the sequence less [CLS] and one or two [SEP]."""
        return self.seq_length - (3 if self.binary_head else 2)


def _target_length(max_tokens: int, short_seq_prob: float, rng: np.random.RandomState) -> int:
    # Megatron occasionally draws a shorter target so the model also sees short sequences.
    if short_seq_prob > 0 and rng.random_sample() < short_seq_prob:
        return int(rng.randint(2, max_tokens + 1))
    return max_tokens


def bert_index_problem(mapping: np.ndarray, sentences: int, max_tokens: int) -> str | None:
    """What is wrong with a samples mapping read from the cache (None: nothing): rows of (first sentence, end
    sentence, target length) with first < end <= sentences and a target within --seq-length."""
    if mapping.ndim != 2 or mapping.shape[1] != 3:
        return "unexpected array shape"
    if not len(mapping):
        return None
    first, end, target = (mapping[:, i].astype(np.int64) for i in range(3))
    if first.min() < 0 or end.max() > sentences or not (first < end).all():
        return "its samples name sentences the data does not have"
    if target.min() < 0 or target.max() > max_tokens:
        return f"its target lengths lie outside [0, {max_tokens}]"
    return None


def build_samples_mapping(
    doc_bounds: np.ndarray,
    sizes: np.ndarray,
    num_samples: int,
    max_tokens: int,
    short_seq_prob: float,
    seed: int,
    min_sentences: int,
) -> np.ndarray:
    """[samples, 3] rows (first sentence, end sentence, target length), shuffled.

    Whole epochs over the documents until `num_samples` is reached (at least one epoch). A document
    is cut after a sentence once the piece reaches its target length, keeping at least
    `min_sentences` sentences per piece and never leaving a single sentence behind.
    """
    # The mapping grows as Python tuples (~100 bytes each) before it becomes 24 bytes per sample.
    check_index_memory(124 * num_samples, f"a BERT split of {num_samples:,} samples")
    rng = np.random.RandomState(seed)
    samples: list[tuple[int, int, int]] = []
    epoch = 0
    while epoch == 0 or len(samples) < num_samples:
        before = len(samples)
        for doc in range(len(doc_bounds) - 1):
            first, last = int(doc_bounds[doc]), int(doc_bounds[doc + 1])
            if last - first >= min_sentences and (
                last - first == 1 or sizes[first:last].max() <= LONG_SENTENCE_LEN
            ):
                samples += _cut_document(
                    first, last, sizes, min_sentences, lambda: _target_length(max_tokens, short_seq_prob, rng)
                )
        if len(samples) == before:
            raise DataConfigError(
                f"no BERT sample can be made from this split: no document has {min_sentences}+ sentence(s) "
                f"(with none over {LONG_SENTENCE_LEN} tokens). Next-sentence pairs need documents of 2+ "
                "sentences: preprocess with sentence splitting, or drop --bert-binary-head"
            )
        epoch += 1
    mapping = np.array(samples, dtype=np.int64).reshape(-1, 3)
    return mapping[np.random.RandomState(seed + 1).permutation(len(mapping))]


def _cut_document(
    first: int, last: int, sizes: np.ndarray, min_sentences: int, draw_target: Callable[[], int]
) -> list[tuple[int, int, int]]:
    # Cut after a sentence once the piece reaches its target, unless that would leave one sentence.
    pieces = []
    start, length, target = first, 0, draw_target()
    for sentence in range(first, last):
        length += int(sizes[sentence])
        remaining = last - sentence - 1
        if (length >= target and remaining > 1 and sentence + 1 - start >= min_sentences) or remaining == 0:
            pieces.append((start, sentence + 1, target))
            start, length, target = sentence + 1, 0, draw_target()
    return pieces


def a_and_b_segments(sentences: Sequence[np.ndarray], rng: np.random.RandomState) -> tuple[list, list, bool]:
    """Split the sentences at a random point into A and B; swap them half the time (is_random)."""
    a_end = int(rng.randint(1, len(sentences))) if len(sentences) >= 3 else 1
    tokens_a = [int(t) for s in sentences[:a_end] for t in s]
    tokens_b = [int(t) for s in sentences[a_end:] for t in s]
    is_random = bool(rng.random_sample() < 0.5)
    if is_random:
        tokens_a, tokens_b = tokens_b, tokens_a
    return tokens_a, tokens_b, is_random


def truncate_pair(tokens_a: list, tokens_b: list, max_tokens: int, rng: np.random.RandomState) -> bool:
    """Drop tokens from the front or back of the longer segment until both fit; True if any dropped."""
    truncated = len(tokens_a) + len(tokens_b) > max_tokens
    while len(tokens_a) + len(tokens_b) > max_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        del longer[0 if rng.random_sample() < 0.5 else -1]
    return truncated


def mask_tokens(
    tokens: list[int],
    special_ids: set[int],
    mask_prob: float,
    max_predictions: int,
    vocab_size: int,
    mask_id: int,
    rng: np.random.RandomState,
) -> tuple[list[int], list[int]]:
    """Choose round(mask_prob × len) positions (not special tokens) and replace 80% by [MASK], 10% by
    a random id, 10% unchanged. Returns (masked tokens, sorted masked positions)."""
    candidates = [i for i, t in enumerate(tokens) if t not in special_ids]
    rng.shuffle(candidates)
    count = min(max_predictions, max(1, int(round(len(tokens) * mask_prob))), len(candidates))
    positions = sorted(candidates[:count])
    output = list(tokens)
    for position in positions:
        if rng.random_sample() < 0.8:
            output[position] = mask_id
        elif rng.random_sample() >= 0.5:
            output[position] = int(rng.randint(0, vocab_size))
    return output, positions


class BERTDataset(torch.utils.data.Dataset):
    """Masked-LM (and next-sentence) samples; sample `idx` depends only on (seed, idx)."""

    def __init__(
        self,
        indexed_dataset,
        prefix: str,
        doc_bounds: np.ndarray,
        num_samples: int,
        config: BERTDatasetConfig,
        split_name: str,
    ) -> None:
        self.indexed_dataset = indexed_dataset
        self.config = config
        sizes = np.asarray(indexed_dataset.sequence_lengths)
        self.description = description = "\n".join(
            [
                "class: BERTDataset",
                f"prefix: {os.path.abspath(prefix)}",
                f"sequences: {len(sizes)} tokens: {int(np.sum(sizes, dtype=np.int64))}",
                f"content: {getattr(indexed_dataset, 'fingerprint', '-')}",
                f"split: {split_name} sentences: [{int(doc_bounds[0])}, {int(doc_bounds[-1])})",
                f"num_samples: {num_samples} max_tokens: {config.max_tokens}",
                f"short_seq_prob: {config.short_seq_prob:.4f} seed: {config.seed}",
                f"min_sentences: {2 if config.binary_head else 1}",
            ]
        )
        arrays, self.built_indices = load_or_build_cached_indices(
            index_cache_dir(prefix, config.cache_dir),
            description,
            f"BERTDataset-{split_name}",
            ["samples_mapping"],
            lambda: {
                "samples_mapping": build_samples_mapping(
                    doc_bounds,
                    sizes,
                    num_samples,
                    config.max_tokens,
                    config.short_seq_prob,
                    config.seed,
                    2 if config.binary_head else 1,
                )
            },
            lambda arrays: bert_index_problem(arrays["samples_mapping"], len(sizes), config.max_tokens),
        )
        self.samples_mapping = arrays["samples_mapping"]

    def __len__(self) -> int:
        return self.samples_mapping.shape[0]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each sample before padding, [CLS]/[SEP] included (what --data-iterator dynamic-shape
        buckets by): its sentences' tokens, truncated to the sample's target length."""
        sizes = np.asarray(self.indexed_dataset.sequence_lengths, dtype=np.int64)
        cumulative = np.concatenate([[0], np.cumsum(sizes)])
        first, end, target = (self.samples_mapping[:, i].astype(np.int64) for i in range(3))
        specials = 3 if self.config.binary_head else 2
        return np.minimum(cumulative[end] - cumulative[first], target) + specials

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | np.int64]:
        config = self.config
        first, end, target = (int(x) for x in self.samples_mapping[idx])
        rng = np.random.RandomState((config.seed + idx) % 2**32)
        sentences = [np.asarray(self.indexed_dataset[i]) for i in range(first, end)]
        if config.binary_head:
            tokens_a, tokens_b, is_random = a_and_b_segments(sentences, rng)
        else:
            tokens_a, tokens_b, is_random = [int(t) for s in sentences for t in s], [], False
        truncated = truncate_pair(tokens_a, tokens_b, target, rng)
        tokens = [config.cls_id, *tokens_a, config.sep_id]
        types = [0] * len(tokens)
        if tokens_b:
            tokens += [*tokens_b, config.sep_id]
            types += [1] * (len(tokens_b) + 1)
        special = {config.cls_id, config.sep_id}
        max_predictions = max(1, math.ceil(config.mask_prob * target))
        masked, positions = mask_tokens(
            tokens, special, config.mask_prob, max_predictions, config.vocab_size, config.mask_id, rng
        )
        return self._pad(tokens, masked, types, positions, is_random, truncated)

    def _pad(self, original, masked, types, positions, is_random, truncated) -> dict[str, np.ndarray | np.int64]:
        s, n = self.config.seq_length, len(masked)
        text = np.full(s, self.config.pad_id, dtype=np.int64)
        text[:n] = masked
        labels = np.full(s, -1, dtype=np.int64)
        labels[positions] = np.asarray(original, dtype=np.int64)[positions]
        loss_mask = np.zeros(s, dtype=np.float32)
        loss_mask[positions] = 1.0
        padded_types = np.zeros(s, dtype=np.int64)
        padded_types[:n] = types
        padding_mask = (np.arange(s) < n).astype(np.int64)
        return {
            "text": text,
            "types": padded_types,
            "labels": labels,
            "loss_mask": loss_mask,
            "padding_mask": padding_mask,
            "is_random": np.int64(is_random),
            "truncated": np.int64(truncated),
        }


def build_bert_split_datasets(
    prefix: str, config: BERTDatasetConfig, num_samples: Sequence[int]
) -> list[BERTDataset | None]:
    """Train, valid and test BERTDatasets of one prefix, split by documents; None for an empty split."""
    indexed = open_indexed_dataset(prefix, config.data_impl, config.vocab_size)
    document_indices = np.asarray(indexed.document_indices)
    datasets: list[BERTDataset | None] = []
    ranges = split_document_ranges(len(document_indices) - 1, config.split)
    for name, (begin, end), count in zip(SPLIT_NAMES, ranges, num_samples, strict=True):
        bounds = document_indices[begin : end + 1]
        datasets.append(
            BERTDataset(indexed, prefix, bounds, int(count), config, name) if end > begin else None
        )
    return datasets


def build_bert_datasets(config: BERTDatasetConfig, num_samples: Sequence[int]) -> tuple:
    """(train, valid, test) for --data-path: one prefix or a weighted blend; None for an empty split."""
    return build_blended_splits(
        config.data_prefix,
        num_samples,
        lambda prefix, counts: build_bert_split_datasets(prefix, config, counts),
        config.cache_dir,
    )
