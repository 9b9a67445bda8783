"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """In-process fine-tuning runs use one thread: on a few shared cores extra intra-op threads only spin."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
