"""`h2o`: Heavy-Hitter Oracle (Zhang et al., 2023).

Each (row, KV head) keeps its `recent` newest tokens plus the tokens with the largest attention
accumulated since they entered the cache (weights of every call, prefill chunks included, summed
over the call's queries and the group's query heads). With `normalize_scores`, the accumulated
attention is divided by the number of queries that could attend to the token (queries at or after
its position, counted since it entered the cache; sliding windows are not taken into account), so
that old tokens are not favoured merely for having been seen by more queries.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from litkv.kvcache.score import ScoreKVCache

__all__ = ["H2OKVCache"]


class H2OKVCache(ScoreKVCache):
    """Keeps the recent window and the heavy hitters (largest accumulated attention)."""

    needs_attn_weights: ClassVar[bool] = True

    def score(self, positions: torch.Tensor, attn_weights: torch.Tensor | None) -> torch.Tensor:
        """`(B, G, L + T)` accumulated attention (divided by the query counts with `normalize_scores`)."""
        if attn_weights is None:
            raise ValueError("H2OKVCache.score needs attention weights, got None")
        scores = self.accumulated(attn_weights)
        if self.config.normalize_scores:
            scores = scores / self.counts(positions).clamp(min=1.0)
        return scores

    def slot_scores(self) -> torch.Tensor:
        """`(B, G, L)` current score of each slot's token (before the next call's attention)."""
        if self.config.normalize_scores:
            return self.attn_sums / self.query_counts.clamp(min=1.0)
        return self.attn_sums
