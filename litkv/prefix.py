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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from litkv.config import KVCacheConfig
from litkv.model import GPT, kv_cache_configs
from litkv.runner import ChunkPlan
from litkv.state import CacheState, model_fingerprint, restore, snapshot

__all__ = ["PrefixCache"]

log = logging.getLogger(__name__)
_SUFFIX = ".safetensors"


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
        self._memory: OrderedDict[str, CacheState] = OrderedDict()
        self._memory_bytes = 0
        self.hits = self.misses = self.reused_tokens = 0

    # -- storage --------------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes of the states held in memory."""
        return self._memory_bytes

    def disk_bytes(self) -> int:
        """Bytes of the state files in `directory` (0 without one)."""
        return sum(f.stat().st_size for f in self._files())

    def __len__(self) -> int:
        return len(self._memory)

    def clear(self) -> None:
        """Forget the states held in memory (files on disk stay)."""
        self._memory.clear()
        self._memory_bytes = 0

    def get(self, key: str) -> CacheState | None:
        """The state stored under `key` (memory first, then disk), marked most recently used."""
        state = self._memory.get(key)
        if state is not None:
            self._memory.move_to_end(key)
            return state
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            state = CacheState.load(path)
        except (ValueError, OSError) as err:  # a corrupt file is dropped (and rewritten), not fatal
            log.warning("prefix cache: ignoring and removing %s: %s", path, err)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)
        self._keep(key, state, write=False)
        return state

    def put(self, key: str, state: CacheState) -> None:
        """Store `state` under `key` (in memory, and on disk with a directory), evicting the least recent."""
        if key in self._memory:
            self._memory.move_to_end(key)
            return
        self._keep(key, state, write=True)

    def _keep(self, key: str, state: CacheState, write: bool) -> None:
        size = state.nbytes()
        if size > self.max_bytes:
            return
        self._memory[key] = state
        self._memory_bytes += size
        while self._memory_bytes > self.max_bytes:
            _, old = self._memory.popitem(last=False)
            self._memory_bytes -= old.nbytes()
        path = self._path(key)
        if write and path is not None and not path.exists():
            state.save(path)
            self._trim_disk()

    def _path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}{_SUFFIX}"

    def _files(self) -> list[Path]:
        if self.directory is None:
            return []
        return [f for f in self.directory.iterdir() if f.name.endswith(_SUFFIX) and f.is_file()]

    def _trim_disk(self) -> None:
        files = sorted(((f.stat().st_mtime, f.stat().st_size, f) for f in self._files()), key=lambda x: x[0])
        total = sum(size for _, size, _ in files)
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
            state = self.get(keys[k])
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
                self.put(keys[i], state)
        state = snapshot(model)
        state.last_hidden = hidden.clone()
        return state
