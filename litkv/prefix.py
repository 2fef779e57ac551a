"""Prefix reuse: a store of cache states keyed by the token ids they cover, in blocks of the chunk size.

A prompt is cut as the prefill cuts it (`ChunkPlan`: the first chunk, then `chunk_size`); the state
after each full block is stored under a hash chain `key_k = sha256(key_{k-1} || block_k ids)` whose
seed is the model's fingerprint and the cache configs. `generate(..., prefix_cache=store)` prefills
each row alone from the longest stored prefix of its prompt (rows of a batch may match different
lengths), stores the blocks it computes, then merges the rows (`CacheState.cat`) and decodes them as
one batch. Since a row restarts exactly where a cold run would be after the same calls, its tokens are
those of a cold run of that prompt alone (bitwise for a batch of one).

The store is bounded by bytes with LRU eviction, in memory and, with `directory`, on disk as well
(the same bound; files are `CacheState` safetensors files, checked on load, nothing unpickled).

On disk, each entry proves its key: its metadata holds the key and the number of tokens it covers,
compared with the request (a file copied over another key's name is a corrupt entry: warned about,
removed and recomputed). Files are written through `litkv.atomic` (complete or absent, whatever
other processes sharing the directory do); an entry another process removed is a miss; a directory
removed while in use is created again; a store that cannot write warns once and keeps serving from
memory. Temporary files of interrupted writes are removed when the store opens; those of writers
still running count towards the byte bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from litkv.atomic import remove_stale_temp_files, temp_files
from litkv.config import KVCacheConfig
from litkv.model import GPT, kv_cache_configs
from litkv.runner import ChunkPlan
from litkv.state import CacheState, StateLRU, model_fingerprint, restore, snapshot

__all__ = ["PrefixCache"]

log = logging.getLogger(__name__)
_SUFFIX = ".safetensors"
#: Safetensors metadata key of an entry's proof of its key: `{"key": ..., "tokens": ...}` as JSON.
_PROOF = "litkv_prefix"


class PrefixCache:
    """Token-prefix blocks -> cache state after them, bounded by bytes (LRU), optionally kept on disk.

    Args:
        max_bytes: most bytes of states kept in memory (and on disk, with `directory`).
        directory: where states are also written, to be found again by later runs (created if needed).

    Attributes:
        hits, misses: prompts (rows) that found / did not find a stored prefix.
        reused_tokens: prompt tokens restored instead of computed.
    """

    def __init__(self, max_bytes: int, directory: str | Path | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            if self.directory.exists() and not self.directory.is_dir():
                raise NotADirectoryError(f"prefix cache directory {str(self.directory)!r} is a file")
            self.directory.mkdir(parents=True, exist_ok=True)
            removed = remove_stale_temp_files(self.directory, depth=0, quiet=True)
            if removed:
                log.warning("prefix cache: removed %d temporary file(s) of interrupted writes", len(removed))
        self._memory = StateLRU(self.max_bytes)
        self._write_failed = False
        self.hits = self.misses = self.reused_tokens = 0

    # -- storage --------------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes of the states held in memory."""
        return self._memory.nbytes

    def disk_bytes(self) -> int:
        """Bytes of the state files in `directory` and of temporary files of writes in progress (0 without one)."""
        return sum(size for _, size, _ in self._sized(self._files() + self._temps()))

    def __len__(self) -> int:
        return len(self._memory)

    def clear(self) -> None:
        """Forget the states held in memory (files on disk stay)."""
        self._memory.clear()

    def get(self, key: str, tokens: int | None = None) -> CacheState | None:
        """The state stored under `key` (memory first, then disk), marked most recently used.

        `tokens`: how many tokens the entry must cover. A file whose proof (key, tokens) does not match
        is corrupt: warned about, removed and a miss; so is a file that cannot be read. A file that
        another process removed meanwhile is a plain miss.
        """
        state = self._memory.get(key)
        if state is not None:
            return state
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            state = CacheState.load(path)
            self._check_proof(path, key, tokens, state)
        except (ValueError, OSError) as err:  # a corrupt file is dropped (and rewritten), not fatal
            if not path.exists():  # removed by another process (or with the directory) meanwhile: a miss
                return None
            log.warning("prefix cache: ignoring and removing %s: %s", path, err)
            path.unlink(missing_ok=True)
            return None
        with contextlib.suppress(OSError):  # removed by another process meanwhile; the state read is complete
            os.utime(path)
        self._keep(key, state, write=False)
        return state

    @staticmethod
    def _check_proof(path: Path, key: str, tokens: int | None, state: CacheState) -> None:
        """ValueError unless the file's proof names `key` and `tokens` and the state covers `tokens`."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            raw = (f.metadata() or {}).get(_PROOF)
        try:
            proof = json.loads(raw) if raw is not None else None
        except json.JSONDecodeError:
            proof = None
        if not isinstance(proof, dict) or proof.get("key") != key:
            raise ValueError(f"the entry does not prove key {key[:16]}...: it holds {str(proof)[:120]}")
        if tokens is not None and proof.get("tokens") != tokens:
            raise ValueError(f"the entry covers {proof.get('tokens')} tokens, expected {tokens}")
        if tokens is not None and state.last_pos is not None and int(state.last_pos.max()) != tokens - 1:
            raise ValueError(f"the state's last position is {int(state.last_pos.max())}, expected {tokens - 1}")

    def put(self, key: str, state: CacheState, tokens: int | None = None) -> None:
        """Store `state` under `key` (in memory, and on disk with a directory), evicting the least recent.

        `tokens`: how many tokens the state covers (recorded in the file with the key, checked by `get`).
        """
        if self._memory.get(key) is not None:  # marked most recently used
            return
        self._keep(key, state, write=True, tokens=tokens)

    def _keep(self, key: str, state: CacheState, write: bool, tokens: int | None = None) -> None:
        if not self._memory.put(key, state):  # larger than the memory: neither kept nor written
            return
        path = self._path(key)
        if write and path is not None and not self._write_failed and not path.exists():
            proof = json.dumps({"key": key, "tokens": tokens})
            try:
                state.save(path, extra_metadata={_PROOF: proof})
            except FileNotFoundError as err:  # another process removed our temporary file: skip this one
                log.info("prefix cache: %s not written: %s", path, err)
                return
            except OSError as err:  # no space, no permission, read-only, not a directory: memory only
                self._write_failed = True
                warnings.warn(
                    f"prefix cache: cannot write to {str(self.directory)!r} ({err}); going on in memory only",
                    stacklevel=3,
                )
                return
            self._trim_disk()

    def _path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}{_SUFFIX}"

    def _files(self) -> list[Path]:
        if self.directory is None:
            return []
        try:
            entries = list(self.directory.iterdir())
        except (FileNotFoundError, NotADirectoryError):  # removed while in use: recreated by the next write
            return []
        return [f for f in entries if f.name.endswith(_SUFFIX) and not f.name.startswith(".")]

    def _temps(self) -> list[Path]:
        return [] if self.directory is None else temp_files(self.directory)

    @staticmethod
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

    def _trim_disk(self) -> None:
        """Remove the least recently used files until the files and writes in progress fit `max_bytes`."""
        files = sorted(self._sized(self._files()), key=lambda x: x[0])
        total = sum(size for _, size, _ in files) + sum(size for _, size, _ in self._sized(self._temps()))
        for _, size, f in files:
            if total <= self.max_bytes:
                break
            f.unlink(missing_ok=True)
            total -= size

    # -- keys -----------------------------------------------------------------------------------

    @staticmethod
    def namespace(model: GPT, configs: Sequence[KVCacheConfig], dtype: torch.dtype) -> str:
        """Seed of the hash chains: the model's fingerprint, the per-layer cache configs and the dtype."""
        seed = {
            "model": model_fingerprint(model),
            "configs": [dataclasses.asdict(c) for c in configs],
            "dtype": str(dtype),
        }
        return hashlib.sha256(json.dumps(seed, sort_keys=True, default=str).encode()).hexdigest()

    @staticmethod
    def block_keys(seed: str, ids: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> list[str]:
        """`key_k` for each block `(start, end)` of `ids` `(n,)`: the hash chain over the blocks' ids."""
        keys, key = [], seed
        host = ids.detach().to("cpu", torch.int64)
        for s, e in bounds:
            key = hashlib.sha256(key.encode() + host[s:e].numpy().tobytes()).hexdigest()
            keys.append(key)
        return keys

    # -- generation -----------------------------------------------------------------------------

    def prefill(
        self,
        model: GPT,
        prompts: Sequence[torch.Tensor],
        kv_cache: KVCacheConfig | Sequence[KVCacheConfig],
        progress: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill each prompt alone from its longest stored prefix, store the new blocks, merge the rows.

        The model must have caches for `len(prompts)` rows attached (as in `generate`); they end up
        holding the merged state.

        Args:
            model: the GPT.
            prompts: 1-D token id tensors (not padded).
            kv_cache: the cache config (one, or one per layer) of the attached caches.
            progress: show a progress bar over the rows.

        Returns:
            hidden `(B, 1, n_embd)` of each prompt's last token and `next_pos` `(B,)` (the prompt lengths).
        """
        batch_caches = model.caches
        configs = kv_cache_configs(kv_cache) or [kv_cache] * model.config.n_layer
        dtype = batch_caches[0].dtype
        seed = self.namespace(model, configs, dtype)
        states = []
        for ids in tqdm(prompts, desc="prefill", unit="prompt", disable=not progress or len(prompts) < 2):
            states.append(self._prefill_row(model, ids, kv_cache, seed))
        merged = CacheState.cat(states)
        model.set_kv_caches(batch_caches)
        restore(model, merged)
        hidden = merged.last_hidden
        device = model.lm_head.weight.device
        next_pos = torch.tensor([ids.numel() for ids in prompts], dtype=torch.long, device=device)
        return hidden[:, None, :].to(device), next_pos

    def _prefill_row(
        self, model: GPT, ids: torch.Tensor, kv_cache: KVCacheConfig | Sequence[KVCacheConfig], seed: str
    ) -> CacheState:
        """One prompt alone (batch of one): restore the longest stored prefix, run and store the rest."""
        device = model.lm_head.weight.device
        ids = ids.to(device=device, dtype=torch.long)
        plan = ChunkPlan.of(kv_cache)
        bounds = plan.bounds(ids.numel())
        sizes = [plan.first] + [plan.size] * (len(bounds) - 1)
        full = [(s, e) for (s, e), size in zip(bounds, sizes, strict=True) if e - s == size]
        keys = self.block_keys(seed, ids, full)
        start, hidden = 0, None
        for k in range(len(keys) - 1, -1, -1):
            state = self.get(keys[k], full[k][1])
            if state is not None:
                restore(model, state)
                start, hidden = full[k][1], state.last_hidden
                self.hits += 1
                self.reused_tokens += start
                break
        else:
            self.misses += 1
            model.set_kv_caches(model.build_kv_caches(kv_cache, 1))
        for i, (s, e) in enumerate(bounds):
            if s < start:
                continue
            pos = torch.arange(s, e, device=device)[None]
            hidden = model(ids[None, s:e], pos, lm_head=False)[:, -1]
            if i < len(keys):
                state = snapshot(model)
                state.last_hidden = hidden.clone()
                self.put(keys[i], state, tokens=e)
        state = snapshot(model)
        state.last_hidden = hidden.clone()
        return state
