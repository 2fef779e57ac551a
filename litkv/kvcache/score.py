"""`ScoreKVCache`: the base of score-based eviction policies (H2O, TOVA, SnapKV, KeyDiff, ...).

A policy implements `score(candidates)` only: one number per candidate (the `L` cached tokens and the
`T` new ones of the call), the lowest are evicted. The base class does the rest, per (batch row, KV
head):

- empty slots and pad tokens (position `-1`) go first;
- the `sinks` first tokens (positions `< sinks`) and the `recent` newest tokens are never evicted
  (options of every score policy, `ScoreOptions`);
- among the others, the `T` lowest-scored candidates lose their slot (top-k).

Per-slot state of a policy (H2O's accumulated attention, say) is kept by the policy itself: build it
per candidate in `score` or `after_write` and carry it into the slots with `placement.carry`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from litkv.kvcache.base import Candidates, KVCache, drop_lowest
from litkv.kvcache.options import PolicyOptions, ScoreOptions
from litkv.kvcache.storage import CacheShape

if TYPE_CHECKING:
    from litkv.config import KVCacheConfig

__all__ = ["ScoreKVCache"]


class ScoreKVCache(KVCache):
    """Evicts, per (row, KV head), the candidates with the lowest `score()`; keeps sinks and recent tokens."""

    Options: ClassVar[type[PolicyOptions]] = ScoreOptions

    def __init__(
        self, config: KVCacheConfig, shape: CacheShape, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        super().__init__(config, shape, device, dtype)
        if not isinstance(self.options, ScoreOptions):
            raise TypeError(f"{type(self).__name__}.Options must subclass ScoreOptions, got {type(self.options)}")
        self.sinks = self.options.sinks
        self.recent = self.options.recent_length(self.cache_length)

    @abstractmethod
    def score(self, candidates: Candidates) -> torch.Tensor:
        """Score of each candidate of this call; the lowest are evicted.

        Args:
            candidates: the call's record (positions `(B, G, L + T)`, keys, values, and what the class
                asked for). Scores of empty slots and pads (position `-1`) are ignored.

        Returns:
            `(B, G, L + T)` scores (any float dtype).
        """

    def drops_valid_by_construction(self) -> bool:
        """Its own `select_drop` (a top-k, unless overridden) gives distinct in-range indices."""
        return type(self).select_drop is ScoreKVCache.select_drop

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        """The `T` lowest-ranked candidates: pads and empty slots, then the lowest scores outside the
        sinks and the recent window."""
        positions = candidates.positions
        scores = self.score(candidates)
        expected = tuple(positions.shape)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected:
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"{type(self).__name__}.score must return shape {expected} (B, G, L + T), got {got}")
        scores = scores.to(torch.float32)
        protected = self._protected(positions)
        if protected is not None:
            scores = scores.masked_fill(protected, float("inf"))
        rank = scores.masked_fill(positions < 0, float("-inf"))
        return drop_lowest(rank, positions, candidates.num_new)

    def _protected(self, positions: torch.Tensor) -> torch.Tensor | None:
        """`(B, G, N)` bool: sinks and the `recent` newest candidates (by position) of each row and head.

        Pads and empty slots may be marked too (when a row has fewer than `recent` tokens); the
        caller ranks them first anyway. `None` when nothing is protected.
        """
        recent, sinks = self.recent, self.sinks
        protected = None
        if recent > 0:
            n = positions.shape[2]
            kth = torch.kthvalue(positions, n - recent + 1, dim=2, keepdim=True).values
            protected = positions >= kth
        if sinks > 0:
            is_sink = (positions >= 0) & (positions < sinks)
            protected = is_sink if protected is None else protected | is_sink
        return protected
