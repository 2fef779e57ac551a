"""Shared fixtures: deterministic seeds, one intra-op thread (tiny models; a shared 2-core box), and the
tiny model and checkpoint most tests start from.

Helpers to import in tests live in `tests/helpers.py`, `tests/tiny_checkpoint.py` and
`tests/gguf_files.py` (importable from every test folder: `pythonpath = ["tests"]` in pyproject.toml).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import helpers
import pytest
import torch
from litgpt import Config
from tiny_checkpoint import make_tiny_checkpoint

from litkv import GPT

TINY_PRESET = "SmolLM2-135M"


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


@pytest.fixture(scope="session")
def tiny_config() -> Config:
    """The tiny SmolLM2 config (2 layers, width 64, vocabulary 128: `helpers.tiny_config`)."""
    return helpers.tiny_config(TINY_PRESET)


@pytest.fixture(scope="session")
def tiny_model(tiny_config: Config) -> Callable[..., GPT]:
    """Factory `tiny_model(seed, dtype=torch.float32)`: a fresh `random_gpt` of `tiny_config` (eval mode).

    `dtype=torch.float64` gives `helpers.float64_model` of it (RMSNorm computed in float64 too). Every
    call builds a new model, so a module-scoped fixture may mutate its own.
    """

    def build(seed: int, dtype: torch.dtype = torch.float32) -> GPT:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"tiny_model dtype must be torch.float32 or torch.float64, got {dtype}")
        model = helpers.random_gpt(tiny_config, seed=seed)
        return helpers.float64_model(model) if dtype == torch.float64 else model

    return build


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    """`tiny_model(seed=0)`, one per test module (a module that needs another model overrides `model`)."""
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding `make_tiny_checkpoint`'s default checkpoint, one per test module."""
    path = tmp_path_factory.mktemp("ckpt")
    make_tiny_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt: Path) -> Path:
    """`tiny_ckpt` under the name most tests use (a module that needs another checkpoint overrides `ckpt`)."""
    return tiny_ckpt
