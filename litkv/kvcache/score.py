"""`ScoreKVCache`: the base of score-based eviction policies (H2O, Q-Hitter, TOVA, ...).

A policy implements `score()` only: one number per candidate (the `L` cached tokens and the `T` new
ones of the call), the lowest are evicted. The base class does the rest, per (batch row, KV head):

- empty slots and pad tokens (position `-1`) go first;
- the `sinks` first tokens (positions `< sinks`) and the `recent` newest tokens are never evicted;
- among the others, the `T` lowest-scored candidates lose their slot (top-k);
- it keeps per-slot state across calls, updated once the call's tokens are in their slots
  (`after_write`): the attention each token has accumulated since it entered the cache
  (`attn_sums`, for policies that need attention weights) and, with `normalize_scores`, the number
  of queries that could attend to it (`query_counts`). `accumulated()` and `counts()` give them for
  the candidates of the current call, this call included.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F

from litkv.config import KVCacheConfig
from litkv.kvcache.base import KVCache, pair_drops
from litkv.kvcache.storage import CacheShape

__all__ = ["ScoreKVCache", "query_counts"]


def query_counts(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """How many of a call's queries can attend to each key (causally, by position).

    Args:
        query_pos: `(B, T)` query positions, `-1` for padding.
        key_pos: `(B, G, N)` key positions, `-1` for empty slots and padding.

    Returns:
        `(B, G, N)` float32: the number of non-pad queries with position `>=` the key's (0 for `-1` keys).
    """
    b, g, n = key_pos.shape
    sorted_q = torch.sort(query_pos, dim=1).values
    below = torch.searchsorted(sorted_q, key_pos.reshape(b, g * n)).view(b, g, n)
    counts = (query_pos.shape[1] - below).to(torch.float32)
    return counts.masked_fill(key_pos < 0, 0.0)


class ScoreKVCache(KVCache):
    """Evicts, per (row, KV head), the candidates with the lowest `score()`; keeps sinks and recent tokens.

    Attributes:
        attn_sums: `(B, G, L)` float32, attention accumulated by each slot's token since it entered the
            cache (weights summed over queries and the group's query heads); kept only when the class
            sets `needs_attn_weights`.
        query_counts: `(B, G, L)` float32, the number of queries that could attend to each slot's token
            since it entered the cache; kept only with `config.normalize_scores`.
    """

    def __init__(
        self, config: KVCacheConfig, shape: CacheShape, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        super().__init__(config, shape, device, dtype)
        size = (shape.batch_size, shape.n_query_groups, shape.cache_length)
        self.attn_sums = torch.zeros(size, dtype=torch.float32, device=device)
        self.query_counts = torch.zeros(size, dtype=torch.float32, device=device)
        self.recent = config.recent_length
        self.sinks = config.sinks
        self._query_pos: torch.Tensor | None = None
        self._drop: torch.Tensor | None = None

    @abstractmethod
    def score(self, positions: torch.Tensor, attn_weights: torch.Tensor | None) -> torch.Tensor:
        """Score of each candidate of this call; the lowest are evicted.

        Args:
            positions: `(B, G, L + T)` token positions of the candidates: the `L` slots, then the `T` new
                tokens; `-1` for empty slots and pads (their score is ignored).
            attn_weights: `(B, G, L + T)` float32 attention weights of this call, or `None` when the
                class does not set `needs_attn_weights`.

        Returns:
            `(B, G, L + T)` scores (any float dtype).
        """

    # -- helpers for score() --------------------------------------------------------------------

    def accumulated(self, attn_weights: torch.Tensor) -> torch.Tensor:
        """`(B, G, L + T)` attention accumulated by each candidate since it entered the cache, this call
        included (`attn_weights`: `(B, G, L + T)`, the call's weights)."""
        return F.pad(self.attn_sums, (0, attn_weights.shape[2] - self.cache_length)) + attn_weights

    def counts(self, positions: torch.Tensor) -> torch.Tensor:
        """`(B, G, L + T)` number of queries that could attend to each candidate since it entered the
        cache, this call included. Needs `config.normalize_scores` (otherwise no counts are kept)."""
        if not self.config.normalize_scores:
            raise RuntimeError("query counts are only kept with KVCacheConfig(normalize_scores=True)")
        previous = F.pad(self.query_counts, (0, positions.shape[2] - self.cache_length))
        return previous + query_counts(self._call_query_pos(), positions)

    def new_to_slots(self, slot_values: torch.Tensor, new_values: torch.Tensor) -> torch.Tensor:
        """In `after_write`: per-slot state where each slot that took a new token gets that token's value.

        Args:
            slot_values: `(B, G, L)` state of the slots before this call.
            new_values: `(B, G, T)` state of this call's new tokens.

        Returns:
            `(B, G, L)` state of the slots after this call's writes.
        """
        t = new_values.shape[2]
        if self._drop is None:  # the cache was filling: new token j went into slot `start + j`
            start = self.num_filled - t
            return torch.cat((slot_values[..., :start], new_values, slot_values[..., start + t :]), dim=2)
        dest, src, valid = pair_drops(self._drop, self.cache_length)
        moved = torch.where(valid, new_values.gather(2, src), slot_values.gather(2, dest))
        return slot_values.scatter(2, dest, moved)

    # -- KVCache hooks --------------------------------------------------------------------------

    def attend_inputs(
        self, keys: torch.Tensor, values: torch.Tensor, input_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `KVCache.attend_inputs`; also remembers the call's query positions `(B, T)`."""
        out = super().attend_inputs(keys, values, input_pos)
        self._query_pos = input_pos
        self._drop = None
        return out

    def drops_valid_by_construction(self) -> bool:
        """Its own `select_drop` (not an override) gives distinct in-range indices."""
        return type(self).select_drop is ScoreKVCache.select_drop

    def select_drop(self, positions: torch.Tensor, attn_weights: torch.Tensor | None) -> torch.Tensor:
        """The `T` lowest-ranked candidates: pads and empty slots, then the lowest scores outside the
        sinks and the recent window."""
        t = positions.shape[2] - self.cache_length
        scores = self.score(positions, attn_weights).to(torch.float32)
        protected = self._protected(positions)
        if protected is not None:
            scores = scores.masked_fill(protected, float("inf"))
        rank = scores.masked_fill(positions < 0, float("-inf"))
        drop = torch.topk(rank, t, dim=2, largest=False, sorted=False).indices
        self._drop = drop
        return drop

    def after_write(self, replaced: torch.Tensor, slot_weights: torch.Tensor | None) -> None:
        """Update `attn_sums` and `query_counts`: reset for new tokens, then add this call's share.

        Empty slots stay at zero: their weights are zero, and a slot never becomes empty again.
        """
        if self.needs_attn_weights and slot_weights is not None:
            self.attn_sums = self.attn_sums.masked_fill(replaced, 0.0) + slot_weights
        if self.config.normalize_scores:
            counts = self.query_counts.masked_fill(replaced, 0.0)
            self.query_counts = counts + query_counts(self._call_query_pos(), self.positions)

    # -- internals ------------------------------------------------------------------------------

    def _protected(self, positions: torch.Tensor) -> torch.Tensor | None:
        """`(B, G, N)` bool: sinks and the `recent` newest candidates (by position) of each row and head.

        Pads and empty slots may be marked too (when a row has fewer than `recent` tokens); the
        caller ranks them first anyway. `None` when nothing is protected.
        """
        protected = None
        if self.recent > 0:
            n = positions.shape[2]
            kth = torch.kthvalue(positions, n - self.recent + 1, dim=2, keepdim=True).values
            protected = positions >= kth
        if self.sinks > 0:
            sinks = positions < self.sinks
            protected = sinks if protected is None else protected | sinks
        return protected

    def _call_query_pos(self) -> torch.Tensor:
        if self._query_pos is None:
            raise RuntimeError("query positions are only known during a call (after attend_inputs)")
        return self._query_pos
