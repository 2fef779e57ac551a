"""A full disk degrades a state store to memory for a while, not for ever (issue 47, item 7).

The round's finding: after one full-disk failure the serve store wrote nothing more, ever, even when
space came back, and after a restart those turns were gone.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch

from litkv.core import atomic
from litkv.kvcache.config import KVCacheConfig
from litkv.states import state_file, state_store
from litkv.states.state import snapshot
from litkv.states.state_store import StateStore


def _state(model: object, n: int) -> object:
    model.set_kv_caches(model.build_kv_caches(KVCacheConfig(policy="dense", cache_length=16), 1))  # type: ignore[attr-defined]
    model(torch.arange(1, n + 1)[None], torch.arange(n)[None])  # type: ignore[operator]
    return snapshot(model)  # type: ignore[arg-type]


def test_store_writes_again_when_space_comes_back(
    model: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(state_store.time, "monotonic", lambda: clock[0])
    real_write = state_file.write_atomic
    full = [True]

    def write(path: Path, fn: object) -> object:
        if full[0]:
            raise atomic.FileWriteError(errno.ENOSPC, f"cannot write {str(path)!r}: No space left on device")
        return real_write(path, fn)  # type: ignore[arg-type]

    monkeypatch.setattr(state_file, "write_atomic", write)
    store = StateStore(1 << 30, tmp_path / "s")
    with pytest.warns(UserWarning, match="going on in memory only") as record:
        store.put("a", _state(model, 3))
        store.put("b", _state(model, 4))  # within the pause: not even tried
    assert len(record) == 1 and not list((tmp_path / "s").glob("*.safetensors"))
    full[0] = False
    store.put("c", _state(model, 5))  # still within the pause
    assert not (tmp_path / "s" / "c.safetensors").exists()
    clock[0] += state_store.RETRY_SECONDS + 1
    with caplog.at_level(logging.WARNING):
        store.put("d", _state(model, 6))
    assert (tmp_path / "s" / "d.safetensors").is_file() and "can be written again" in caplog.text
    restarted = StateStore(1 << 30, tmp_path / "s")
    assert restarted.get("d", tokens=6) is not None and restarted.hits["disk"] == 1
    # a second failure warns again (a change of state), once
    full[0] = True
    clock[0] += 1
    with pytest.warns(UserWarning, match="going on in memory only") as record:
        store.put("e", _state(model, 7))
    assert len(record) == 1
