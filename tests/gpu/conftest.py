"""The GPU suite: every test here needs a CUDA device and is skipped without one (one command runs them all:
`python -m pytest tests/gpu -v`). Runs are world size 1 under torchrun, so the process group is NCCL's
("cpu:gloo,cuda:nccl"), as a real multi-GPU run's is."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the GPU suite; see README: Testing on a GPU)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
