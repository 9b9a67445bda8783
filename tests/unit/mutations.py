"""Damage for the reader tests (test_reader_mutations*.py): hypothesis strategies that mutate a valid file the
test wrote, and the one outcome every reader must have: it works, or it raises UserError naming the file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from rapidtrain.core.errors import UserError

# Bounded: ~30 tiny examples a reader, derandomized so a failure reproduces on every run.
BOUNDED = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HANG_SECONDS = 20
AS_ROOT = os.geteuid() == 0

_JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40), st.floats(allow_nan=True),
                         st.text(max_size=8), st.just([]), st.just({}), st.just([1, "a"]), st.just({"x": [None]}))

byte_mutations = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
                                        min_size=1, max_size=4)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=24)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=24)),
    st.just(("empty",)),
    st.just(("directory",)),
    *([] if AS_ROOT else [st.just(("unreadable",))]),  # root reads a mode-000 file: no denial to test then
)
# JSON files also meet a wrong type at the top, or one value anywhere swapped for another type.
json_mutations = st.one_of(
    byte_mutations,
    st.tuples(st.just("json_top"), _JSON_VALUES),
    st.tuples(st.just("json_swap"), st.integers(0, 10**6), _JSON_VALUES),
)


def _position(data: bytes | bytearray, fraction: float) -> int:
    return min(int(fraction * len(data)), max(len(data) - 1, 0))


def _swap_json_value(document: Any, choice: int, value: Any) -> Any:
    """`document` with its choice-th value (walking dicts and lists in order) replaced by `value`."""
    slots: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            slots.append((node, key))
            walk(child)

    walk(document)
    if not slots:
        return value
    node, key = slots[choice % len(slots)]
    node[key] = value
    return document


def mutate(path: Path, mutation: tuple) -> None:
    """Damage `path` in place as `mutation` (from the strategies above) says."""
    kind = mutation[0]
    if kind == "directory":
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("a directory where a file was expected")
        return
    if kind == "unreadable":
        path.chmod(0)
        return
    data = bytearray(path.read_bytes())
    if kind == "truncate":
        data = data[: int(mutation[1] * len(data))]
    elif kind == "flip":
        for fraction, bits in mutation[1]:
            if data:
                data[_position(data, fraction)] ^= bits
    elif kind == "insert":
        at = int(mutation[1] * len(data))
        data[at:at] = mutation[2]
    elif kind == "append":
        data += mutation[1]
    elif kind == "empty":
        data = bytearray()
    elif kind == "json_top":
        data = bytearray(json.dumps(mutation[1]).encode())
    elif kind == "json_swap":
        data = bytearray(json.dumps(_swap_json_value(json.loads(data), mutation[1], mutation[2])).encode())
    path.write_bytes(bytes(data))


def restore(path: Path, original: bytes) -> None:
    """Undo `mutate`: the next example starts from the valid file."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.chmod(0o644)
    path.write_bytes(original)


@contextlib.contextmanager
def no_hang(seconds: int = HANG_SECONDS) -> Iterator[None]:
    def hung(*_: Any) -> None:
        raise AssertionError(f"the reader did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def works_or_names(read: Callable[[], Any], *names: str | Path) -> Any:
    """`read()`'s result, or None when it raised a UserError whose message names one of `names` (a file's path,
    or its folder's). Any other exception, or a UserError naming none of them, fails the test."""
    with no_hang():
        try:
            return read()
        except UserError as error:
            message = str(error)
            assert any(str(name) in message for name in names), f"{message!r} names none of {names}"
            return None
