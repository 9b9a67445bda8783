"""GPT pretraining samples from Megatron indexed data: the document, sample and
shuffle indices (built as Megatron builds them, cached as .npy), and the dataset that reads them."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rapidtrain.data.blending import BlendedDataset, build_blended_splits, component_num_samples, normalize_weights
from rapidtrain.data.index_cache import (
    DataConfigError,
    check_index_memory,
    index_cache_dir,
    load_or_build_cached_indices,
)
from rapidtrain.data.indexed import IndexedDataset, check_token_ids
from rapidtrain.data.splits import split_document_ranges
from rapidtrain.data.weighted_splits import WeightedComponent, WeightedGroup

# Megatron separates the final epoch when it contributes less than this fraction of an epoch's samples.
SEPARATE_LAST_EPOCH_THRESHOLD = 0.80

SPLIT_NAMES = ("train", "valid", "test")


def train_valid_test_num_samples(
    train_iters: int, eval_interval: int, eval_iters: int, global_batch_size: int
) -> tuple[int, int, int]:
    """Samples each split must provide for a run, as Megatron's pretraining loop asks for them."""
    evaluations = train_iters // eval_interval + 1
    return (
        train_iters * global_batch_size,
        evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    )


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest E with E × tokens_per_epoch ≥ num_samples × seq_length + 1.

    Each sample reads seq_length + 1 tokens but shares its last token with the next sample,
    so only the final sample needs the extra one.
    """
    if tokens_per_epoch < 2:
        raise DataConfigError(
            f"a data split holds {tokens_per_epoch} token(s); a GPT sample needs at least 2. "
            "Give that split more documents (--split) or use a larger --data-path"
        )
    return max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))


def separate_last_epoch(num_samples: int, tokens_per_epoch: int, seq_length: int, epochs: int) -> bool:
    """Megatron's rule: shuffle the last epoch on its own when it is used for < 80% of its samples."""
    if epochs == 1:
        return False
    samples_before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_from_last = num_samples - samples_before_last
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return samples_from_last < int(SEPARATE_LAST_EPOCH_THRESHOLD * samples_per_epoch)


def build_document_index(
    documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate_last: bool = False
) -> np.ndarray:
    """The documents tiled `epochs` times and shuffled as one array (last epoch apart if asked)."""
    if separate_last and epochs > 1:
        first = build_document_index(documents, epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate([first, last])
    doc_idx = np.tile(np.asarray(documents, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_index(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, epochs: int, tokens_per_epoch: int
) -> np.ndarray:
    """[samples + 1, 2] array of (position in doc_idx, token offset) where each sample starts.

    Sample k covers the seq_length + 1 tokens starting at flat position k·seq_length of the
    documents laid end to end in doc_idx order; sample k ends where sample k + 1 starts (inclusive).
    Megatron walks the documents one by one; the positions are the same, computed at once here.
    """
    num_samples = (epochs * tokens_per_epoch - 1) // seq_length
    doc_lengths = np.asarray(sizes, dtype=np.int64)[doc_idx]
    doc_ends = np.cumsum(doc_lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents, as Megatron's walk does.
    doc_positions = np.searchsorted(doc_ends, positions, side="right")
    offsets = positions - (doc_ends[doc_positions] - doc_lengths[doc_positions])
    sample_idx = np.stack([doc_positions, offsets], axis=1).astype(np.int64)
    sample_idx[0] = (0, 0)  # Megatron starts at (0, 0) even when that document is empty.
    return sample_idx


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by a separate permutation of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_gpt_indices(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """The three index arrays of one split, drawn from one RandomState(seed) in Megatron's order."""
    tokens_per_epoch = int(np.sum(np.asarray(sizes, dtype=np.int64)[documents]))
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    # document index (int32 per document per epoch), sample index (2 int64), shuffle index (≤ int64) per sample
    check_index_memory(4 * epochs * len(documents) + 24 * (num_samples + 1),
                       f"a GPT split of {num_samples:,} samples ({epochs:,} epochs of {len(documents):,} documents)")
    separate_last = separate_last_epoch(num_samples, tokens_per_epoch, seq_length, epochs)
    rng = np.random.RandomState(seed)
    doc_idx = build_document_index(documents, epochs, rng, separate_last)
    sample_idx = build_sample_index(sizes, doc_idx, seq_length, epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    shuffled = ((epochs - 1) * tokens_per_epoch - 1) // seq_length if separate_last else total
    shuffle_idx = build_shuffle_index(shuffled, total, rng)
    return {"document_index": doc_idx, "sample_index": sample_idx, "shuffle_index": shuffle_idx}


def gpt_index_problem(arrays: dict[str, np.ndarray], sizes: np.ndarray, seq_length: int) -> str | None:
    """What is wrong with index arrays read from the cache (None: nothing). Checks the invariant the builder
    guarantees: sample k starts k·seq_length tokens into the documents laid end to end in document-index order,
    at an offset inside its document; and the shuffle index is a permutation of the samples."""
    documents, samples, shuffle = arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]
    if documents.ndim != 1 or samples.ndim != 2 or samples.shape[1] != 2 or shuffle.ndim != 1 or not len(samples):
        return "unexpected array shapes"
    if len(documents) and (documents.min() < 0 or documents.max() >= len(sizes)):
        return "the document index names sequences the data does not have"
    positions, offsets = samples[:, 0], samples[:, 1]
    if positions.min() < 0 or positions.max() >= max(len(documents), 1) or offsets.min() < 0:
        return "the sample index points outside the document index"
    lengths = np.asarray(sizes, dtype=np.int64)[documents] if len(documents) else np.zeros(1, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    expected = np.arange(len(samples), dtype=np.int64) * seq_length
    inside = offsets[1:] < lengths[positions[1:]]
    if not np.array_equal(starts[positions] + offsets, expected) or not inside.all():
        return f"the sample index does not step by --seq-length {seq_length} tokens"
    if len(shuffle) != len(samples) - 1 or (len(shuffle) and shuffle.max() >= len(shuffle)):
        return "the shuffle index is not a permutation of the samples"
    return None


# ---------------------------------------------------------------------------------------------
# The dataset.


@dataclass
class GPTDatasetConfig:
    """Settings of the GPT pretraining data (from --data-path, --split, --seq-length, --seed ...).

    `data_prefix` is one prefix, or `[w1, p1, w2, p2, ...]` for a weighted blend.
    `cache_dir` is --data-cache-path; None puts the index cache in `<prefix dir>/cache/`.
    `mmap_bin=False` (Megatron's --no-mmap-bin-files) is refused: .bin files are always memory-mapped.
    """

    data_prefix: list[str]
    split: str
    seq_length: int
    seed: int
    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    data_impl: str = "mmap"
    cache_dir: str | None = None
    mmap_bin: bool = True
    vocab_size: int | None = None  # the padded vocabulary: token ids are checked against it (sampled) when given
    document_ids: bool = False  # reset_attention_mask as each token's document id (FlexAttention), not a dense mask


def ltor_masks_and_position_ids(
    tokens: np.ndarray,
    labels: np.ndarray,
    eod: int,
    eod_mask_loss: bool,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    document_ids: bool = False,
) -> dict[str, np.ndarray]:
    """Loss mask, position ids and (with resets) the left-to-right attention mask of one sample.

    The attention mask is bool [1, s, s] with True where attention is masked out, as Megatron's. With
    `document_ids` the reset is given as "document_ids" [s] instead (which document each token is in, counted
    from 0): the model's FlexAttention builds a block-sparse mask from them, and no [s, s] array is made.
    """
    s = tokens.shape[0]
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[labels == eod] = 0.0
    # segment[j] = number of end-of-document tokens before position j: a new document starts after each.
    segment = np.concatenate([[0], np.cumsum(tokens[:-1] == eod)])
    positions = np.arange(s, dtype=np.int64)
    if reset_position_ids:
        segment_starts = np.maximum.accumulate(np.where(np.diff(segment, prepend=0) > 0, positions, 0))
        position_ids = positions - segment_starts
    else:
        position_ids = positions
    out: dict[str, np.ndarray] = {"loss_mask": loss_mask, "position_ids": position_ids}
    if reset_attention_mask and document_ids:
        out["document_ids"] = segment.astype(np.int64)
    elif reset_attention_mask:
        allowed = (positions[None, :] <= positions[:, None]) & (segment[None, :] == segment[:, None])
        out["attention_mask"] = ~allowed[None]
    return out


class GPTDataset(torch.utils.data.Dataset):
    """Samples of seq_length + 1 tokens read across document boundaries, in shuffled order."""

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        prefix: str,
        documents: np.ndarray,
        num_samples: int,
        config: GPTDatasetConfig,
        split_name: str,
    ) -> None:
        self.indexed_dataset = indexed_dataset
        self.config = config
        self.split_name = split_name
        sizes = np.asarray(indexed_dataset.sequence_lengths)
        self.description = "\n".join(
            [
                "class: GPTDataset",
                f"prefix: {os.path.abspath(prefix)}",
                f"sequences: {len(sizes)} tokens: {int(np.sum(sizes, dtype=np.int64))}",
                f"content: {getattr(indexed_dataset, 'fingerprint', '-')}",
                f"split: {split_name} documents: [{int(documents[0])}, {int(documents[-1]) + 1})",
                f"num_samples: {num_samples}",
                f"seq_length: {config.seq_length}",
                f"seed: {config.seed}",
            ]
        )
        arrays, self.built_indices = load_or_build_cached_indices(
            index_cache_dir(prefix, config.cache_dir),
            self.description,
            f"GPTDataset-{split_name}",
            ["document_index", "sample_index", "shuffle_index"],
            lambda: build_gpt_indices(sizes, documents, num_samples, config.seq_length, config.seed),
            lambda arrays: gpt_index_problem(arrays, sizes, config.seq_length),
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample `idx` (after shuffling)."""
        i = int(self.shuffle_index[idx])
        first_doc, first_offset = (int(x) for x in self.sample_index[i])
        last_doc, last_offset = (int(x) for x in self.sample_index[i + 1])
        parts = []
        for position in range(first_doc, last_doc + 1):
            offset = first_offset if position == first_doc else 0
            # The last piece ends at last_offset inclusive: the token shared with the next sample.
            length = last_offset + 1 - offset if position == last_doc else None
            parts.append(self.indexed_dataset.get(int(self.document_index[position]), offset, length))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        sample = self.sample_tokens(idx)
        tokens, labels = sample[:-1], sample[1:]
        config = self.config
        masks = ltor_masks_and_position_ids(
            tokens,
            labels,
            config.eod,
            config.eod_mask_loss,
            config.reset_position_ids,
            config.reset_attention_mask,
            config.document_ids,
        )
        return {"tokens": tokens, "labels": labels, **masks}


def open_indexed_dataset(prefix: str, data_impl: str = "mmap", vocab_size: int | None = None) -> IndexedDataset:
    """The IndexedDataset at `prefix` (its errors name --data-path and the fix), refused when it holds no
    tokens, and with its token ids checked (sampled) against `vocab_size` when given."""
    dataset = IndexedDataset(prefix, impl=data_impl)
    if len(dataset.document_indices) < 2 or not np.any(np.asarray(dataset.sequence_lengths)):
        raise DataConfigError(
            f"--data-path {prefix}: the dataset holds no tokens ({len(dataset.document_indices) - 1} documents); "
            "was its JSON-lines input empty? Rebuild it with scripts/preprocess_data.py from a file with text."
        )
    if vocab_size is not None:
        check_token_ids(dataset, vocab_size)
    return dataset


def build_gpt_split_datasets(
    prefix: str, config: GPTDatasetConfig, num_samples: Sequence[int]
) -> list[GPTDataset | None]:
    """Train, valid and test GPTDatasets of one prefix; None for a split with no documents."""
    indexed = open_indexed_dataset(prefix, config.data_impl, config.vocab_size)
    datasets: list[GPTDataset | None] = []
    for name, (begin, end), count in zip(
        SPLIT_NAMES, split_document_ranges(len(indexed), config.split), num_samples, strict=True
    ):
        documents = np.arange(begin, end, dtype=np.int32)
        datasets.append(
            GPTDataset(indexed, prefix, documents, int(count), config, name) if end > begin else None
        )
    return datasets


def build_gpt_datasets(config: GPTDatasetConfig, train_valid_test_num_samples: Sequence[int]) -> tuple:
    """(train, valid, test) for --data-path: one prefix, or a weighted blend; None for an empty split."""
    if not config.mmap_bin:
        raise DataConfigError(
            "GPTDatasetConfig.mmap_bin=False (Megatron's --no-mmap-bin-files) is not supported: .bin files "
            "of --data-impl mmap are always memory-mapped; use --data-impl lazy for legacy files read on demand"
        )
    return build_blended_splits(
        config.data_prefix,
        train_valid_test_num_samples,
        lambda prefix, counts: build_gpt_split_datasets(prefix, config, counts),
        config.cache_dir,
    )


def build_gpt_range_dataset(component: WeightedComponent, config: GPTDatasetConfig, num_samples: int,
                            split_name: str) -> GPTDataset:
    """A GPTDataset over the documents of `component.prefix` between its two fractions (BigScience's START:END)."""
    indexed = open_indexed_dataset(component.prefix, config.data_impl, config.vocab_size)
    begin, end = component.document_range(len(indexed))
    if end <= begin:
        raise DataConfigError(
            f"--{split_name}-weighted-split-paths: {component.start:g}:{component.end:g} of {component.prefix}'s "
            f"{len(indexed)} documents holds none; widen the range or use more documents")
    documents = np.arange(begin, end, dtype=np.int32)
    return GPTDataset(indexed, component.prefix, documents, int(num_samples), config, split_name)


def build_weighted_group(group: WeightedGroup, config: GPTDatasetConfig, num_samples: int,
                         split_name: str) -> GPTDataset | BlendedDataset:
    """One weighted group: its one component, or a blend of `num_samples` drawn by the normalized weights, each
    component built with its share plus Megatron's margin."""
    if len(group.components) == 1:
        return build_gpt_range_dataset(group.components[0], config, num_samples, split_name)
    weights = normalize_weights(group.weights)
    parts = [build_gpt_range_dataset(component, config, counts[0], split_name)
             for component, counts in zip(group.components, component_num_samples(weights, [num_samples]),
                                          strict=True)]
    return BlendedDataset(parts, weights, num_samples, index_cache_dir(group.components[0].prefix, config.cache_dir))
