"""Conversation states of `litkv serve`: the one state store (`litkv.states.state_store`) with the server's checks.

A state is keyed by the digest of a conversation prefix that ends with an assistant message or with
its leading system messages (reply ids then empty; see
`litkv.serve.engine.message_keys`; the digest's root is the model fingerprint and the cache config).
Next to each state the store keeps the exact token ids of that assistant reply (a note of the state
store: a count-bounded LRU in memory and `<key>.json` beside `<key>.safetensors`), so that a
conversation whose state was evicted is recomputed from the very tokens that were generated, not from
a re-tokenisation of the reply's text.

What is read back is checked against the server's own model and caches, never trusted by its name: a
state restores only if its checksummed entry proves its key and the token ids of the conversation it
covers, and it was taken from this model's weights with exactly this cache configuration and shape
(`EntryCheck`, from the file's header, before a tensor is read or a cache allocated); stored reply ids
are used only if each is in the vocabulary, a reply fits the prompt budget and (`Engine`) the ids
decode to the reply's text in the request. Anything else is a miss with a logged warning: the turn
recomputes it. A directory that cannot be written warns once and the store goes on in memory; the
files are trimmed to the bound.
"""

from __future__ import annotations

import logging
from pathlib import Path

from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.model import GPT
from litkv.states.state import CacheState
from litkv.states.state_store import EntryCheck
from litkv.states.state_store import StateStore as _Store

__all__ = ["ConversationStore"]

log = logging.getLogger(__name__)


class ConversationStore:
    """Conversation states by key: memory LRU of at most `max_bytes` bytes, plus `directory` when given.

    Args:
        max_bytes: bytes of state tensors kept in memory (least recently used ones go first).
        directory: where every stored state is also written (read back on a memory miss, e.g. after a
            restart). `None`: memory only.
        model: the server's model: entries must have been taken from its weights, and reply ids must
            be in its vocabulary.
        kv_cache: the server's cache config: entries must hold exactly these caches (batch of one).
        max_prompt_tokens: most tokens a stored reply may have (`None`: no bound).
        disk_bytes: most bytes of files in `directory` (default: `max_bytes`, as the prefix store).
        max_replies: reply token lists kept in memory (each is small).
    """

    def __init__(
        self,
        max_bytes: int,
        directory: Path | None = None,
        *,
        model: GPT,
        kv_cache: KVCacheConfig,
        max_prompt_tokens: int | None = None,
        disk_bytes: int | None = None,
        max_replies: int = 65536,
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"state_bytes must be an int >= 0, got {max_bytes!r}")
        self._store = _Store(max_bytes, directory, disk_bytes, max_replies, name="state store")
        self.check = EntryCheck.of(model, kv_cache)
        self.vocab_size = model.config.padded_vocab_size
        self.max_prompt_tokens = max_prompt_tokens

    @property
    def directory(self) -> Path | None:
        return self._store.directory

    @property
    def hits(self) -> dict[str, int]:
        """States found in `"memory"` and on `"disk"`."""
        return self._store.hits

    @property
    def nbytes(self) -> int:
        """Bytes of the states held in memory."""
        return self._store.nbytes

    def disk_bytes(self) -> int:
        """Bytes of the files in the directory (0 without one)."""
        return self._store.disk_bytes()

    def __len__(self) -> int:
        return len(self._store)

    def put(self, key: str, state: CacheState, reply_ids: list[int], token_ids: list[int] | None = None) -> None:
        """Keep `state` (a CPU copy) and the reply's token ids under `key`; `token_ids`: the ids of the
        conversation the state covers (recorded in its file, checked by `get`)."""
        self._store.put_note(key, {"reply_ids": [int(i) for i in reply_ids]})
        self._store.put(key, state, token_ids=token_ids)

    def has(self, key: str) -> bool:
        """Whether a state under `key` may be found (in memory, or a file of that name)."""
        directory = self._store.directory
        return key in self._store.memory or (directory is not None and (directory / f"{key}.safetensors").is_file())

    def get(self, key: str, token_ids: list[int] | None = None) -> CacheState | None:
        """The state under `key` from memory, else from the directory when it passes the server's
        checks (and was taken over `token_ids`, when given); `None` when there is none."""
        return self._store.get(key, self.check, token_ids=token_ids)

    def drop_reply(self, key: str) -> None:
        """Forget the reply ids stored under `key`."""
        self._store.drop_note(key)

    def reply_ids(self, key: str) -> list[int] | None:
        """The exact token ids of the assistant reply that ends the prefix `key`, when known and valid
        (every id in the vocabulary, at most `max_prompt_tokens` of them); else `None` (recompute)."""
        note = self._store.note(key)
        if note is None:
            return None
        ids = note.get("reply_ids")
        problem = self._reply_problem(ids)
        if problem:
            log.warning("state store: dropping the stored reply ids of %s: %s", key[:12], problem)
            self._store.drop_note(key)
            return None
        return list(ids)  # type: ignore[arg-type]

    def _reply_problem(self, ids: object) -> str | None:
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            return "not a list of token ids"
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            return f"{len(ids)} ids, more than the prompt budget of {self.max_prompt_tokens}"
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            return f"id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
        return None
