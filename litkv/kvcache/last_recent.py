"""`last-recent`: a sliding window over the most recent tokens, plus optional attention sinks.

With `mode="one-shot"` (kvpress's `StreamingLLMPress`): the whole prompt is kept, then compressed to
its `sinks` first tokens and its `budget - sinks` newest ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from litkv.kvcache.base import Candidates, KVCache
from litkv.kvcache.options import LastRecentOptions, PolicyOptions
from litkv.kvcache.registry import register_kv_cache

__all__ = ["LastRecentKVCache"]


@register_kv_cache("last-recent")
class LastRecentKVCache(KVCache):
    """Keeps the `cache_length - sinks` most recent tokens and the first `sinks` tokens (StreamingLLM,
    Xiao et al., 2024). Options: `sinks`, `mode`, `budget`."""

    Options: ClassVar[type[PolicyOptions]] = LastRecentOptions
    heads_share_positions: ClassVar[bool] = True

    def drops_valid_by_construction(self) -> bool:
        return type(self).select_drop is LastRecentKVCache.select_drop

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        """Drop the oldest tokens (empty slots and pads first); tokens at positions `< sinks` stay."""
        return self._oldest(candidates.positions, candidates.num_new)

    @classmethod
    def select_drop_layers(cls, policies: Sequence[LastRecentKVCache], calls: Sequence[Candidates]) -> torch.Tensor:
        """`(n_layers, B, G, 1)`: the decode-step drops of `policies` (`KVCaches.evict_waiting`) with one
        selection over the stacked `(n_layers, B, G, L + 1)` positions."""
        return policies[0]._oldest(torch.stack([c.positions for c in calls]), 1)

    def _oldest(self, positions: torch.Tensor, k: int) -> torch.Tensor:
        """`(..., k)` indices of the `k` oldest of `positions` `(..., N)` outside the sinks (the first of
        equal ones for one drop, as `argmin` gives: the same in a batch of layers as alone)."""
        age = self._age_score(positions)
        if k == 1:
            return age.argmin(dim=-1, keepdim=True)
        return torch.topk(age, k, dim=-1, largest=False).indices

    def oneshot_scores(self) -> torch.Tensor:
        """`(B, G, L)` the slots' positions, sinks highest: the newest and the sinks are kept."""
        return self._age_score(self.positions).to(torch.float64)

    def _age_score(self, positions: torch.Tensor) -> torch.Tensor:
        is_sink = (positions >= 0) & (positions < self.options.sinks)
        return positions.masked_fill(is_sink, torch.iinfo(torch.long).max)
