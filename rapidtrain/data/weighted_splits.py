"""BigScience's per-split weighted data (`--train-weighted-split-paths "NAME: W1 START:END PREFIX1, W2 ..."`): each
group is a named blend whose components read the documents of their prefix between two fractions."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from rapidtrain.core.errors import UserError


class DataPathError(UserError, ValueError):
    """A weighted split path is malformed: the message names the flag and shows the form (no torch imported: the
    plan reads these)."""


FORM = '"NAME: WEIGHT START:END PREFIX, WEIGHT START:END PREFIX, ..." (0 ≤ START < END ≤ 1)'


@dataclass(frozen=True)
class WeightedComponent:
    """One prefix of a group: its weight in the blend and the fractions of its documents it reads."""

    weight: float
    start: float
    end: float
    prefix: str

    def document_range(self, documents: int) -> tuple[int, int]:
        """[first, last) document of `documents`: each fraction × the count, rounded (as BigScience)."""
        return round(self.start * documents), round(self.end * documents)


@dataclass(frozen=True)
class WeightedGroup:
    """A named blend: one for training, each validation or test group evaluated on its own."""

    name: str
    components: tuple[WeightedComponent, ...]

    @property
    def weights(self) -> list[float]:
        return [c.weight for c in self.components]

    def describe(self) -> str:
        parts = ", ".join(f"{c.weight:g} × {c.prefix} [{c.start:g}, {c.end:g})" for c in self.components)
        return f"{self.name}: {parts}"


def parse_group(text: str, flag: str) -> WeightedGroup:
    """One group. The commas between components may be left out (each component is three words), as BigScience's
    own example script writes its training group."""
    name, colon, rest = text.partition(":")
    words = rest.replace(",", " ").split()
    if not colon or not name.strip() or not words or len(words) % 3:
        raise DataPathError(f"{flag} {text!r}: a group is written {FORM}")
    return WeightedGroup(name.strip(), tuple(_component(words[i:i + 3], text, flag) for i in range(0, len(words), 3)))


def _component(words: list[str], text: str, flag: str) -> WeightedComponent:
    weight, fractions, prefix = words
    start, colon, end = fractions.partition(":")
    try:
        values = float(weight), float(start), float(end)
    except ValueError:
        values = (math.nan,) * 3
    if not colon or not all(math.isfinite(v) for v in values) or values[0] < 0 or not 0 <= values[1] < values[2] <= 1:
        raise DataPathError(f"{flag} {text!r}: {' '.join(words)!r} is not WEIGHT START:END PREFIX with a weight ≥ 0 "
                            f"and 0 ≤ START < END ≤ 1; a group is written {FORM}")
    return WeightedComponent(values[0], values[1], values[2], prefix)


def read_groups_file(path: str, flag: str) -> list[str]:
    """The groups of a `--*-weighted-split-paths-path` file: one line of quoted groups, "G1" "G2" ..."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise DataPathError(f"{flag} {path}: cannot read it ({error.strerror or error})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        groups = shlex.split(lines[0]) if len(lines) == 1 else []
    except ValueError:
        groups = []
    if not groups:
        raise DataPathError(f"{flag} {path}: the file holds one line of quoted groups, {FORM} {FORM} ...")
    return groups
