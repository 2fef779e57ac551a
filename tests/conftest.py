"""Shared fixtures: deterministic seeds, one intra-op thread (tiny models; a shared 2-core box), and the
tiny model and checkpoint most tests start from.

Helpers to import in tests live in `tests/helpers.py`, `tests/tiny_checkpoint.py` and
`tests/gguf_files.py` (importable from every test folder: `pythonpath = ["tests"]` in pyproject.toml).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import _triton_interpret  # noqa: F401  (first: sets TRITON_INTERPRET before anything imports triton)
import early
import helpers
import pytest
import suite_order
import torch
from litgpt import Config
from tiny_checkpoint import make_tiny_checkpoint

from litkv import GPT

TINY_PRESET = helpers.TINY_PRESET


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
def tiny_model() -> Callable[..., GPT]:
    """The test model factory (`helpers.tiny_gpt`); every test builds its model with it:

    `tiny_model(seed, dtype=torch.float32, *, arch=None, config=TINY_PRESET, overrides=None, gates=False,
    gate_seed=None, window=2, sinks=1, device="cpu", weights=None)` -- a fresh random model of a tiny preset
    (`arch`: a name in `helpers.ARCHITECTURES`; `config`: a LitGPT preset name shrunk to 2 layers, width 64,
    vocabulary 128, `overrides` on top, or a `Config`: the hybrid ones of `tests/bamba_helpers.py`
    and `qwen35_helpers.py` too), or with the given `weights` (a parity test's), in
    float64 (`float64_model`) with `dtype=torch.float64`, with random eviction gates with `gates=True`.
    Every call builds a new model, so a module-scoped fixture may mutate its own.
    """
    return helpers.tiny_gpt


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The suite's longest files first (`tests/suite_order.py`)."""
    suite_order.longest_first(items, Path(__file__).parent)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The selected tests' `EARLY_START` processes start now (`tests/early.py`), beside the rest of the suite;
    not in an xdist worker (which does not know which of the collected tests it will run: a test starts its own
    process when its turn comes, while the other workers go on)."""
    if not session.config.option.collectonly and "PYTEST_XDIST_WORKER" not in os.environ:
        early.start_selected(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    early.stop_all()


@pytest.fixture
def early_process(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen | None, Path]]:
    """This test's `EARLY_START` process and its working directory (`tests/early.py`): started with the session
    (or now, where it was not); killed if still running and the directory removed after the test."""
    proc, work = early.take(request.node)
    try:
        yield proc, work
    finally:
        early.finish(proc, work)
