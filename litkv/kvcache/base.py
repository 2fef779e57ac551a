"""The `KVCache` contract: one object per attention layer, `cache_length` slots per (row, KV head).

A call brings `T` new tokens per row. Attention runs in two steps around the cache:

1. `attend_inputs(keys, values, input_pos)` returns what the new queries attend to: every cached
   token plus the new tokens themselves, with the token position of each (`-1`: empty slot or pad).
2. `update(attn_weights)` runs after attention: the policy decides which of the `cache_length + T`
   candidates keep the `cache_length` slots (attend, then evict).

A policy implements `select_drop()` only (which `T` candidates lose their slot); the base class does
the bookkeeping: checks, the fast path while the cache fills, pairing freed slots with surviving new
tokens, and writing into the storage it is composed with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from litkv.config import KVCacheConfig
from litkv.kvcache.storage import CacheShape, KVStorage, make_storage

__all__ = ["KVCache", "CacheShape", "pair_drops"]


@dataclass
class _Pending:
    """What `attend_inputs` leaves for `update`."""

    direct: bool
    start: int
    keys: torch.Tensor  # (B, G, T, key_size)
    values: torch.Tensor  # (B, G, T, value_size)
    positions: torch.Tensor  # (B, G, L + T) candidates, or (B, G, start + T) on the direct path


def pair_drops(drop: torch.Tensor, cache_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair the slots freed by `drop` with the new tokens that survive.

    Args:
        drop: `(B, G, T)` distinct indices into the `L + T` candidates (slots first, then new tokens).
        cache_length: `L`.

    Returns:
        `dest` `(B, G, T)` slot indices, `src` `(B, G, T)` new-token indices, `valid` `(B, G, T)` bool:
        new token `src[j]` goes into slot `dest[j]` where `valid[j]`.
    """
    b, g, t = drop.shape
    if t == 1:  # decode step: the dropped slot takes the new token, unless the new token is dropped
        return drop.clamp(max=cache_length - 1), torch.zeros_like(drop), drop < cache_length
    is_drop = torch.zeros(b, g, cache_length + t, dtype=torch.bool, device=drop.device)
    is_drop.scatter_(2, drop, True)
    freed = is_drop[..., :cache_length].to(torch.int8)
    kept_new = (~is_drop[..., cache_length:]).to(torch.int8)
    dest = torch.sort(freed, dim=2, descending=True, stable=True).indices[..., :t]
    src = torch.sort(kept_new, dim=2, descending=True, stable=True).indices
    valid = torch.arange(t, device=drop.device) < kept_new.sum(dim=2, keepdim=True)
    return dest, src, valid


class KVCache(ABC):
    """Base class of all cache policies. Subclasses implement `select_drop`.

    Attributes:
        needs_attn_weights: Whether `select_drop` needs the attention weights summed over the call's
            queries and each KV group's query heads, `(B, G, L + T)` float32.
        heads_share_positions: Whether every KV head of a row always holds the same tokens in the same
            slots (true for policies that do not look at keys or attention); attention then builds one
            mask per row instead of one per head.
        positions: `(B, G, L)` int64, token position held by each slot, `-1` when empty.
        num_filled: Host counter of tokens taken so far, capped at `L`. While the storage is lossless and
            no eviction has happened, slots `[num_filled, L)` are empty (the fast path relies on it);
            after an eviction or with quantised storage, empty slots can be anywhere.
    """

    needs_attn_weights: ClassVar[bool] = False
    heads_share_positions: ClassVar[bool] = False

    def __init__(
        self, config: KVCacheConfig, shape: CacheShape, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        if shape.cache_length != config.cache_length:
            raise ValueError(f"shape.cache_length={shape.cache_length} != config.cache_length={config.cache_length}")
        self.config = config
        self.shape = shape
        self.cache_length = config.cache_length
        self.dtype = dtype
        self.storage: KVStorage = make_storage(config.storage, shape, device, dtype, config.quant_group_size)
        self.positions = torch.full(
            (shape.batch_size, shape.n_query_groups, shape.cache_length), -1, dtype=torch.long, device=device
        )
        self.num_filled = 0
        self._pending: _Pending | None = None

    # -- policy ---------------------------------------------------------------------------------

    @abstractmethod
    def select_drop(self, positions: torch.Tensor, attn_weights: torch.Tensor | None) -> torch.Tensor:
        """Choose which `T` of the `L + T` candidates lose their slot.

        Args:
            positions: `(B, G, L + T)` token positions of the candidates: the `L` slots, then the `T`
                new tokens; `-1` for empty slots and pad tokens (drop those first).
            attn_weights: `(B, G, L + T)` float32 attention weights of this call, or `None` when the
                class does not need them.

        Returns:
            `(B, G, T)` int64 distinct candidate indices to drop.
        """

    def check_room(self, num_new: int) -> None:
        """Raise before attention if `num_new` tokens cannot be taken (the dense cache overrides)."""

    def after_write(self, replaced: torch.Tensor, slot_weights: torch.Tensor | None) -> None:
        """Hook for per-slot policy state, called once the call's tokens are in their slots.

        Args:
            replaced: `(B, G, L)` bool, slots that received a new token in this call.
            slot_weights: `(B, G, L)` float32 attention weights this call gave to the token now in each
                slot (zero for empty slots), or `None` when weights were not computed.
        """

    # -- contract -------------------------------------------------------------------------------

    def attend_inputs(
        self, keys: torch.Tensor, values: torch.Tensor, input_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the new queries attend to: cached tokens plus the new ones.

        Args:
            keys: `(B, G, T, key_size)` new keys (after RoPE).
            values: `(B, G, T, value_size)` new values.
            input_pos: `(B, T)` int64 token positions, `-1` for padding.

        Returns:
            keys `(B, G, S, key_size)`, values `(B, G, S, value_size)`, positions `(B, G, S)`.
        """
        self._check_inputs(keys, values, input_pos)
        b, g, t = keys.shape[:3]
        new_pos = input_pos[:, None, :].expand(b, g, t)
        start = self.num_filled
        if self.storage.lossless and start + t <= self.cache_length:
            self.storage.write_range(start, keys, values)
            self.positions[:, :, start : start + t] = new_pos
            self.num_filled = start + t
            self._pending = _Pending(True, start, keys, values, self.positions[:, :, : start + t])
            all_keys, all_values = self.storage.read_prefix(start + t)
            return all_keys, all_values, self._pending.positions
        self.check_room(t)
        old_keys, old_values = self.storage.read()
        seen_keys, seen_values = self.storage.as_stored(keys, values)
        candidates = torch.cat((self.positions, new_pos), dim=2)
        self._pending = _Pending(False, start, keys, values, candidates)
        return torch.cat((old_keys, seen_keys), dim=2), torch.cat((old_values, seen_values), dim=2), candidates

    def update(self, attn_weights: torch.Tensor | None) -> None:
        """Evict and write, after the call's queries have attended (`attn_weights`: `(B, G, S)`)."""
        pending = self._pending
        if pending is None:
            raise RuntimeError("KVCache.update() called without a preceding attend_inputs()")
        self._pending = None
        if self.needs_attn_weights and attn_weights is None:
            raise ValueError(f"{type(self).__name__} needs attention weights, got None")
        length, t = self.cache_length, pending.keys.shape[2]
        if pending.direct:
            replaced = torch.zeros_like(self.positions, dtype=torch.bool)
            replaced[:, :, pending.start : pending.start + t] = True
            slot_weights = None
            if attn_weights is not None:
                slot_weights = F.pad(attn_weights, (0, length - attn_weights.shape[2]))
            self.after_write(replaced, slot_weights)
            return
        drop = self.select_drop(pending.positions, attn_weights)
        self._check_drop(drop, t)
        dest, src, valid = pair_drops(drop, length)
        keys = _gather_tokens(pending.keys, src)
        values = _gather_tokens(pending.values, src)
        self.storage.write(dest, keys, values, valid)
        new_pos = pending.positions[..., length:].gather(2, src)
        self.positions.scatter_(2, dest, torch.where(valid, new_pos, self.positions.gather(2, dest)))
        self.num_filled = min(length, self.num_filled + t)
        replaced = torch.zeros_like(self.positions, dtype=torch.bool).scatter_(2, dest, valid)
        slot_weights = None
        if attn_weights is not None:
            new_w = attn_weights[..., length:].gather(2, src)
            slot_weights = attn_weights[..., :length].masked_fill(replaced, 0.0)
            slot_weights = slot_weights.scatter_add(2, dest, new_w * valid)
            slot_weights = slot_weights.masked_fill(self.positions < 0, 0.0)
        self.after_write(replaced, slot_weights)

    def nbytes(self) -> int:
        """Bytes held by the keys and values (scales and offsets included for quantised storage)."""
        return self.storage.nbytes()

    def drops_valid_by_construction(self) -> bool:
        """Whether `select_drop` returns valid indices by construction, so that `update` need not check
        their values (one host sync per call). Built-in policies override; a custom policy is checked."""
        return False

    def _check_drop(self, drop: object, t: int) -> None:
        """Raise naming the policy if `drop` is not `(B, G, T)` int64 distinct indices in `[0, L + T)`."""
        name = type(self).__name__
        expected = (*self.positions.shape[:2], t)
        if not isinstance(drop, torch.Tensor) or drop.dtype != torch.int64:
            got = drop.dtype if isinstance(drop, torch.Tensor) else type(drop).__name__
            raise TypeError(f"{name}.select_drop must return an int64 tensor, got {got}")
        if tuple(drop.shape) != expected:
            raise ValueError(f"{name}.select_drop must return shape {expected} (B, G, T), got {tuple(drop.shape)}")
        if self.drops_valid_by_construction():
            return
        n = self.cache_length + t
        ordered = torch.sort(drop, dim=2).values
        out_of_range = (ordered[..., 0] < 0) | (ordered[..., -1] >= n)
        repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=2)
        if bool((out_of_range | repeated).any()):
            row, head = (out_of_range | repeated).nonzero()[0].tolist()
            raise ValueError(
                f"{name}.select_drop must return {t} distinct candidate indices in [0, {n}) per (row, KV head); "
                f"row {row}, head {head} got {drop[row, head].tolist()}"
            )

    def _check_inputs(self, keys: torch.Tensor, values: torch.Tensor, input_pos: torch.Tensor) -> None:
        s = self.shape
        if self._pending is not None:
            raise RuntimeError("attend_inputs() called twice without update() in between")
        for name, tensor, size in (("keys", keys, s.key_size), ("values", values, s.value_size)):
            if tensor.dtype != self.dtype:
                raise ValueError(f"{name} have dtype {tensor.dtype}, but the cache holds {self.dtype}")
            if tensor.dim() != 4:
                raise ValueError(f"{name} must be 4-D (B, G, T, head_size), got shape {tuple(tensor.shape)}")
            if tensor.shape[0] != s.batch_size:
                raise ValueError(
                    f"batch size changed mid-sequence: the cache was built for batch size "
                    f"{s.batch_size}, got {name} with batch size {tensor.shape[0]}"
                )
            expected = (s.batch_size, s.n_query_groups, keys.shape[2], size)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
        t = keys.shape[2]
        if tuple(input_pos.shape) != (s.batch_size, t):
            raise ValueError(f"input_pos must have shape {(s.batch_size, t)}, got {tuple(input_pos.shape)}")
        if t == 0:
            raise ValueError("a call must bring at least one new token, got T=0")
        if t > self.cache_length:
            raise ValueError(
                f"chunk of {t} tokens is longer than allowed: at most cache_length={self.cache_length} "
                "new tokens per call"
            )


def _gather_tokens(tokens: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`tokens` `(B, G, T, D)` gathered along T by `src` `(B, G, T')` -> `(B, G, T', D)`."""
    index = src[..., None].expand(*src.shape, tokens.shape[-1])
    return tokens.gather(2, index)
