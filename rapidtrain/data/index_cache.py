"""The data package's shared ground: its error, and the .npy index cache that GPT, BERT and blended datasets
build on rank 0 and memory-map everywhere (with a memory check before building)."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Sequence

import numpy as np

from rapidtrain.core.errors import UserError


class DataConfigError(UserError, ValueError):
    """A data flag or data file does not fit: the message names it and the fix."""


def index_cache_dir(prefix: str, cache_dir: str | None) -> str:
    """Where the .npy index files of `prefix` go: --data-cache-path, else `<prefix dir>/cache`."""
    return cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")


def check_index_memory(nbytes: int, what: str) -> None:
    """Refuse to build an index that cannot fit in this machine's memory, before allocating it."""
    available = _available_memory()
    if available is not None and nbytes > available:
        raise DataConfigError(
            f"{what} would need {nbytes / 2**30:,.1f} GiB of memory for its index, more than the "
            f"{available / 2**30:,.1f} GiB available here. Lower --train-iters (or --global-batch-size), or "
            "build the index on a machine with more memory (it is cached in --data-cache-path)."
        )


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------
# Cache: rank 0 builds, the others wait and memory-map the same files.


def _is_distributed() -> bool:
    import torch.distributed as dist  # here, not above: the plan reads DataConfigError without torch

    return dist.is_available() and dist.is_initialized()


def _cache_paths(cache_dir: str, description: str, kind: str, names: Sequence[str]) -> dict[str, str]:
    key = hashlib.md5(description.encode("utf-8")).hexdigest()
    paths = {name: os.path.join(cache_dir, f"{key}-{kind}-{name}.npy") for name in names}
    paths["description"] = os.path.join(cache_dir, f"{key}-{kind}-description.txt")
    return paths


def _save_atomically(paths: dict[str, str], arrays: dict[str, np.ndarray], description: str) -> None:
    # Unique temporary names, then rename: ranks on several nodes may write the same files at once.
    for name, array in arrays.items():
        tmp = f"{paths[name]}.{uuid.uuid4().hex}.tmp.npy"
        np.save(tmp, array)
        os.replace(tmp, paths[name])
    tmp = f"{paths['description']}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w") as f:
        f.write(description)
    os.replace(tmp, paths["description"])  # written last: its presence marks a complete cache


def load_or_build_cached_indices(
    cache_dir: str,
    description: str,
    kind: str,
    names: Sequence[str],
    build: Callable[[], dict[str, np.ndarray]],
    check: Callable[[dict[str, np.ndarray]], str | None] | None = None,
) -> tuple[dict[str, np.ndarray], bool]:
    """Memory-mapped index arrays from `cache_dir`, built first by rank 0 when missing.

    `build()` returns the arrays called `names`. Returns (arrays, built_here). Files are named by
    the MD5 of `description`, so any change in data, split, sample count, length or seed gives
    new files. `check(arrays)` says what is wrong with arrays read back (None: nothing): a cache file
    damaged since an earlier run wrote it is refused, naming it, before training reads past its end.
    """
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as error:
        raise DataConfigError(
            f"cannot create the index cache folder {cache_dir} ({error}); "
            "point --data-cache-path to a writable folder"
        ) from error
    built_here = False
    paths = _cache_paths(cache_dir, description, kind, names)
    complete = lambda: all(os.path.isfile(p) for p in paths.values())  # noqa: E731
    import torch.distributed as dist

    is_rank0 = not _is_distributed() or dist.get_rank() == 0
    if is_rank0 and not complete():
        _save_or_refuse(cache_dir, paths, build(), description)
        built_here = True
    if _is_distributed():
        dist.barrier()
    if not complete():
        # This rank does not share rank 0's file system: the build is deterministic, so redo it.
        _save_or_refuse(cache_dir, paths, build(), description)
        built_here = True
    arrays = {name: _load_cached(paths[name]) for name in names}
    problem = check(arrays) if check is not None else None
    if problem:
        raise DataConfigError(f"the index cache {', '.join(paths[name] for name in names)} is damaged ({problem}); "
                              f"delete these files (the next run rebuilds them) or point --data-cache-path "
                              "elsewhere")
    return arrays, built_here


def _save_or_refuse(cache_dir: str, paths: dict[str, str], arrays: dict[str, np.ndarray], description: str) -> None:
    try:
        _save_atomically(paths, arrays, description)
    except OSError as error:  # a folder where a cache file goes, a full or read-only disk
        raise DataConfigError(f"cannot write the index cache in {cache_dir}: {error.filename or cache_dir}: "
                              f"{error.strerror or error}; remove what is in the way, or point --data-cache-path "
                              "to a writable folder") from None


def _load_cached(path: str) -> np.ndarray:
    """One cached index array, memory-mapped; pickled objects are never loaded (allow_pickle stays off)."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:  # truncated, a damaged header, unreadable
        raise DataConfigError(f"the index cache file {path} is damaged or unreadable ({error}); delete it (the next "
                              "run rebuilds it) or point --data-cache-path elsewhere") from None
    if array.dtype.kind not in "iu" or array.ndim not in (1, 2):
        raise DataConfigError(f"the index cache file {path} holds {array.dtype} of {array.ndim} dimensions, not an "
                              "index: delete it (the next run rebuilds it) or point --data-cache-path elsewhere")
    return array
