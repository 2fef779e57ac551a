"""Messages that name what the user gave (issue 61 item 10): each was reported as something else before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import litkv
from litkv import KVCacheConfig, Sampling
from litkv.checkpoints.gguf_convert import convert_gguf
from litkv.finetune.sharding import check_strategy


def test_learn_eviction_with_fsdp_names_learn_eviction() -> None:
    """It said "got --mode 'lora'", a mode the user never gave."""
    with pytest.raises(ValueError, match="--learn_eviction true .* got --strategy fsdp") as err:
        check_strategy("fsdp", 2, "lora", learn_eviction=True)
    assert "--mode" not in str(err.value)
    with pytest.raises(ValueError, match="got --mode 'lora'"):  # without --learn_eviction, the mode is the user's
        check_strategy("fsdp", 2, "lora", learn_eviction=False)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_gguf_that_is_a_fifo_or_a_directory_is_named_as_such(tmp_path: Path) -> None:
    """Both were "does not exist"; the FIFO is never opened (it would block)."""
    os.mkfifo(tmp_path / "pipe.gguf")
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ValueError, match=r"pipe.gguf' is a FIFO \(named pipe\), not a regular file"):
        convert_gguf(tmp_path / "pipe.gguf", tmp_path / "out")
    with pytest.raises(ValueError, match=r"dir.gguf' is a directory, not a regular file"):
        convert_gguf(tmp_path / "dir.gguf", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_gguf(tmp_path / "none.gguf", tmp_path / "out")


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv"])
def test_one_shot_budget_beyond_the_cache_blames_budget(policy: str) -> None:
    """The default recent window follows the budget, so a budget of 100000 was reported as `recent`."""
    with pytest.raises(ValueError, match="budget must be <= cache_length, got budget=100000, cache_length=256"):
        KVCacheConfig(policy, cache_length=256, options={"mode": "one-shot", "budget": 100000})


def test_a_recent_window_the_user_gave_is_still_blamed() -> None:
    with pytest.raises(ValueError, match="sinks \\+ recent must be <= cache_length"):
        KVCacheConfig("h2o", cache_length=256, options={"mode": "one-shot", "budget": 100, "recent": 300})


@pytest.mark.parametrize("token", [10**30, 2**63])
def test_stop_token_beyond_int64_is_refused_at_once(token: int) -> None:
    """It was accepted, then "Overflow when unpacking long long" at the first step."""
    with pytest.raises(ValueError, match="a stop token must be"):
        Sampling(stop_tokens=[token])
    assert Sampling(stop_tokens=[2**63 - 1]).stop_tokens == (2**63 - 1,)


@pytest.mark.parametrize("name", [123, None, 1.5, b"smollm2"])
def test_load_names_its_argument(name: object) -> None:
    """`litkv.load(123)` gave pathlib's "expected str, bytes or os.PathLike object, not int"."""
    with pytest.raises(TypeError, match=r"litkv.load takes a model name or a checkpoint directory"):
        litkv.load(name)  # type: ignore[arg-type]
