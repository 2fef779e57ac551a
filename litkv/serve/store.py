"""Conversation states of `litkv serve`: a byte-bounded LRU in memory, optionally written through to a directory.

A state is keyed by the digest of a conversation prefix that ends with an assistant message (see
`litkv.serve.engine.message_keys`). Next to each state the store keeps the exact token ids of that
assistant reply (a few bytes per token, in a separate count-bounded LRU and in a JSON file beside the
state file), so that a conversation whose state was evicted is recomputed from the very tokens that
were generated, not from a re-tokenisation of the reply's text.

Files: `<key>.safetensors` (the `CacheState` file format) and `<key>.json` (`{"reply_ids": [...]}`),
both written atomically (`_save_atomic`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from pathlib import Path

from litkv.atomic import write_text_atomic
from litkv.state import CacheState, StateLRU

__all__ = ["StateStore"]

log = logging.getLogger(__name__)


class StateStore:
    """Conversation states by key: memory LRU of at most `max_bytes` bytes, plus `directory` when given.

    Args:
        max_bytes: bytes of state tensors kept in memory (least recently used ones go first).
        directory: where every stored state is also written (read back on a memory miss, e.g. after a
            restart). `None`: memory only.
        max_replies: reply token lists kept in memory (each is small).
    """

    def __init__(self, max_bytes: int, directory: Path | None = None, max_replies: int = 65536) -> None:
        if max_bytes < 0:
            raise ValueError(f"state_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.max_replies = max_replies
        self._states = StateLRU(max_bytes)
        self._replies: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = {"memory": 0, "disk": 0}

    @property
    def nbytes(self) -> int:
        """Bytes of the states held in memory."""
        return self._states.nbytes

    def __len__(self) -> int:
        return len(self._states)

    def _path(self, key: str, suffix: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{key}{suffix}"

    def put(self, key: str, state: CacheState, reply_ids: list[int]) -> None:
        """Keep `state` (a CPU copy) and the reply's token ids under `key`."""
        with self._lock:
            self._remember_reply(key, reply_ids)
            self._states.put(key, state)
        if self.directory is not None:
            state.save(self._path(key, ".safetensors"))  # atomic (litkv.atomic)
            write_text_atomic(self._path(key, ".json"), json.dumps({"reply_ids": list(reply_ids)}))

    def _remember_reply(self, key: str, reply_ids: list[int]) -> None:
        self._replies[key] = list(reply_ids)
        self._replies.move_to_end(key)
        while len(self._replies) > self.max_replies:
            self._replies.popitem(last=False)

    def get(self, key: str) -> CacheState | None:
        """The state under `key` from memory, else from the directory; `None` when there is none."""
        with self._lock:
            state = self._states.get(key)
            if state is not None:
                self.hits["memory"] += 1
                return state
        if self.directory is None or not self._path(key, ".safetensors").is_file():
            return None
        try:
            state = CacheState.load(self._path(key, ".safetensors"))
        except (ValueError, FileNotFoundError) as err:
            log.warning("ignoring state file for %s: %s", key[:12], err)
            return None
        with self._lock:
            self._states.put(key, state)
            self.hits["disk"] += 1
        return state

    def reply_ids(self, key: str) -> list[int] | None:
        """The exact token ids of the assistant reply that ends the prefix `key`, when known."""
        with self._lock:
            ids = self._replies.get(key)
            if ids is not None:
                self._replies.move_to_end(key)
                return list(ids)
        if self.directory is None or not self._path(key, ".json").is_file():
            return None
        try:
            ids = json.loads(self._path(key, ".json").read_text())["reply_ids"]
        except (ValueError, KeyError, TypeError, OSError) as err:
            log.warning("ignoring reply file for %s: %s", key[:12], err)
            return None
        if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            log.warning("ignoring reply file for %s: not a list of token ids", key[:12])
            return None
        with self._lock:
            self._remember_reply(key, ids)
        return list(ids)
