"""Prefix reuse: a store of cache states keyed by the token ids they cover, in blocks of the chunk size.

A prompt is cut as the prefill cuts it (`ChunkPlan`: the first chunk, then `chunk_size`); the state
after each full block is stored under a hash chain `key_k = sha256(key_{k-1} || block_k ids)` whose
seed is the model's fingerprint and the cache configs. `generate(..., prefix_cache=store)` prefills
each row alone from the longest stored prefix of its prompt (rows of a batch may match different
lengths), stores the blocks it computes, then merges the rows (`CacheState.cat`) and decodes them as
one batch. Since a row restarts exactly where a cold run would be after the same calls, its tokens are
those of a cold run of that prompt alone (bitwise for a batch of one).

The store is `litkv.states.state_store.StateStore` (memory LRU and, with `directory`, files, both bounded by
`max_bytes`): each entry proves its key (the hash chain, the tokens it covers) and the caller's model
and caches (an `EntryCheck`) before it is restored; a store that cannot write goes on in memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT, kv_cache_configs
from litkv.states.state import CacheState, restore, snapshot
from litkv.states.state_store import EntryCheck, StateStore

__all__ = ["PrefixCache"]


class PrefixCache:
    """Token-prefix blocks -> cache state after them, bounded by bytes (LRU), optionally kept on disk.

    Args:
        max_bytes: most bytes of states kept in memory (and on disk, with `directory`).
        directory: where states are also written, to be found again by later runs (created if needed).
        key: the secret that authenticates the directory's files (default: the user's secret,
            `litkv.core.secret.user_secret`); a file the store's key did not sign is never restored.

    Attributes:
        hits, misses: prompts (rows) that found / did not find a stored prefix.
        reused_tokens: prompt tokens restored instead of computed.
    """

    def __init__(self, max_bytes: int, directory: str | Path | None = None, key: bytes | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._store = StateStore(max_bytes, directory, name="prefix cache", key=key)
        self.directory = self._store.directory
        self.hits = self.misses = self.reused_tokens = 0

    # -- storage --------------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes of the states held in memory."""
        return self._store.nbytes

    def disk_bytes(self) -> int:
        """Bytes of the state files in `directory` and of temporary files of writes in progress (0 without one)."""
        return self._store.disk_bytes()

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        """Forget the states held in memory (files on disk stay)."""
        self._store.clear()

    def get(
        self,
        key: str,
        tokens: int | None = None,
        check: EntryCheck | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> CacheState | None:
        """The state stored under `key` (memory first, then disk), marked most recently used.

        `tokens`: how many tokens the entry must cover; `token_ids`: the ids it must have been taken over;
        `check`: the model and caches it must fit. A file that does not prove its key, covers other
        tokens, fails `check` or cannot be read is warned about, removed and a miss; a file that another
        process removed meanwhile is a plain miss.
        """
        return self._store.get(key, check, tokens, token_ids)

    def put(
        self, key: str, state: CacheState, tokens: int | None = None, token_ids: torch.Tensor | None = None
    ) -> None:
        """Store `state` under `key` (in memory, and on disk with a directory), evicting the least recent.

        `tokens`, `token_ids`: how many tokens the state covers and their ids (recorded in the file's
        checksummed entry with the key, checked by `get`).
        """
        if key in self._store.memory:
            self._store.memory.get(key)  # marked most recently used
            return
        self._store.put(key, state, tokens, token_ids)

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
        check = EntryCheck.of(model, configs, dtype)
        states = []
        for ids in tqdm(prompts, desc="prefill", unit="prompt", disable=not progress or len(prompts) < 2):
            states.append(self._prefill_row(model, ids, kv_cache, seed, check))
        merged = CacheState.cat(states)
        model.set_kv_caches(batch_caches)
        restore(model, merged)
        hidden = merged.last_hidden
        device = model.lm_head.weight.device
        next_pos = torch.tensor([ids.numel() for ids in prompts], dtype=torch.long, device=device)
        return hidden[:, None, :].to(device), next_pos

    def _prefill_row(
        self,
        model: GPT,
        ids: torch.Tensor,
        kv_cache: KVCacheConfig | Sequence[KVCacheConfig],
        seed: str,
        check: EntryCheck,
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
            state = self.get(keys[k], full[k][1], check, ids[: full[k][1]])
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
                self.put(keys[i], state, tokens=e, token_ids=ids[:e])
        state = snapshot(model)
        state.last_hidden = hidden.clone()
        return state
