"""Weighted blends of datasets (`--data-path w1 p1 w2 p2 ...`): parsing, Megatron's greedy blending
index, and the per-component sample counts with Megatron's 0.5% margin."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from rapidtrain.core.errors import UserError
from rapidtrain.data.index_cache import DataConfigError, index_cache_dir, load_or_build_cached_indices

# Megatron asks each component for 0.5% more than its share, so rounding never runs it dry.
BLEND_MARGIN = 1.005


class DataPathError(UserError, ValueError):
    """--data-path is malformed: the message says how and shows the expected form."""


def _is_dataset(prefix: str) -> bool:
    return os.path.isfile(prefix + ".idx") or os.path.isfile(prefix + ".bin")


def _items(data_path: Sequence[str]) -> list[str]:
    """The tokens of --data-path: an entry is split on whitespace (a blend quoted as one string, "0.7 a 0.3 b"),
    unless the entry as a whole names a dataset: a path with a space in it."""
    items = []
    for entry in map(str, data_path):
        items += [entry] if " " in entry.strip() and _is_dataset(entry) else entry.split()
    return items


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """`[p]` → ([p], [1.0]); `[w1, p1, w2, p2, ...]` → (prefixes, weights normalized to sum 1)."""
    items = _items(data_path)
    if not items:
        raise DataPathError("--data-path is empty; give a prefix, or weights and prefixes: 0.7 a 0.3 b")
    spaced = [entry for entry in map(str, data_path) if len(entry.split()) > 1 and not _is_dataset(entry)]
    hint = (f" (--data-path {spaced[0]!r} was read as several items because it has a space and no dataset "
            f"{spaced[0]!r}.idx exists: check the path)" if spaced else "")
    if len(items) == 1:
        return items, [1.0]
    if len(items) % 2:
        raise DataPathError(
            f"--data-path {' '.join(items)}: a blend needs weight/prefix pairs (w1 p1 w2 p2 ...), "
            f"got {len(items)} items{hint}"
        )
    weights, prefixes = [], []
    for position, (weight, prefix) in enumerate(zip(items[0::2], items[1::2], strict=True)):
        try:
            weights.append(float(weight))
        except ValueError:
            raise DataPathError(
                f"--data-path: item {2 * position + 1}, {weight!r}, should be a number: the weight of the prefix "
                f"after it ({prefix!r}); a blend is written w1 p1 w2 p2 ...{hint}"
            ) from None
        prefixes.append(prefix)
    return prefixes, normalize_weights(weights)


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum; they must be non-negative with a positive sum."""
    if not all(math.isfinite(w) for w in weights):
        raise DataPathError(f"--data-path weights {list(weights)}: each weight must be a finite number (not nan or "
                            "inf): a blend is written w1 p1 w2 p2 ...")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataPathError(f"--data-path weights {list(weights)} must be non-negative with a positive sum")
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def component_num_samples(weights: Sequence[float], num_samples: Sequence[int]) -> list[list[int]]:
    """Per component, per split: ceil(weight × samples × 1.005)."""
    return [[int(math.ceil(w * n * BLEND_MARGIN)) for n in num_samples] for w in weights]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample: which dataset, and which sample of it.

    Greedy, as Megatron's helpers.cpp: sample i goes to the dataset whose count lags
    weight × max(i, 1) the most (ties to the lowest index), so every prefix of the blend follows
    the weights as closely as whole samples allow.
    """
    weights = [float(w) for w in weights]
    others = range(1, len(weights))
    counts = [0] * len(weights)
    chosen = [0] * size
    for i in range(size):
        target = i if i > 1 else 1.0
        best, best_error = 0, weights[0] * target - counts[0]
        for d in others:
            error = weights[d] * target - counts[d]
            if error > best_error:  # strictly greater: ties stay with the lower index
                best, best_error = d, error
        chosen[i] = best
        counts[best] += 1
    dataset_index = np.array(chosen, dtype=np.int16)
    # The k-th time dataset d is chosen it serves its sample k.
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for d in range(len(weights)):
        where = dataset_index == d
        dataset_sample_index[where] = np.arange(int(where.sum()))
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in the proportions of `weights`.

    With `cache_dir`, the blending index is cached as .npy like the datasets' own indices (rank 0
    builds it); the key covers the weights, the size and each component's `description`.
    """

    def __init__(
        self, datasets: Sequence, weights: Sequence[float], size: int, cache_dir: str | None = None
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        self.built_indices = True  # False when read from the cache
        self.dataset_index, self.dataset_sample_index = self._blending_indices(cache_dir)
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, dataset in enumerate(self.datasets):
            if needed[d] > len(dataset):
                raise ValueError(
                    f"blended component {d} has {len(dataset)} samples but the blend needs {needed[d]}; "
                    "build each component with component_num_samples(...)"
                )

    def _blending_indices(self, cache_dir: str | None) -> tuple[np.ndarray, np.ndarray]:
        descriptions = [getattr(d, "description", None) for d in self.datasets]
        if cache_dir is None or None in descriptions:
            return build_blending_indices(self.weights, self.size)
        description = "\n".join(
            ["class: BlendedDataset", f"weights: {self.weights}", f"size: {self.size}", *map(str, descriptions)]
        )
        names = ["dataset_index", "dataset_sample_index"]

        def build() -> dict[str, np.ndarray]:
            return dict(zip(names, build_blending_indices(self.weights, self.size), strict=True))

        arrays, self.built_indices = load_or_build_cached_indices(
            cache_dir, description, "BlendedDataset", names, build, self._index_problem
        )
        return arrays["dataset_index"], arrays["dataset_sample_index"]

    def _index_problem(self, arrays: dict[str, np.ndarray]) -> str | None:
        """What is wrong with blending indices read from the cache (None: nothing)."""
        which, sample = arrays["dataset_index"], arrays["dataset_sample_index"]
        if which.shape != (self.size,) or sample.shape != (self.size,):
            return f"they do not hold {self.size} samples"
        if not self.size:
            return None
        if which.min() < 0 or which.max() >= len(self.datasets):
            return "they name components the blend does not have"
        sizes = np.array([len(d) for d in self.datasets], dtype=np.int64)
        if sample.min() < 0 or not (sample.astype(np.int64) < sizes[which]).all():
            return "they name samples past a component's end"
        return None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        dataset = int(self.dataset_index[idx])
        return self.datasets[dataset][int(self.dataset_sample_index[idx])]


def build_blended_splits(
    data_path: Sequence[str],
    num_samples: Sequence[int],
    build_splits: Callable[[str, Sequence[int]], Sequence],
    cache_dir: str | None = None,
) -> tuple:
    """(train, valid, test) for one prefix or a weighted blend of prefixes.

    `build_splits(prefix, counts)` returns the three datasets of one prefix (None for an empty split).
    A blend asks each component for its share plus the margin, then blends exactly `num_samples`;
    components whose split is empty drop out and the others' weights are renormalized.
    The blending indices are cached in `cache_dir` (--data-cache-path), else next to the first prefix.
    """
    prefixes, weights = parse_data_path(data_path)
    splits = _build_blended_splits(prefixes, weights, num_samples, build_splits, cache_dir)
    if splits[0] is None and num_samples[0] > 0:
        raise DataConfigError(
            f"--split leaves no training documents in --data-path {' '.join(map(str, data_path))}: the train share "
            "of the documents rounds to none. Give the first --split weight a larger share (e.g. --split 969,30,1) "
            "or use more documents."
        )
    return splits


def _build_blended_splits(
    prefixes: list[str],
    weights: list[float],
    num_samples: Sequence[int],
    build_splits: Callable[[str, Sequence[int]], Sequence],
    cache_dir: str | None,
) -> tuple:
    if len(prefixes) == 1:
        return tuple(build_splits(prefixes[0], num_samples))
    per_component = [
        build_splits(prefix, counts)
        for prefix, counts in zip(prefixes, component_num_samples(weights, num_samples), strict=True)
    ]
    blends: list[BlendedDataset | None] = []
    for split, size in enumerate(num_samples):
        present = [(c[split], w) for c, w in zip(per_component, weights, strict=True) if c[split] is not None]
        if not present:
            blends.append(None)
            continue
        blends.append(
            BlendedDataset(
                [d for d, _ in present],
                [w for _, w in present],
                size,
                index_cache_dir(prefixes[0], cache_dir),
            )
        )
    return tuple(blends)
