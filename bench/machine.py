"""The machine a bench ran on, for the line every bench prints beside its numbers."""

from __future__ import annotations

import platform
import subprocess


def cpu_name() -> str:
    """lscpu's model name (e.g. "Intel(R) Xeon(R) Processor"), else what the platform module knows."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()
