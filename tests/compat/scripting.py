"""Running a launch script the way a user does, and what the compatibility tests share."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.launch import REPO, child_env, free_port

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_script(script: Path, workdir: Path, env: dict[str, str] | None = None, args: list[str] | None = None,
               timeout: int = 900) -> subprocess.CompletedProcess:
    """`bash SCRIPT ARGS` in `workdir` with the venv's python/torchrun first on PATH, as a user runs it."""
    environment = child_env({"MASTER_PORT": str(free_port()), "RAPIDTRAIN_DIR": str(REPO), **(env or {})}, nproc=2)
    environment["PATH"] = str(Path(sys.executable).parent) + os.pathsep + environment.get("PATH", "")
    result = subprocess.run(["bash", str(script), *(args or [])], cwd=workdir, env=environment, capture_output=True,
                            text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{script.name} failed ({result.returncode}):\n{result.stdout[-5000:]}\n"
                             f"{result.stderr[-5000:]}")
    return result


def copy_into(workdir: Path, *files: Path) -> None:
    """Put files where a script expects them (Megatron's examples name gpt2-vocab.json in the working folder)."""
    for file in files:
        shutil.copy(file, workdir / file.name)
