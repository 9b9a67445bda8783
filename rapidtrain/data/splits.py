"""`--split "969, 30, 1"`: the train, valid and test shares of a corpus's documents (no torch: the plan checks the
flag)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rapidtrain.data.index_cache import DataConfigError


def parse_split(split: str) -> list[float]:
    """`--split "969, 30, 1"` → [0.969, 0.03, 0.001]: numbers whatever the separators, padded to 3."""
    numbers = [float(x) for x in re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", split)]
    if not numbers or len(numbers) > 3:
        raise DataConfigError(
            f"--split {split!r}: expected one to three numbers (train, valid, test weights), "
            f"found {len(numbers)}; write e.g. --split 969,30,1"
        )
    if any(x < 0 for x in numbers) or sum(numbers) <= 0:
        raise DataConfigError(f"--split {split!r}: weights must be non-negative with a positive sum")
    numbers += [0.0] * (3 - len(numbers))
    total = sum(numbers)
    return [x / total for x in numbers]


def split_document_ranges(num_docs: int, split: str | Sequence[float]) -> list[tuple[int, int]]:
    """The contiguous [round(begin·N), round(end·N)) document range of train, valid and test."""
    fractions = parse_split(split) if isinstance(split, str) else list(split)
    ranges = []
    for i in range(len(fractions)):
        begin = int(round(sum(fractions[:i]) * num_docs))
        end = int(round(sum(fractions[: i + 1]) * num_docs))
        ranges.append((begin, min(end, num_docs)))
    return ranges
