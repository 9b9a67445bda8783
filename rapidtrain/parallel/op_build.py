"""DeepSpeed's CPU ops: built ahead by scripts/setup.sh (`python -m rapidtrain.parallel.op_build`), announced when
a run has to build one itself, and the stale locks of interrupted builds cleared before DeepSpeed compiles them.

DeepSpeed JIT-builds `cpu_adam` (for --cpu-offload) and `deepspeed_shm_comm` (CPU collectives) with
torch.utils.cpp_extension, which guards each build folder with a FileBaton: `lock` created with O_EXCL,
held open by the builder and removed when the build ends. A build killed midway leaves the file, and every
later process waits on it for ever (FileBaton.wait polls until the file disappears, without a timeout).

A lock has a living holder when some process on this host has the file open (/proc/PID/fd). Without one, on
a local file system, the builder is gone: the lock is removed. On a network file system a builder on another
node cannot be seen, so the lock is removed only once the build folder has been idle for `idle_seconds`
(ninja writes its log and objects as a build runs).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import MutableMapping, Sequence
from pathlib import Path

DEEPSPEED_CPU_OPS = ("cpu_adam", "deepspeed_shm_comm", "async_io")
NETWORK_FILE_SYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "fuse.sshfs", "glusterfs",
                        "9p", "afs")


def use_interpreter_ninja(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Put the ninja installed beside this interpreter (the pip package DeepSpeed requires) first on PATH, so that
    every process of this environment builds and checks the ops with one ninja; returns the folder put first.

    torch.utils.cpp_extension runs whichever `ninja` PATH finds, and ninja versions log their commands under
    different hashes (1.11 writes log v5, 1.13 log v7): a build checked by the other version counts as changed and
    is compiled again. Here that happened whenever a process with .venv/bin on PATH (an activated environment)
    met ops built by one without (scripts/setup.sh, a bare `.venv/bin/python`): cpu_adam, deepspeed_shm_comm and
    async_io rebuilt back and forth during one test run (20-140 s each, the other ranks waiting on the lock).
    """
    folder = os.path.dirname(sys.executable)
    if not os.access(os.path.join(folder, "ninja"), os.X_OK):
        return None
    path = env.get("PATH", "")
    if path.split(os.pathsep)[0] != folder:
        env["PATH"] = folder + (os.pathsep + path if path else "")
    return folder


def use_environment_extensions_dir(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Give this Python environment its own torch-extensions folder (TORCH_EXTENSIONS_DIR), unless the user named
    one; returns the folder set.

    torch.utils.cpp_extension builds every environment's ops in one folder per Python and CUDA version
    (~/.cache/torch_extensions/py311_cpu/cpu_adam): two virtual environments on one machine (two checkouts, a
    project's and CI's) compile the same op with different include paths, so each rebuilds what the other built
    (20-140 s an op, the other ranks waiting on its lock), and a process may load an op compiled against the other
    environment's torch. Here: torch's own folder name, followed by the environment's folder name and a hash of its
    path (py311_cpu-.venv-1f0c9a2e), under torch's cache root."""
    if "TORCH_EXTENSIONS_DIR" in env or "TORCH_EXTENSIONS_DIR" in os.environ:
        return None
    from torch.utils import cpp_extension

    default = Path(cpp_extension._get_build_directory("", verbose=False))  # torch's own root and folder name
    tag = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    folder = str(default.parent / f"{default.name}-{Path(sys.prefix).name}-{tag}")
    env["TORCH_EXTENSIONS_DIR"] = folder
    return folder


def use_environment_build_tools(env: MutableMapping[str, str] = os.environ) -> None:
    """Before anything builds or loads a DeepSpeed op: this environment's ninja and its own extensions folder."""
    use_interpreter_ninja(env)
    use_environment_extensions_dir(env)


def build_directory(name: str) -> Path:
    """Where torch.utils.cpp_extension builds extension `name` (TORCH_EXTENSIONS_DIR or its cache root)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))  # torch's own rule, not a copy


def lock_holders(lock: Path) -> list[int]:
    """Pids of the processes on this host that have `lock` open (those this user may inspect)."""
    target = os.path.realpath(lock)
    holders = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) == target:
                    holders.append(int(entry.name))
                    break
        except OSError:  # the process ended, or belongs to another user
            continue
    return holders


def file_system_type(path: Path) -> str:
    """The type of the mount holding `path`, from /proc/self/mounts ('' when unknown)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                mount_point = fields[1].replace("\\040", " ")
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) > len(best):
                    best, kind = mount_point, fields[2]
    except OSError:
        return ""
    return kind


def _last_activity(folder: Path) -> float:
    times = [entry.stat().st_mtime for entry in os.scandir(folder) if entry.is_file(follow_symlinks=False)]
    return max(times, default=0.0)


def clear_stale_lock(lock: Path, idle_seconds: float = 300.0, poll_seconds: float = 1.0) -> str | None:
    """Remove `lock` if its builder is gone; returns what was done, None when there was nothing to do or a
    living build holds it (the caller then waits for that build, as torch does)."""
    network = file_system_type(lock.parent) in NETWORK_FILE_SYSTEMS
    announced = False
    while lock.exists():
        if lock_holders(lock):
            return None
        idle = time.time() - _last_activity(lock.parent)
        if not network or idle >= idle_seconds:
            try:
                lock.unlink()
            except FileNotFoundError:
                return None
            return (f"removed {lock}: the build that created it is gone (no process holds it"
                    + (f", its folder idle {idle:.0f} s" if network else "") + "), so torch would wait on it for ever")
        if not announced:
            print(f"rapidtrain: waiting for {lock}: no process on this host builds it; on this network file system "
                  f"a build on another node may (removed after {idle_seconds:.0f} s without activity)",
                  file=sys.stderr, flush=True)
            announced = True
        time.sleep(poll_seconds)
    return None


def clear_stale_op_build_locks(names: Sequence[str] = DEEPSPEED_CPU_OPS, idle_seconds: float = 300.0) -> list[str]:
    """Before DeepSpeed builds its CPU ops: the first process of each node clears the stale locks of `names`,
    the others wait for it at a barrier (so none removes a lock another has just taken). Returns what was done."""
    import torch.distributed as dist

    done: list[str] = []
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        for name in names:
            message = clear_stale_lock(build_directory(name) / "lock", idle_seconds)
            if message:
                print(f"rapidtrain: {message}", file=sys.stderr, flush=True)
                done.append(message)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return done


# What each op serves, for the line a run prints when it has to build one (a silent minute looks like a hang).
OP_PURPOSES = {"cpu_adam": "the CPU Adam of --cpu-offload",
               "deepspeed_shm_comm": "DeepSpeed's shared-memory CPU collectives",
               "async_io": "ZeRO-Infinity's NVMe offload (libaio)"}
OP_BUILDERS = {"cpu_adam": "CPUAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder", "async_io": "AsyncIOBuilder"}


def is_built(name: str) -> bool:
    """Whether torch.utils.cpp_extension's build folder already holds op `name`'s shared library."""
    return (build_directory(name) / f"{name}.so").exists()


def announce_op_builds(names: Sequence[str]) -> list[str]:
    """Print one line per op in `names` that is not built yet: DeepSpeed compiles it now, which takes minutes."""
    lines = []
    for name in names:
        if not is_built(name):
            lines.append(f"rapidtrain: DeepSpeed is building its op {name} ({OP_PURPOSES.get(name, 'a CPU op')}) "
                         f"with ninja into {build_directory(name)}: once per machine, 1-2 minutes; scripts/setup.sh "
                         "builds it ahead (python -m rapidtrain.parallel.op_build)")
    if lines and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print("\n".join(lines), file=sys.stderr, flush=True)
    return lines


def build_deepspeed_cpu_ops(names: Sequence[str] = DEEPSPEED_CPU_OPS) -> list[str]:
    """Build the ops `names` that this machine's DeepSpeed accelerator can build; returns those built."""
    from deepspeed.accelerator import get_accelerator

    use_environment_build_tools()
    built = []
    for name in names:
        builder = get_accelerator().create_op_builder(OP_BUILDERS[name])
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"rapidtrain: DeepSpeed op {name} does not build on this machine ({get_accelerator()._name}): "
                  "skipped", flush=True)
            continue
        started = time.perf_counter()
        builder.load(verbose=False)
        print(f"rapidtrain: DeepSpeed op {name} ready ({time.perf_counter() - started:.0f} s)", flush=True)
        built.append(name)
    return built


if __name__ == "__main__":
    build_deepspeed_cpu_ops()
