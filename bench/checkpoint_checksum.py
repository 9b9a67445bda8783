"""What the checkpoint manifest costs: save, checksum and verification times of a few-hundred-MB checkpoint,
CRC-32 (what rapidtrain uses) against SHA-256, on this machine's CPU.

    python bench/checkpoint_checksum.py [--params-millions 40]
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

import torch
from machine import cpu_name
from torch import nn


class Runner:
    """A model and AdamW with rapidtrain's checkpoint protocol (one process)."""

    def __init__(self, params_millions: int) -> None:
        width = 1024
        layers = max(1, params_millions * 10**6 // (width * width))
        self.module = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.optimizer = torch.optim.AdamW(self.module.parameters())
        self.module(torch.randn(2, width)).sum().backward()
        self.optimizer.step()

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optimizer": optimizer}


def sha256(path: Path) -> str:
    with open(path, "rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params-millions", type=int, default=40)
    options = parser.parse_args()
    from rapidtrain.checkpoint.checkpointer import file_checksum, iteration_dir, save_checkpoint, verify_checkpoint

    runner = Runner(options.params_millions)
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        save_checkpoint(folder, 1, runner, None, 0, {})
        saved = time.perf_counter() - started
        directory = iteration_dir(folder, 1)
        files = [p for p in directory.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        timings = {}
        for name, digest in (("crc32", file_checksum), ("sha256", sha256)):
            started = time.perf_counter()
            for path in files:
                digest(path)
            timings[name] = time.perf_counter() - started
        started = time.perf_counter()
        verify_checkpoint(directory)
        verified = time.perf_counter() - started
    print(f"CPU: {cpu_name()}, torch {torch.__version__}")
    print(f"checkpoint: {size / 2**20:,.0f} MiB in {len(files)} files; save_checkpoint (with manifest) {saved:.2f} s")
    for name, seconds in timings.items():
        print(f"  {name:7s} over all files: {seconds:.3f} s ({size / 2**20 / seconds:,.0f} MiB/s, "
              f"{100 * seconds / saved:.0f}% of the save)")
    print(f"  verify_checkpoint (sizes, then CRC-32 of every file): {verified:.3f} s")


if __name__ == "__main__":
    main()
