"""One store of cache states by key: an LRU in memory, optionally a directory, both bounded by bytes.

The prefix store (`litkv.states.prefix.PrefixCache`) and the server's conversation store
(`litkv.serve.store.ConversationStore`) are both this store with their own keys.

- **Memory**: `StateLRU`, at most `max_bytes` bytes of state tensors, least recently used first.
- **Directory** (optional): each state is also written as `<key>.safetensors` (the `CacheState` file
  format, through `litkv.core.atomic`), read back on a memory miss (after a restart, or by another process
  sharing the directory). The files, small JSON notes (`<key>.json`) and the temporary files of writes
  in progress are bounded by `disk_bytes`, least recently used (read or written) first.
- **An entry is proven by its content.** A file's checksummed litkv metadata holds its entry (`"entry"`:
  the key it was written under, the number of tokens it covers and the sha256 of their token ids,
  `ids_digest`), the model fingerprint and each layer's cache config and shape. `get` compares all of
  them with the request's (its key, its token ids, an `EntryCheck`: the weights' fingerprint, the
  cache configuration, shapes and dtype) from the file's header, before a tensor is read or a cache
  allocated, and the checksum then proves the header: a file copied under another key, relabelled, or
  holding other tokens' state is never restored. A mismatch, like a corrupt file, is a miss: one
  logged warning, the file removed (the caller recomputes and writes it again).
- **Only the store's key writes an entry it accepts.** Anyone can recompute a checksum, so every file
  (state and note) also carries an HMAC-SHA256 under a key the directory does not hold (`key`, default
  the user's secret, `litkv.core.secret.user_secret`), and a state file holds the token ids it was
  taken over, compared with the request's on reading: whoever can write the directory can delete or
  corrupt entries (misses: recomputed), never make the store restore a state it did not write for
  these tokens (docs/reliability.md, the threat model).
- **Degrades, never fails.** A write that fails for lack of space or permission warns once and the
  store goes on in memory only, trying the directory again after `RETRY_SECONDS` (a log line when it
  writes again); an entry another process removed is a plain miss; a directory removed
  while in use is created again by the next write; temporary files of dead writers are removed when
  the store opens (those of live writers count towards the bound).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from litkv.core.atomic import remove_stale_temp_files, temp_files, write_text_atomic
from litkv.core.secret import check_key, mac, macs_equal, user_secret
from litkv.states.entry import EntryCheck, entry_problem, ids_digest
from litkv.states.state import CacheState
from litkv.states.state_file import read_state_header

__all__ = ["EntryCheck", "StateLRU", "StateStore", "ids_digest"]

log = logging.getLogger(__name__)
STATE_SUFFIX = ".safetensors"
NOTE_SUFFIX = ".json"
#: Seconds a store whose directory failed a write (full disk, read-only) waits before it tries again.
RETRY_SECONDS = 30.0


class StateLRU:
    """Cache states by key, at most `max_bytes` bytes of tensors (`CacheState.nbytes`) in all; the least
    recently used go first.

    Attributes:
        nbytes: bytes of the states held.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._states: OrderedDict[str, CacheState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: object) -> bool:
        return key in self._states

    def states(self) -> list[CacheState]:
        """The states held, least recently used first."""
        return list(self._states.values())

    def get(self, key: str) -> CacheState | None:
        """The state under `key`, marked most recently used; `None` when there is none."""
        state = self._states.get(key)
        if state is not None:
            self._states.move_to_end(key)
        return state

    def put(self, key: str, state: CacheState) -> bool:
        """Keep `state` under `key` (replacing what was there), then drop the least recently used states
        until the total fits. Returns False, keeping nothing, for a state larger than `max_bytes`."""
        old = self._states.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes()
        size = state.nbytes()
        if size > self.max_bytes:
            return False
        self._states[key] = state
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, dropped = self._states.popitem(last=False)
            self.nbytes -= dropped.nbytes()
        return True

    def clear(self) -> None:
        """Forget every state."""
        self._states.clear()
        self.nbytes = 0


class StateStore:
    """Cache states by key in memory (LRU, `max_bytes`) and optionally in `directory` (`disk_bytes`).

    Args:
        max_bytes: most bytes of state tensors kept in memory (0: none).
        directory: where states are also written, to be found again by later runs (created if needed).
        disk_bytes: most bytes of files in `directory` (default: `max_bytes`).
        max_notes: most notes (small JSON values by key) kept in memory.
        name: how warnings name the store.
        key: the secret that authenticates the directory's files (at least 32 bytes; default: the user's
            secret, `$LITKV_HOME/secret.key`): a file without its mac is refused.

    Attributes:
        hits: states found in `"memory"` and on `"disk"`.
    """

    def __init__(
        self,
        max_bytes: int,
        directory: str | Path | None = None,
        disk_bytes: int | None = None,
        max_notes: int = 65536,
        name: str = "state store",
        key: bytes | None = None,
    ) -> None:
        for what, value in (("max_bytes", max_bytes), ("disk_bytes", disk_bytes), ("max_notes", max_notes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{what} must be an int >= 0, got {value!r}")
        self.name = name
        self.max_bytes = max_bytes
        self.disk_bytes_bound = max_bytes if disk_bytes is None else disk_bytes
        self.max_notes = max_notes
        self.memory = StateLRU(max_bytes)
        self.hits = {"memory": 0, "disk": 0}
        self.directory = None if directory is None else Path(directory)
        self._key = check_key(key, "a store's key") if key is not None else None
        if self.directory is not None and self._key is None:
            self._key = user_secret()
        self._notes: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._failed_at: float | None = None  # when a write last failed (`None`: the directory is writable)
        if self.directory is not None:
            self._open_directory(self.directory)

    def _open_directory(self, directory: Path) -> None:
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(f"{self.name} directory {str(directory)!r} is a file")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            removed = remove_stale_temp_files(directory, depth=0, quiet=True)
        except OSError as err:  # cannot create it, or read-only: memory only
            self._memory_only(err)
            return
        if removed:
            log.warning("%s: removed %d temporary file(s) of interrupted writes", self.name, len(removed))

    def _memory_only(self, err: OSError) -> None:
        """A write failed: memory only until `RETRY_SECONDS` have passed (warned on the change only)."""
        if self._failed_at is None:
            warnings.warn(
                f"{self.name}: cannot write to {str(self.directory)!r} ({err}); going on in memory only, "
                f"trying the directory again every {RETRY_SECONDS:g} s",
                stacklevel=4,
            )
        self._failed_at = time.monotonic()

    def _paused(self) -> bool:
        """Whether writes to the directory wait (a write failed less than `RETRY_SECONDS` ago)."""
        return self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_SECONDS

    def _recovered(self) -> None:
        """A write succeeded: if the directory had failed, say once that it is written again."""
        if self._failed_at is not None:
            self._failed_at = None
            log.warning("%s: %s can be written again; states are stored there again", self.name, self.directory)

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the states held in memory."""
        return self.memory.nbytes

    def __len__(self) -> int:
        return len(self.memory)

    def disk_bytes(self) -> int:
        """Bytes of the files in `directory` and of temporary files of writes in progress (0 without one)."""
        return sum(size for _, size, _ in _sized(self._files() + self._temps()))

    def clear(self) -> None:
        """Forget the states and notes held in memory (files on disk stay)."""
        with self._lock:
            self.memory.clear()
            self._notes.clear()

    # -- states ---------------------------------------------------------------------------------

    def get(
        self,
        key: str,
        check: EntryCheck | None = None,
        tokens: int | None = None,
        token_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> CacheState | None:
        """The state stored under `key` (memory first, then the directory), marked most recently used.

        A file must prove `key`, cover `tokens` tokens (when given; its last position is `tokens - 1`),
        have been taken over exactly `token_ids` (when given: the digest its entry records) and pass
        `check` (when given); one that does not, or cannot be read, is a miss with a logged warning, and
        is removed. A file that another process removed meanwhile is a plain miss.
        """
        with self._lock:
            state = self.memory.get(key)
            if state is not None:
                self.hits["memory"] += 1
                return state
        path = self._path(key, STATE_SUFFIX)
        if path is None or not path.is_file():
            return None
        try:
            state = self._read(path, key, check, tokens, None if token_ids is None else _id_list(token_ids))
        except (ValueError, OSError) as err:  # a corrupt or foreign entry is dropped (and recomputed)
            if not path.exists():  # removed by another process (or with the directory) meanwhile: a miss
                return None
            log.warning("%s: ignoring and removing %s: %s", self.name, path, err)
            _remove(path)
            return None
        with contextlib.suppress(OSError):  # removed by another process meanwhile; the state read is complete
            os.utime(path)
        with self._lock:
            self.memory.put(key, state)
            self.hits["disk"] += 1
        return state

    def _read(
        self, path: Path, key: str, check: EntryCheck | None, tokens: int | None, ids: list[int] | None
    ) -> CacheState:
        """The state in `path`, checked from its header (size, entry, `check`) before any tensor is read,
        then read with its checksum and mac verified (which cover the entry checked), and its own token
        ids compared with the request's `ids`."""
        digest = None if ids is None else ids_digest(ids)
        size = path.stat().st_size
        if size > self.disk_bytes_bound:
            raise ValueError(f"the file has {size} bytes, more than the store's bound of {self.disk_bytes_bound}")
        meta, _ = read_state_header(path)
        problem = entry_problem(meta.get("entry"), key, tokens, digest)
        problem = problem or (None if check is None else check.mismatch(meta))
        if problem:
            raise ValueError(problem)
        state, entry = CacheState.load_entry(path, key=self._key)
        problem = entry_problem(entry, key, tokens, digest)  # the checksummed entry (the file may have changed)
        if problem:
            raise ValueError(problem)
        if ids is not None and state.token_ids != [ids]:
            raise ValueError("the state's own token ids are not the request's")
        covered = entry["tokens"]  # type: ignore[index]
        if not isinstance(covered, int) or _covered(state) != covered:
            raise ValueError(f"the state covers {_covered(state)} tokens, but its entry claims {covered!r}")
        return state

    def put(
        self,
        key: str,
        state: CacheState,
        tokens: int | None = None,
        token_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        """Keep `state` under `key` in memory and, with a directory, in a file (unless one is there).

        `tokens`: how many tokens the state covers (default: its last position + 1); `token_ids`: the
        ids it was taken over; both recorded in the file's checksummed entry with the key and checked by
        `get`. A state larger than a bound is not kept under it.
        """
        with self._lock:
            self.memory.put(key, state)
        path = self._path(key, STATE_SUFFIX)
        if path is None or self._paused() or state.nbytes() > self.disk_bytes_bound or path.exists():
            return
        ids = None if token_ids is None else _id_list(token_ids)
        entry = {
            "key": key,
            "tokens": _covered(state) if tokens is None else tokens,
            "ids_sha256": None if ids is None else ids_digest(ids),
        }
        if ids is not None and state.batch_size == 1 and state.token_ids != [ids]:
            state = copy.copy(state)  # the file holds the ids it covers (compared with a request's on reading)
            state.token_ids = [ids]
        if self._write(path, lambda: state.save(path, entry=entry, key=self._key)):
            self._trim_disk()

    def _write(self, path: Path, write: Callable[[], object]) -> bool:
        """Run `write()`; False when the directory cannot be written (memory only for `RETRY_SECONDS`, a
        warning when the store goes from writing to not writing, a log line when it writes again)."""
        try:
            write()
        except FileNotFoundError as err:  # another process removed our temporary file: skip this one
            log.info("%s: %s not written: %s", self.name, path, err)
            return False
        except OSError as err:  # no space, no permission, read-only, not a directory: memory only for a while
            self._memory_only(err)
            return False
        self._recovered()
        return True

    # -- notes ----------------------------------------------------------------------------------

    def put_note(self, key: str, note: dict[str, Any]) -> None:
        """Keep a small JSON object under `key` (memory: the `max_notes` most recent; and `<key>.json`)."""
        with self._lock:
            self._remember(key, dict(note))
        path = self._path(key, NOTE_SUFFIX)
        if path is None or self._paused():
            return
        text = json.dumps({"key": key, "note": note, "mac": self._note_mac(key, note)})
        if self._write(path, lambda: write_text_atomic(path, text)):
            self._trim_disk()

    def note(self, key: str) -> dict[str, Any] | None:
        """The note under `key` (memory, then the directory); a file that does not prove `key` is a miss
        with a warning, and is removed."""
        with self._lock:
            note = self._notes.get(key)
            if note is not None:
                self._notes.move_to_end(key)
                return dict(note)
        path = self._path(key, NOTE_SUFFIX)
        if path is None or not path.is_file():
            return None
        try:
            if path.stat().st_size > self.disk_bytes_bound:
                raise ValueError(f"the file has more bytes than the store's bound of {self.disk_bytes_bound}")
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("note"), dict):
                raise ValueError(f"the note does not prove key {key[:16]}...")
            if not macs_equal(data.get("mac"), self._note_mac(key, data["note"])):
                raise ValueError("the note carries no mac of this store's key (forged, or another user's)")
        except (ValueError, OSError) as err:
            if path.exists():
                log.warning("%s: ignoring and removing %s: %s", self.name, path, err)
                _remove(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        with self._lock:
            self._remember(key, data["note"])
        return dict(data["note"])

    def _note_mac(self, key: str, note: dict[str, Any]) -> str:
        """The mac of the note `note` under `key` (a store with a directory always has a key)."""
        text = json.dumps({"key": key, "note": note}, sort_keys=True)
        return mac(self._key or b"", "store-note", hashlib.sha256(text.encode()).hexdigest())

    def drop_note(self, key: str) -> None:
        """Forget the note under `key` (memory and file)."""
        with self._lock:
            self._notes.pop(key, None)
        path = self._path(key, NOTE_SUFFIX)
        if path is not None:
            _remove(path)

    def _remember(self, key: str, note: dict[str, Any]) -> None:
        self._notes[key] = note
        self._notes.move_to_end(key)
        while len(self._notes) > self.max_notes:
            self._notes.popitem(last=False)

    # -- the directory --------------------------------------------------------------------------

    def _path(self, key: str, suffix: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}{suffix}"

    def _files(self) -> list[Path]:
        if self.directory is None:
            return []
        try:
            entries = list(self.directory.iterdir())
        except (FileNotFoundError, NotADirectoryError):  # removed while in use: recreated by the next write
            return []
        suffixes = (STATE_SUFFIX, NOTE_SUFFIX)
        return [f for f in entries if f.name.endswith(suffixes) and not f.name.startswith(".")]

    def _temps(self) -> list[Path]:
        return [] if self.directory is None else temp_files(self.directory)

    def _trim_disk(self) -> None:
        """Remove the least recently used files until the files and writes in progress fit `disk_bytes`."""
        files = sorted(_sized(self._files()), key=lambda x: x[0])
        total = sum(size for _, size, _ in files) + sum(size for _, size, _ in _sized(self._temps()))
        for _, size, f in files:
            if total <= self.disk_bytes_bound:
                break
            _remove(f)
            total -= size


def _remove(path: Path) -> None:
    """Remove `path` if it is there and the directory lets us (read-only: it stays, a miss all the same)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _id_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    """Token ids as a list of Python ints."""
    return torch.as_tensor(token_ids).detach().to("cpu", torch.int64).reshape(-1).tolist()


def _covered(state: CacheState) -> int:
    """Tokens a state covers: its last position + 1 (0 when it has seen nothing)."""
    last = state.last_pos
    return 0 if last is None or last.numel() == 0 else int(last.max()) + 1


def _sized(paths: list[Path]) -> list[tuple[float, int, Path]]:
    """(mtime, size, path) of the paths that still exist (another process may remove any of them)."""
    out = []
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        out.append((st.st_mtime, st.st_size, path))
    return out
