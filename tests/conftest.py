"""Shared fixtures: deterministic seeds and one intra-op thread (tiny models; a shared 2-core box).

Helpers to import in tests live in `tests/helpers.py`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _torch_threads() -> Iterator[None]:
    """Tiny models run ~10x faster on one thread than on a contended pool (LITKV_TEST_THREADS overrides)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("LITKV_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same global RNG state."""
    torch.manual_seed(0)
