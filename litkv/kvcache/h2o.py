"""`h2o`: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023).

Each (row, KV head) keeps its `recent` newest tokens (default: half the cache) plus the tokens with
the largest attention accumulated since they entered the cache (weights of every call, prefill chunks
included, summed over the call's queries and the group's query heads). With `normalize_scores`, the
accumulated attention is divided by the number of queries that could attend to the token (queries at
or after its position, counted since it entered the cache; sliding windows are not taken into
account), so that old tokens are not favoured merely for having been seen by more queries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from litkv.kvcache.base import Candidates, Placement, SlotState
from litkv.kvcache.options import PolicyOptions, ScoreOptions, check_bool
from litkv.kvcache.policy import StateUpdate
from litkv.kvcache.registry import register_kv_cache
from litkv.kvcache.score import ScoreKVCache

__all__ = ["H2OKVCache", "H2OOptions", "query_counts"]


@dataclass
class H2OOptions(ScoreOptions):
    """H2O's options: `sinks`, `recent` (default half the cache), `normalize_scores`."""

    default_recent_fraction: ClassVar[float] = 0.5

    normalize_scores: bool = False

    def check(self, cache_length: int) -> None:
        super().check(cache_length)
        check_bool("normalize_scores", self.normalize_scores)


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


@register_kv_cache("h2o")
class H2OKVCache(ScoreKVCache):
    """Keeps the recent window and the heavy hitters (largest accumulated attention).

    Attributes:
        attn_sums: `(B, G, L)` float32 attention accumulated by each slot's token since it entered the cache.
        query_counts: `(B, G, L)` float32 queries that could attend to it (kept with `normalize_scores`).
    """

    Options: ClassVar[type[PolicyOptions]] = H2OOptions
    needs = frozenset({"attn_weights"})
    slot_state: ClassVar[Mapping[str, SlotState]] = {"attn_sums": SlotState(), "query_counts": SlotState()}
    attn_sums: torch.Tensor
    query_counts: torch.Tensor

    @property
    def normalize(self) -> bool:
        """Scores are divided by the query counts (`normalize_scores`)."""
        return self.options.normalize_scores  # type: ignore[attr-defined]

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` accumulated attention (divided by the query counts with `normalize_scores`)."""
        scores = self.accumulated(candidates)
        return scores / self.counts(candidates).clamp(min=1.0) if self.normalize else scores

    def accumulated(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` attention each candidate has received since it entered the cache, this call included.

        Computed once per call (`score` and `update_state` both read it, through the call's memo).
        """
        return candidates.once(self._accumulate)

    def _accumulate(self, candidates: Candidates) -> torch.Tensor:
        return F.pad(self.attn_sums, (0, candidates.num_new)) + candidates.attn_weights

    @classmethod
    def stacked_scores(cls, policies: Sequence[ScoreKVCache], records: Sequence[Candidates]) -> torch.Tensor:
        """Every layer's accumulated attention in two operations over the stacked `(n_layers, B, G, .)`
        sums and weights (each layer's part kept in its record, as `accumulated` would compute it)."""
        if not all(type(c) is H2OKVCache and not c.normalize for c in policies):
            return super().stacked_scores(policies, records)
        return H2OKVCache.stacked_accumulated(policies, records)

    @staticmethod
    def stacked_accumulated(policies: Sequence[ScoreKVCache], records: Sequence[Candidates]) -> torch.Tensor:
        """`(n_layers, B, G, L + 1)` every layer's `accumulated` of its decode step (policies of `H2OKVCache` or a
        subclass without `normalize_scores`): two operations over the stacked sums and weights, each layer's part
        kept in its record."""
        sums = torch.stack([c.attn_sums for c in policies])  # type: ignore[attr-defined]
        weights = torch.stack([r.attn_weights for r in records])  # type: ignore[misc]
        accumulated = F.pad(sums, (0, 1)) + weights
        for record, part in zip(records, accumulated, strict=True):
            record.remember(H2OKVCache._accumulate, part)
        return accumulated

    def counts(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` queries that could attend to each candidate since it entered the cache."""
        previous = F.pad(self.query_counts, (0, candidates.num_new))
        return previous + query_counts(candidates.query_pos, candidates.positions)

    def update_state(self, placement: Placement, candidates: Candidates) -> StateUpdate:
        empty = self.positions < 0
        state = {"attn_sums": placement.carry(self.accumulated(candidates)).masked_fill(empty, 0.0)}
        if self.normalize:
            state["query_counts"] = placement.carry(self.counts(candidates)).masked_fill(empty, 0.0)
        return state

    def slot_scores(self) -> torch.Tensor:
        """`(B, G, L)` current score of each slot's token (before the next call's attention)."""
        return self.attn_sums / self.query_counts.clamp(min=1.0) if self.normalize else self.attn_sums
