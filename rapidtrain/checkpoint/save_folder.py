"""One writer per --save folder, checked before training starts.

`acquire_save_lock` takes an exclusive `flock` on SAVE/.rapidtrain.lock (the kernel drops it when the process
ends, however it ends, so a lock is never stale) and writes the holder's host and pid into it for the next
run's error message. `check_resume_safety` refuses a run that would overwrite checkpoints it did not load, or,
restarting its count (--finetune), the ones it loaded;
`check_save_writable` finds a read-only or misplaced folder before the first iteration instead of at the first
save. Rank 0 calls these at start, before the process group's first collective.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rapidtrain.core.errors import UserError

LOCK_FILE = ".rapidtrain.lock"
LATEST_FILE = "latest_checkpointed_iteration.txt"  # the checkpoint module's name for it (not imported: no torch)


class SaveFolderError(UserError, RuntimeError):
    """--save cannot be used: in use by another run, holding checkpoints this run would overwrite, or not
    writable. The message names the folder and the fix."""


@dataclass
class SaveLock:
    """Held while the run writes to `folder`; released by `release()` or when the process ends."""

    folder: Path
    descriptor: int | None

    def release(self) -> None:
        if self.descriptor is not None:
            fcntl.flock(self.descriptor, fcntl.LOCK_UN)
            os.close(self.descriptor)
            self.descriptor = None

    def __enter__(self) -> SaveLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder_text() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S")})


def _describe_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text() or "{}")
        return f"host {holder['host']}, pid {holder['pid']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def acquire_save_lock(save_dir: str | Path) -> SaveLock:
    """Lock `save_dir` for this run (created if missing); SaveFolderError naming the holder if another run
    has it. Keep the returned SaveLock alive for the whole run."""
    folder = Path(save_dir)
    check_save_writable(folder)
    path = folder / LOCK_FILE
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise SaveFolderError(
            f"--save {folder} is in use by another run ({_describe_holder(path)}): two runs writing one folder "
            "overwrite each other's checkpoints. Wait for that run to end, or give this one another --save."
        ) from None
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, _holder_text().encode(), 0)
    return SaveLock(folder, descriptor)


def saved_iterations(folder: Path) -> list[str]:
    """The checkpoints a folder holds: `iter_*` folders and the latest-iteration file."""
    if not folder.is_dir():
        return []
    found = sorted(p.name for p in folder.glob("iter_*") if p.is_dir() and not p.name.endswith((".tmp", ".old")))
    if (folder / LATEST_FILE).exists():
        found.append(LATEST_FILE)
    return found


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_resume_safety(save_dir: str | Path | None, load_dir: str | Path | None, restarts_count: bool = False) -> None:
    """Refuse, before training, a run that would overwrite checkpoints in --save it did not load, a run that
    restarts its iteration count (`restarts_count`: --finetune) in the folder it loads from, and a --load folder
    that does not exist (a typo would otherwise start from scratch)."""
    if load_dir is not None and not Path(load_dir).exists() and not (
            save_dir is not None and _same_folder(Path(load_dir), Path(save_dir))):
        raise SaveFolderError(f"--load {load_dir}: no such folder. Give the --save folder of the run to resume "
                              "(it holds latest_checkpointed_iteration.txt), or leave --load out to start fresh.")
    if save_dir is None:
        return
    save = Path(save_dir)
    existing = saved_iterations(save)
    shown = ", ".join(existing[:3]) + (f" and {len(existing) - 3} more" if len(existing) > 3 else "")
    loads_save = load_dir is not None and _same_folder(save, Path(load_dir))
    if existing and loads_save and restarts_count:
        # Refused rather than saved beside: a folder chosen for the user would leave --save naming one place and
        # the checkpoints in another, and the resume line, scripts and --load of the next job would miss them.
        raise SaveFolderError(
            f"--finetune --load {load_dir} --save {save}: the fine-tune starts again at iteration 0, so its saves "
            f"(iter_0000001, ..., and {LATEST_FILE}) would overwrite the checkpoints it loads from ({shown}). Give "
            "the fine-tune a --save folder of its own; the loaded checkpoints stay as they are.")
    if not existing or loads_save:
        return
    loaded = f"--load {load_dir}" if load_dir is not None else "no --load"
    raise SaveFolderError(
        f"--save {save} already holds checkpoints ({shown}) that this run does not load ({loaded}): its own "
        f"saves would overwrite them. To continue that run give --load {save}; to start a new one give a fresh "
        "--save folder."
    )


def check_save_writable(save_dir: str | Path) -> None:
    """Create `save_dir` if needed and prove a file can be written there; SaveFolderError otherwise."""
    folder = Path(save_dir)
    if folder.exists() and not folder.is_dir():
        raise SaveFolderError(f"--save {folder} is a file, not a folder. Give a folder path (it is created).")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as error:
        raise SaveFolderError(f"--save {folder} is not writable ({error.strerror or error}): checkpoints could "
                              "not be saved. Give a folder this user can write to.") from None


def check_save_shared(save_dir: str | Path) -> None:
    """Every rank sees the folder rank 0 writes (a collective; after rank 0 prepared the folder): a multi-node
    run's ranks write one checkpoint together, so a node-local --save would lose the other nodes' parts (the
    symptom: "Parent directory .../iter_*.tmp/rng does not exist" on the second node at the first save)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    folder = Path(save_dir)
    names = [f".rapidtrain-shared-{os.getpid()}-{time.time_ns()}" if dist.get_rank() == 0 else ""]
    if dist.get_rank() == 0:
        (folder / names[0]).write_text(socket.gethostname())
    dist.broadcast_object_list(names, src=0)
    node = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "?"))
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, ((folder / names[0]).is_file(), node, socket.gethostname()))
    if dist.get_rank() == 0:
        (folder / names[0]).unlink(missing_ok=True)
    blind = sorted({f"node {n} ({host})" for seen, n, host in views if not seen})
    if blind:
        raise SaveFolderError(
            f"--save {save_dir} is not one folder for every node: {', '.join(blind)} does not see the files node 0 "
            "writes there (a node-local path). The ranks of a run write each checkpoint together: give --save a "
            "folder on a file system shared by all nodes (NFS, Lustre, ...), mounted at the same path on each.")


def exclusive_directory(path: Path) -> None:
    """Create the temporary folder `path` afresh (a leftover folder of a killed save is removed first); a symlink
    planted under that name is refused, so no save writes outside --save."""
    if path.is_symlink():
        raise SaveFolderError(f"{path} is a symbolic link: a save there would write outside --save {path.parent}. "
                              "Remove the link (rapidtrain never creates one).")
    if path.exists():
        import shutil

        shutil.rmtree(path)
    os.mkdir(path, 0o755)  # exclusive: fails if something appeared under the name meanwhile


def write_file_exclusively(path: Path, text: str) -> None:
    """Write `path` as a new file, never through a symlink (O_EXCL | O_NOFOLLOW after removing a leftover)."""
    if path.is_symlink():
        raise SaveFolderError(f"{path} is a symbolic link: writing it would change a file outside --save "
                              f"{path.parent}. Remove the link (rapidtrain never creates one).")
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(descriptor, "w") as stream:
        stream.write(text)
