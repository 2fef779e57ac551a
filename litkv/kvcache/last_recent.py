"""`last-recent`: a sliding window over the most recent tokens, plus optional attention sinks."""

from __future__ import annotations

from typing import ClassVar

import torch

from litkv.kvcache.base import Candidates, KVCache
from litkv.kvcache.options import LastRecentOptions, PolicyOptions
from litkv.kvcache.registry import register_kv_cache

__all__ = ["LastRecentKVCache"]


@register_kv_cache("last-recent")
class LastRecentKVCache(KVCache):
    """Keeps the `cache_length - sinks` most recent tokens and the first `sinks` tokens (StreamingLLM,
    Xiao et al., 2024). Option: `sinks`."""

    Options: ClassVar[type[PolicyOptions]] = LastRecentOptions
    heads_share_positions: ClassVar[bool] = True

    def drops_valid_by_construction(self) -> bool:
        return type(self).select_drop is LastRecentKVCache.select_drop

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        """Drop the oldest tokens (empty slots and pads first); tokens at positions `< sinks` stay."""
        positions = candidates.positions
        t = candidates.num_new
        is_sink = (positions >= 0) & (positions < self.options.sinks)
        score = positions.masked_fill(is_sink, torch.iinfo(torch.long).max)
        return torch.topk(score, t, dim=2, largest=False).indices
