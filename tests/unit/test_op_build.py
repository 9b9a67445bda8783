"""A torch-extension build killed midway leaves FileBaton's lock; the next DeepSpeed run would wait on it for ever.
The lock is removed when no process holds it, and kept while a build holds it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rapidtrain.parallel.op_build import (
    announce_op_builds,
    build_directory,
    clear_stale_lock,
    clear_stale_op_build_locks,
    is_built,
    lock_holders,
    use_environment_extensions_dir,
    use_interpreter_ninja,
)

BUILDER = textwrap.dedent("""
    import sys, time
    from torch.utils.file_baton import FileBaton
    baton = FileBaton(sys.argv[1])
    assert baton.try_acquire()
    print("building", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # never the shared cache
    return tmp_path


def start_build(lock) -> subprocess.Popen:
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "building"
    return builder


def test_lock_of_a_killed_build_is_removed_and_a_new_build_can_take_it(extensions):
    lock = build_directory("cpu_adam") / "lock"
    assert lock.parent == extensions / "cpu_adam"
    builder = start_build(lock)
    builder.kill()  # as an interrupted first --cpu-offload run
    builder.wait()
    assert lock.exists() and lock_holders(lock) == []
    done = clear_stale_op_build_locks(["cpu_adam"])
    assert done == [f"removed {lock}: the build that created it is gone (no process holds it), so torch would "
                    "wait on it for ever"]
    from torch.utils.file_baton import FileBaton

    assert FileBaton(str(lock)).try_acquire()  # torch's next build proceeds instead of waiting


def test_lock_of_a_running_build_is_kept(extensions):
    lock = build_directory("cpu_adam") / "lock"
    builder = start_build(lock)
    try:
        assert lock_holders(lock) == [builder.pid]
        assert clear_stale_lock(lock) is None and lock.exists()
    finally:
        builder.kill()
        builder.wait()


def test_nothing_to_do_without_a_lock(extensions):
    assert clear_stale_op_build_locks() == []
    assert not any((extensions / name / "lock").exists() for name in ("cpu_adam", "deepspeed_shm_comm"))


def test_a_run_that_must_build_an_op_says_so_and_a_built_one_is_silent(extensions, capsys):
    lines = announce_op_builds(["cpu_adam", "deepspeed_shm_comm"])
    assert len(lines) == 2 and "building its op cpu_adam (the CPU Adam of --cpu-offload)" in lines[0]
    assert "scripts/setup.sh builds it ahead" in lines[0] and lines[0] in capsys.readouterr().err
    folder = build_directory("cpu_adam")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu_adam.so").write_bytes(b"")  # what a finished build leaves
    assert is_built("cpu_adam") and announce_op_builds(["cpu_adam"]) == []


def test_the_interpreters_ninja_comes_first_on_path():
    """One ninja for every process of the environment: ninja 1.11 and 1.13 hash their logged commands differently,
    so ops built by one were rebuilt by the other (seen in a test run: back and forth, 20-140 s each)."""
    env = {"PATH": os.pathsep.join(["/usr/bin", "/bin"])}
    folder = use_interpreter_ninja(env)
    assert folder == os.path.dirname(sys.executable)  # pip's ninja, which DeepSpeed requires, is installed here
    assert shutil.which("ninja", path=env["PATH"]) == os.path.join(folder, "ninja")
    assert use_interpreter_ninja(env) == folder and env["PATH"].split(os.pathsep).count(folder) == 1


def test_each_environment_builds_its_ops_in_its_own_folder(monkeypatch, tmp_path):
    """Two environments on one machine (two checkouts' .venv) compile the same op with different include paths:
    in torch's one folder per Python version each rebuilt what the other had built. Each gets its own folder under
    torch's cache root; a folder the user names (TORCH_EXTENSIONS_DIR) is kept."""
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # torch's cache root follows it
    env: dict[str, str] = {}
    folder = use_environment_extensions_dir(env)
    torch_default = cpp_extension._get_build_directory("cpu_adam", verbose=False)  # py311_cpu/cpu_adam
    assert folder == env["TORCH_EXTENSIONS_DIR"] and os.path.dirname(folder) == os.path.dirname(
        os.path.dirname(torch_default))
    assert os.path.basename(folder).startswith(os.path.basename(os.path.dirname(torch_default)) + "-")
    assert os.path.basename(folder).split("-")[1] == os.path.basename(sys.prefix)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other" / ".venv"))
    other: dict[str, str] = {}
    assert use_environment_extensions_dir(other) not in (None, folder)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert use_environment_extensions_dir(mine := {}) is None and mine == {}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", folder)
    assert build_directory("cpu_adam") == Path(folder) / "cpu_adam"  # where DeepSpeed's builder then builds
