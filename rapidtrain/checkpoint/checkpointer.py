"""Checkpoints in Megatron's layout, written with torch.distributed.checkpoint so they reshard, and read
without running any code stored in them.

SAVE/iter_0000100/ holds the model and optimizer (`.metadata` + `__{rank}_{k}.distcp`), `common.json`
(iteration, consumed samples, schedule, arguments, a template's extras), `rng/rank_{r}.pt` (tensors and
numbers only) and `manifest.json` (size and CRC-32 of every file, checked before anything is read).
Everything is written under a temporary name and published by a rename after every rank finished;
`latest_checkpointed_iteration.txt` is replaced last, so a half-written checkpoint is never visible.

Loading never unpickles arbitrary objects: JSON for the common state, `torch.load(weights_only=True)` for
RNG states and the non-tensor entries of `.distcp` files, and an unpickler that admits only
torch.distributed.checkpoint's own metadata classes for `.metadata` (torch 2.13's reader calls plain
`pickle.load` there, and its planner `torch.load(weights_only=False)` for non-tensor entries).
Checkpoints of earlier rapidtrain versions (`common.pt`, no manifest) are read the same safe way.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import random
import re
import shutil
import threading
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from rapidtrain.checkpoint.compatibility import (
    COMMON_FILE,
    FORMAT_VERSION,
    LATEST_FILE,
    LEGACY_COMMON_FILE,
    MANIFEST_FILE,
    METADATA_FILE,
    CheckpointError,
    check_complete,
    check_format_version,
    check_same_model,
)
from rapidtrain.checkpoint.resume import (
    changed_schedule_flags,
    check_optimizer_groups,
    data_changes,
    load_schedule,
    resolved_flags,
)
from rapidtrain.checkpoint.save_folder import SaveLock, acquire_save_lock, check_resume_safety, write_file_exclusively

_TRUST_HINT = "Nothing from it was run. Use a checkpoint from a source you trust, or one this run's rapidtrain wrote."


class RunnerState(Protocol):
    """What saving and loading need of a runner (parallel.runner.Runner has it): its state as
    torch.distributed.checkpoint writes it, a template to load into, and the load itself."""

    def state_dict(self) -> dict[str, Any]: ...

    def state_dict_for_loading(self, load_optimizer: bool) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], load_optimizer: bool = True) -> None: ...


@dataclass
class LoadedState:
    iteration: int
    consumed_samples: int
    extra: dict[str, Any]
    notes: list[str] = field(default_factory=list)  # what was not restored, for the log


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- RNG state: tensors and numbers, so weights_only=True reads it ----

def rng_state() -> dict[str, Any]:
    python_version, python_internal, python_gauss = random.getstate()
    numpy_kind, numpy_keys, numpy_pos, numpy_has_gauss, numpy_cached = np.random.get_state()
    state: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "python_version": python_version, "python_state": torch.tensor(python_internal, dtype=torch.int64),
        "python_gauss": python_gauss,
        "numpy_kind": numpy_kind, "numpy_keys": torch.from_numpy(np.asarray(numpy_keys, dtype=np.int64)),
        "numpy_pos": int(numpy_pos), "numpy_has_gauss": int(numpy_has_gauss),
        "numpy_cached_gaussian": float(numpy_cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    if state.get("format") == FORMAT_VERSION:
        random.setstate((state["python_version"], tuple(int(x) for x in state["python_state"].tolist()),
                         state["python_gauss"]))
        np.random.set_state((state["numpy_kind"], state["numpy_keys"].numpy().astype(np.uint32),
                             state["numpy_pos"], state["numpy_has_gauss"], state["numpy_cached_gaussian"]))
    else:  # rapidtrain before format 2: the getstate() tuples as they are
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def read_rng_file(path: Path) -> dict[str, Any]:
    """An RNG file read with weights_only=True; the legacy format's numpy array needs numpy's array classes,
    which rebuild arrays and run nothing else."""
    numpy_array_classes = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), _numpy_reconstruct()]
    with torch.serialization.safe_globals(numpy_array_classes):
        return _safe_torch_load(path)


def _numpy_reconstruct() -> Any:
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
    return core.multiarray._reconstruct


def _safe_torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"{path}: refused: it holds objects other than tensors and plain values "
                              f"({_weights_only_reason(error)}). {_TRUST_HINT}") from None
    except (RuntimeError, EOFError, OSError) as error:
        raise CheckpointError(f"{path}: cannot be read ({_first_line(error)}): the file is damaged or "
                              "truncated. Resume from another iteration (edit latest_checkpointed_iteration.txt) "
                              "or another --load folder.") from None


def _weights_only_reason(error: BaseException) -> str:
    """The part of torch's weights_only refusal that names what the file asked for."""
    found = re.search(r"Unsupported global: GLOBAL [\w.]+|Unsupported operand \d+|but got <class '[\w.]+'>", str(error))
    return found.group(0) if found else _first_line(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


# ---- the common state: JSON ----

def _json_default(value: Any) -> Any:
    if isinstance(value, (np.generic, torch.Tensor)) and getattr(value, "ndim", 0) == 0:
        return value.item()
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """A record of the run as JSON values: what JSON cannot hold (a callable) is kept as its text."""
    return json.loads(json.dumps(values, default=lambda v: _try_json(v)))


def _try_json(value: Any) -> Any:
    try:
        return _json_default(value)
    except TypeError:
        return repr(value)


def common_state(iteration: int, consumed_samples: int, config: dict[str, Any], lr_scheduler: Any,
                 extra: dict[str, Any] | None, runner: RunnerState | None = None) -> str:
    """The checkpoint's common state as JSON: position, the run's `config` (flags and plan), schedule, extras, and
    whether the optimizer has stepped yet (asked before the runner's state is taken, which may create it)."""
    schedule = lr_scheduler.state_dict() if hasattr(lr_scheduler, "state_dict") else None
    stepped = getattr(runner, "optimizer_stepped", None)
    state = {"format": FORMAT_VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
             **_plain(config), "lr_scheduler": schedule, "extra": extra or {},
             "optimizer_stepped": stepped() if callable(stepped) else True}
    try:
        return json.dumps(state, default=_json_default, indent=1)
    except TypeError as error:  # a template's extras or a user's scheduler holding an object
        raise CheckpointError(f"the checkpoint's common state cannot be written as JSON: {error}. "
                              "checkpoint_extra() and the learning-rate scheduler's state_dict() must hold "
                              "numbers, strings, lists and dicts only.") from None


def read_common(directory: Path) -> dict[str, Any]:
    """iteration, consumed_samples, args, lr_scheduler, extra: from common.json, or a legacy common.pt."""
    path = directory / COMMON_FILE
    if path.exists():
        try:
            return _checked_common(json.loads(path.read_text()), path)
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as error:
            raise CheckpointError(f"{path}: damaged ({error}); resume from another iteration or --load "
                                  "folder.") from None
    legacy = directory / LEGACY_COMMON_FILE
    if legacy.exists():
        return _checked_common(_safe_torch_load(legacy), legacy)
    raise CheckpointError(f"checkpoint {directory} has no {COMMON_FILE}: it was not fully written. Point --load at "
                          "a folder whose latest iteration is complete.")


# What each entry of the common state must be (None allowed where an entry is optional).
_COMMON_TYPES: dict[str, tuple[type, ...]] = {"iteration": (int,), "consumed_samples": (int,), "format": (int,),
                                              "args": (dict,), "plan": (dict, type(None)), "extra": (dict,),
                                              "lr_scheduler": (dict, type(None))}
_POSITION = ("iteration", "consumed_samples")  # what a resume needs (the shape alone is read without them)


def _checked_common(state: Any, path: Path) -> dict[str, Any]:
    """The common state, refused naming `path` when it is not the object rapidtrain writes (valid JSON changed by
    damage would otherwise fail later, far from the file)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: damaged (a {type(state).__name__}, not the checkpoint's common state); "
                              "resume from another iteration or --load folder.")
    wrong = [name for name, kinds in _COMMON_TYPES.items() if name in state and
              (not isinstance(state[name], kinds) or isinstance(state[name], bool))]
    if not isinstance(state.get("optimizer_stepped", True), bool):  # absent in older checkpoints: True
        wrong.append("optimizer_stepped")
    if any(isinstance(state.get(name), int) and state[name] < 0 for name in _POSITION):
        wrong.append("a negative position")
    if wrong:
        raise CheckpointError(f"{path}: damaged (missing or wrong: {', '.join(wrong)}); resume from another "
                              "iteration or --load folder.")
    return state


# ---- integrity: a manifest of sizes and CRC-32s ----
# CRC-32 reads at ~3 GB/s here (zlib 1.2.13, PCLMUL), SHA-256 at ~1.1 GB/s with SHA-NI (~0.4 GB/s without):
# a checksum guards against damage (a flipped byte, a truncated or overwritten file), not against an attacker,
# who could rewrite the manifest too; what keeps loading safe is that it runs no code.

_CHUNK = 8 * 2**20


def file_checksum(path: Path) -> dict[str, Any]:
    crc, size = 0, 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as stream:
        while count := stream.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
            size += count
    return {"size": size, "crc32": f"{crc:08x}"}


def _files_written_by(directory: Path, rank: int) -> list[Path]:
    # torch.distributed.checkpoint names each rank's data files __{rank}_{k}.distcp.
    return sorted(directory.glob(f"__{rank}_*.distcp")) + [directory / "rng" / f"rank_{rank}.pt"]


def _own_checksums(directory: Path) -> dict[str, Any]:
    return {str(p.relative_to(directory)): file_checksum(p) for p in _files_written_by(directory, _rank())}


def _write_manifest(directory: Path, mine: dict[str, Any] | None = None) -> None:
    """Each rank checksums the files it wrote (still in its page cache; an async save did it in its background
    thread and passes them as `mine`); rank 0 writes them all."""
    mine = dict(_own_checksums(directory) if mine is None else mine)
    if _rank() == 0:
        for name in (METADATA_FILE, COMMON_FILE):
            mine[name] = file_checksum(directory / name)
    gathered: list[dict[str, Any]] = [mine]
    if dist.is_initialized():
        gathered = [{} for _ in range(_world())]
        dist.all_gather_object(gathered, mine)
    if _rank() != 0:
        return
    files = {name: entry for part in gathered for name, entry in part.items()}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):  # anything no rank claimed
        name = str(path.relative_to(directory))
        if name not in files:
            files[name] = file_checksum(path)
    manifest = {"format": FORMAT_VERSION, "algorithm": "crc32", "files": dict(sorted(files.items()))}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")


def _first_damaged(directory: Path, files: dict[str, Any], names: list[str], share: range) -> tuple[int, str]:
    """(index into `names`, reason) of the first damaged file among this rank's share; (-1, "") if none."""
    for index in share:
        name = names[index]
        path = directory / name
        expected = files[name]
        if not path.is_file():
            return index, "missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return index, f"{size} bytes, the manifest says {expected['size']} (truncated or overwritten)"
        found = file_checksum(path)["crc32"]
        if found != expected["crc32"]:
            return index, f"CRC-32 {found}, the manifest says {expected['crc32']} (its bytes changed)"
    return -1, ""


def verify_checkpoint(directory: str | Path) -> bool:
    """Check every file against manifest.json, the work shared among the ranks; False when the checkpoint has
    no manifest (written before format 2). Raises CheckpointError naming the damaged file on every rank."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.exists():
        return False
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        names = sorted(files)
        if not all(isinstance(files[name], dict) and type(files[name].get("size")) is int
                   and isinstance(files[name].get("crc32"), str) for name in names):
            raise TypeError("an entry is not a size and checksum")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, OSError) as error:
        raise CheckpointError(f"{path}: damaged ({error}); resume from another iteration or --load folder.") from None
    check_format_version(manifest.get("format", FORMAT_VERSION), path)
    index, reason = _first_damaged(directory, files, names, range(_rank(), len(names), _world()))
    if dist.is_initialized():  # every rank must stop, or the others would wait in the load for ever
        found = torch.tensor([index if index >= 0 else len(names)], dtype=torch.int64)
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            found = found.cuda()
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
        first = int(found.item())
        if first < len(names) and first != index:
            reason = "found by another rank"
        index = first if first < len(names) else -1
    if index >= 0:
        raise CheckpointError(f"{directory / names[index]} is damaged: {reason}. Its checkpoint cannot be trusted; "
                              "resume from another iteration (write its number into latest_checkpointed_iteration.txt)"
                              " or another --load folder.")
    return True


# ---- torch.distributed.checkpoint, read safely ----

# What a `.metadata` file holds in torch 2.x: the checkpoint library's dataclasses and enums, torch.Size, dtypes,
# layouts and paths (Megatron-Core's torch_dist also keeps its save plans there: SavePlan, WriteItem and
# TensorWriteData, plain dataclasses of the same library). Nothing else is imported while unpickling it.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType", "SavePlan", "WriteItem",
                                             "TensorWriteData"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _RefusedClass(pickle.UnpicklingError):
    """The file names a class or function outside the allow-list."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise _RefusedClass(f"it asks to import {module}.{name}, which checkpoint metadata never holds")


def read_metadata_file(path: Path) -> Any:
    try:
        with open(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except _RefusedClass as error:
        raise CheckpointError(f"{path}: refused: {error}. {_TRUST_HINT}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OSError) as error:
        raise CheckpointError(f"{path}: damaged ({type(error).__name__}: {_first_line(error)}): truncated or "
                              "overwritten. Resume from another iteration or --load folder.") from None
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(f"{path}: not torch.distributed.checkpoint metadata ({type(metadata).__name__}).")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata comes through the allow-list unpickler (read once, before the load)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # rank-local metadata: rapidtrain never writes it
            raise FileNotFoundError("no rank-local metadata")
        if self._metadata is None:
            self._metadata = read_metadata_file(Path(self.path) / METADATA_FILE)
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries (optimizer hyper-parameters, the loss scaler) with
    weights_only=True instead of unpickling whatever the file holds."""

    def __init__(self, reader: SafeFileSystemReader) -> None:
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            stored = self.reader.storage_data.get(read_item.storage_index)
            where = Path(self.reader.path) / (stored.relative_path if stored else "?")
            raise CheckpointError(f"{where}: refused: its entry {read_item.dest_index.fqn!r} holds objects other "
                                  f"than tensors and plain values ({_weights_only_reason(error)}). "
                                  f"{_TRUST_HINT}") from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def safe_dcp_load(state: dict[str, Any], directory: str | Path, *, no_dist: bool = False) -> None:
    """torch.distributed.checkpoint.load into `state`, through the safe reader and planner, with its failures
    (which torch wraps per rank, traceback text included) turned into one CheckpointError."""
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeFileSystemReader(str(directory))
    reader.read_metadata()  # refused or damaged metadata stops here, before any collective
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(reader), no_dist=no_dist)
    except CheckpointException as wrapped:
        causes = [exc for exc, _ in wrapped.failures.values()]
        for cause in causes:
            if isinstance(cause, CheckpointError):
                raise cause from None
        first = causes[0] if causes else wrapped
        raise CheckpointError(f"checkpoint {directory} cannot be read into this model: "
                              f"{type(first).__name__}: {_first_line(first)}. Its files are damaged, or it was "
                              "saved with other model flags; resume from another iteration or --load "
                              "folder.") from None


def drop_state_never_saved(state: dict[str, Any], directory: Path) -> list[str]:
    """Leave out of the load template the optimizer state of parameters the checkpoint holds none for: a parameter
    that never had a gradient has none (torch makes a parameter's state at the first step that has a gradient for
    it), so the run that saved had none, and the resumed run goes on without it too (the optimizer's load keeps
    only what it is given). Returns the parameters left out. A checkpoint with no optimizer state at all keeps the
    template whole, so that its load fails and says so."""
    entries = (state.get("optimizer") or {}).get("state")
    if not isinstance(entries, dict) or not entries:
        return []
    saved = set(read_metadata_file(directory / METADATA_FILE).state_dict_metadata)
    if not any(key.startswith("optimizer.state.") for key in saved):
        return []
    missing = [name for name, entry in entries.items() if isinstance(entry, dict) and entry
               and not any(f"optimizer.state.{name}.{key}" in saved for key in entry)]
    for name in missing:
        del entries[name]
    return missing


def adapters_not_saved(state: dict[str, Any], directory: Path) -> dict[str, Any]:
    """Take out of the load template the LoRA adapters a checkpoint of the base model does not hold (--finetune from
    a run without them); returns them, to be put back as they are."""
    from rapidtrain.models.lora import is_adapter_weight

    saved = set(read_metadata_file(directory / METADATA_FILE).state_dict_metadata)
    missing = [name for name in state["model"] if is_adapter_weight(name) and f"model.{name}" not in saved]
    return {name: state["model"].pop(name) for name in missing}


# ---- save ----

def publish_folder(tmp: Path, final: Path) -> None:
    """Replace `final` by `tmp` so that a reader sees either the old or the new directory, never half (checkpoints
    and exported models); a `.old` left by a killed publish goes first."""
    old = final.with_name(final.name + ".old")
    if old.is_symlink():  # never renamed over, nor followed
        old.unlink()
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write_file_exclusively(tmp, text)  # a symlink planted under the temporary name is refused, not followed
    os.replace(tmp, path)


def remove_stale_partial_checkpoints(root: str | Path) -> list[str]:
    """Clean what a killed save leaves in `root`, for the one run that holds its save lock: `iter_*.tmp`
    folders are removed; an `iter_*.old` is put back when its checkpoint is missing (killed mid-publish),
    removed otherwise. Returns what was done, for the log."""
    root = Path(root)
    done = []
    for path in sorted(root.glob("iter_*.tmp")):
        shutil.rmtree(path, ignore_errors=True)
        done.append(f"removed the unfinished {path.name} left by an interrupted save")
    for path in sorted(root.glob("iter_*.old")):
        final = path.with_name(path.name.removesuffix(".old"))
        if final.exists():
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path.name}, the replaced copy of {final.name}")
        else:
            path.rename(final)
            done.append(f"restored {final.name} from {path.name} (a save was interrupted while replacing it)")
    return done


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _out_of_space(error: BaseException) -> OSError | None:
    """The disk-full error inside `error`: raised directly, chained, or wrapped by torch.distributed.checkpoint
    (which also turns it into "enforce fail at inline_container.cc" text)."""
    seen: list[BaseException] = [error]
    while seen:
        current = seen.pop()
        if isinstance(current, OSError) and current.errno in _NO_SPACE:
            return current
        for code in _NO_SPACE:
            if os.strerror(code) in str(current):
                return OSError(code, os.strerror(code))
        seen += [e for e in (current.__cause__, current.__context__) if e is not None]
        seen += [exc for exc, _ in getattr(current, "failures", {}).values()]
    return None


def _refuse_if_out_of_space(error: BaseException, tmp: Path) -> None:
    full = _out_of_space(error)
    if full is None:
        return
    shutil.rmtree(tmp, ignore_errors=True)
    free = shutil.disk_usage(tmp.parent).free if tmp.parent.exists() else 0
    raise CheckpointError(
        f"saving {tmp.name.removesuffix('.tmp')} into {tmp.parent} failed: {full.strerror} ({free / 2**20:,.0f} MiB "
        "free there now). The unfinished checkpoint was removed and the earlier ones are intact; free space, or "
        "resume with --load from them and another --save."
    ) from None


def _prepare_save(root: Path, iteration: int) -> tuple[Path, Path]:
    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        from rapidtrain.checkpoint.save_folder import exclusive_directory

        root.mkdir(parents=True, exist_ok=True)
        exclusive_directory(tmp)  # never through a symlink planted under the temporary name
        (tmp / "rng").mkdir()
    _barrier()
    return final, tmp


def _write_small_files(tmp: Path, common: str) -> None:
    """This rank's RNG state, and on rank 0 the common state: small, written at once by every kind of save."""
    torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
    if _rank() == 0:
        (tmp / COMMON_FILE).write_text(common)


def _publish_checkpoint(root: Path, iteration: int, tmp: Path, final: Path) -> None:
    """Rank 0 renames the written folder into place, then points `latest` at it."""
    if _rank() == 0:
        publish_folder(tmp, final)
        _write_atomically(root / LATEST_FILE, f"{iteration}\n")


def save_checkpoint(root: str | Path, iteration: int, runner: RunnerState, lr_scheduler: Any, consumed_samples: int,
                    config: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    """Write iteration `iteration` (every rank calls this); `config` is the run's flags and plan as JSON values
    (the plan's model settings are checked at load)."""
    root = Path(root)
    common = common_state(iteration, consumed_samples, config, lr_scheduler, extra, runner) if _rank() == 0 else ""
    final, tmp = _prepare_save(root, iteration)
    try:
        dcp.save(runner.state_dict(), checkpoint_id=str(tmp))
        _write_small_files(tmp, common)
    except BaseException as error:
        _refuse_if_out_of_space(error, tmp)
        raise
    _barrier()
    _write_manifest(tmp)
    _barrier()
    _publish_checkpoint(root, iteration, tmp, final)
    _barrier()
    return final


# ---- async save: written in the background, published when every rank is done ----

@dataclass
class PendingSave:
    """A checkpoint whose tensors a background thread is writing into `tmp`. `written` resolves to this rank's
    file checksums once its part is on disk (or to the write's error); `publish_async_save` then publishes it."""

    root: Path
    iteration: int
    tmp: Path
    final: Path
    written: Future


BACKGROUND_NICE = 10  # the saving thread's niceness: on a busy CPU, training threads get ~10x its share


class BackgroundWriter(dcp.FileSystemWriter):
    """FileSystemWriter that first lowers the CPU priority of the thread it writes from (async_save's own thread,
    which ends with the save), so that where training keeps every core busy (CPU training) the write yields to it
    instead of slowing each step; on a GPU run the host is mostly idle and the write goes at full speed."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:  # Linux: a thread id with PRIO_PROCESS sets that thread's niceness only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except (AttributeError, OSError):
            pass  # elsewhere the write runs at normal priority
        return super().write_data(plan, planner)


def start_async_save(root: str | Path, iteration: int, runner: RunnerState, lr_scheduler: Any, consumed_samples: int,
                     config: dict[str, Any], extra: dict[str, Any] | None, process_group: Any) -> PendingSave:
    """Copy the state to host memory and hand it to torch.distributed.checkpoint's async_save (every rank calls
    this); returns as soon as the copy is made. `process_group` must be a gloo group of every rank used by
    nothing else: the background thread runs the save's collectives on it while training uses the default one."""
    root = Path(root)
    common = common_state(iteration, consumed_samples, config, lr_scheduler, extra, runner) if _rank() == 0 else ""
    final, tmp = _prepare_save(root, iteration)
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # The copy to host memory is made here, before training goes on (async_save's default staging, no pinned or
    # shared memory); the stager is ours to close once the write is done.
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        upload = dcp.async_save(runner.state_dict(), storage_writer=BackgroundWriter(str(tmp)),
                                process_group=process_group, async_stager=stager)
        _write_small_files(tmp, common)
    except BaseException as error:
        stager.close()
        _refuse_if_out_of_space(error, tmp)
        raise
    written: Future = Future()

    def checksum_when_written(done: Future) -> None:  # runs in the saving thread, after its last write
        try:
            done.result()
            written.set_result(_own_checksums(tmp))
        except BaseException as error:  # handed to publish_async_save, which every rank reaches
            written.set_exception(error)
        finally:
            stager.close()

    # Staging is synchronous (StagingOptions above), for which async_save returns the upload's Future itself
    # rather than an AsyncSaveResponse.
    assert isinstance(upload, Future)
    upload.add_done_callback(checksum_when_written)
    return PendingSave(root, iteration, tmp, final, written)


def async_save_done(pending: PendingSave) -> bool:
    """Whether every rank's background write has finished. Every rank calls this at the same point: one small
    all-reduce of a host tensor on the default group (gloo carries CPU tensors: the engine's backend is
    cpu:gloo,cuda:nccl), so no device is waited for and no rank waits for its own write."""
    unfinished = torch.tensor([0 if pending.written.done() else 1], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(unfinished, op=dist.ReduceOp.MAX)
    return int(unfinished.item()) == 0


def background_save_group() -> Any:
    """A gloo group of every rank for the background thread's collectives (planning the save, gathering its
    metadata), which must not share a group with the training thread's; None without torch.distributed.
    Every rank calls this at the same point (it is a collective)."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def publish_async_save(pending: PendingSave) -> Path:
    """Wait for this rank's background write, then publish as a blocking save does: the manifest from every
    rank's checksums, the rename, `latest` last. Every rank calls this; a write that failed on any rank removes
    the unfinished folder and raises CheckpointError everywhere, the previous `latest` untouched."""
    try:
        mine, problem = pending.written.result(), ""
    except BaseException as error:
        mine, problem = {}, _describe_failed_write(error, pending.tmp)
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [""] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    failed = next((p for p in problems if p), "")
    if failed:
        if _rank() == 0:
            shutil.rmtree(pending.tmp, ignore_errors=True)
        raise CheckpointError(failed)
    _write_manifest(pending.tmp, mine)
    _publish_checkpoint(pending.root, pending.iteration, pending.tmp, pending.final)
    _barrier()
    return pending.final


def _describe_failed_write(error: BaseException, tmp: Path) -> str:
    name, full = tmp.name.removesuffix(".tmp"), _out_of_space(error)
    reason = full.strerror if full is not None else f"{type(error).__name__}: {_first_line(error)}"
    return (f"the background save of {name} into {tmp.parent} failed on rank {_rank()}: {reason}. The unfinished "
            "checkpoint was removed and the earlier ones are intact" + (": free space, or resume with --load from "
                                                                        "them." if full is not None else "."))


# ---- load ----

def latest_iteration(root: str | Path) -> int | None:
    path = Path(root) / LATEST_FILE
    if not path.exists():
        return None
    fix = "Remove it to start from scratch, or write the iteration of a complete iter_* folder into it."
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:  # a folder in its place, unreadable, or bytes that are no text
        raise CheckpointError(f"{path}: cannot be read ({error}); the file is damaged. {fix}") from None
    if not re.fullmatch(r"[0-9]{1,12}", text):  # isdigit() would take '²', which int() refuses
        raise CheckpointError(f"{path} holds {text[:40]!r}, not an iteration number; the file is corrupt. {fix}")
    return int(text)


def _read_rng(directory: Path, notes: list[str]) -> dict[str, Any] | None:
    path = directory / "rng" / f"rank_{_rank()}.pt"
    if not path.exists():
        notes.append(f"{path} is missing: random state not restored, so dropout and sampling after the resume "
                     "differ from an uninterrupted run (was the checkpoint saved with more or fewer ranks?)")
        return None
    return read_rng_file(path)


def load_checkpoint(root: str | Path, runner: RunnerState, lr_scheduler: Any, model: dict[str, Any] | None, *,
                    finetune: bool = False, load_optimizer: bool = True, load_rng: bool = True,
                    schedule_from: str = "same", flags: dict[str, Any] | None = None,
                    data: tuple[dict[str, Any], dict[str, str]] | None = None) -> LoadedState | None:
    """Fill the runner (and schedule, RNG) from the latest checkpoint in `root`; None when there is none.
    `flags`: this run's flags, to name the ones that differ from the saved run's when the schedule does. `data`:
    this run's plan (as JSON) and data files' identities, to say what changed in the data since the save (and
    refuse another tokenizer) before anything is loaded."""
    from rapidtrain.checkpoint.foreign_formats import detect_foreign, refuse_unknown_folder

    foreign = detect_foreign(root)
    if foreign is not None:  # the callers route these to checkpoint.foreign.load_foreign_checkpoint
        raise CheckpointError(f"--load {root}: a {foreign.describe()}: read it with "
                              "rapidtrain.checkpoint.foreign.load_foreign_checkpoint, as a training run's --load does")
    iteration = latest_iteration(root)
    if iteration is None:
        refuse_unknown_folder(root)
        if finetune:
            raise CheckpointError(f"--finetune --load {root}: no {LATEST_FILE} there; nothing to fine-tune from.")
        return None
    directory = iteration_dir(root, iteration)
    if not directory.is_dir():
        raise CheckpointError(f"{Path(root) / LATEST_FILE} names iteration {iteration}, but {directory} "
                              f"does not exist.")
    check_complete(directory)
    notes: list[str] = []
    if not verify_checkpoint(directory):
        notes.append(f"{directory} has no {MANIFEST_FILE} (written before checkpoint format {FORMAT_VERSION}): "
                     "its files were not checked for damage")
    common = read_common(directory)
    if not finetune and any(name not in common for name in _POSITION):
        raise CheckpointError(f"{directory / COMMON_FILE}: damaged (it lacks the iteration or consumed_samples a "
                              "resume continues from); resume from another iteration or --load folder.")
    check_format_version(common.get("format", 1), directory / COMMON_FILE)
    check_same_model((common.get("plan") or {}).get("model"), model, directory)
    if data is not None and not finetune:
        notes += data_changes(common, *data, directory, iteration)
    load_optimizer = load_optimizer and not finetune
    if load_optimizer and flags is not None:
        check_optimizer_groups(common.get("args") or {}, flags, directory)
    state = runner.state_dict_for_loading(load_optimizer)
    if load_optimizer:
        drop_state_never_saved(state, directory)
    new_adapters = adapters_not_saved(state, directory) if finetune else {}
    safe_dcp_load(state, directory)
    state["model"].update(new_adapters)  # as they start: the checkpoint is the base model's
    runner.load_state_dict(state, load_optimizer=load_optimizer)
    if load_optimizer and common.get("optimizer_stepped") is False and hasattr(runner, "forget_optimizer_state"):
        runner.forget_optimizer_state()  # saved before any step (fp16 skipped them all): resume with none taken
    if load_optimizer and common.get("lr_scheduler") and hasattr(lr_scheduler, "load_state_dict"):
        changed = changed_schedule_flags(resolved_flags(common), flags or {})
        load_schedule(lr_scheduler, common["lr_scheduler"], schedule_from, directory, changed)
    if load_rng and not finetune:
        rng = _read_rng(directory, notes)
        if rng is not None:
            set_rng_state(rng)
    if _rank() == 0:
        for note in notes:
            print(f" note: {note}", flush=True)
    if finetune:
        return LoadedState(0, 0, {}, notes)
    return LoadedState(iteration, common["consumed_samples"], common.get("extra", {}), notes)


def prepare_save_folder(save_dir: str | Path, load_dir: str | Path | None,
                        restarts_count: bool = False) -> tuple[SaveLock, list[str]]:
    """Everything a run does with --save before its first iteration, on rank 0 only (a second rank taking the
    lock would be refused): writable, locked, nothing it would overwrite (`restarts_count`: the run starts at
    iteration 0 whatever it loads), leftovers of killed saves cleaned. Returns the lock (keep it for the run) and
    what was cleaned, for the log."""
    check_resume_safety(save_dir, load_dir, restarts_count)
    lock = acquire_save_lock(save_dir)
    return lock, remove_stale_partial_checkpoints(save_dir)
