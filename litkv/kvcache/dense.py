"""`dense`: keeps every token; an error when full."""

from __future__ import annotations

from typing import ClassVar

import torch

from litkv.kvcache.base import CacheSettings, Candidates, KVCache
from litkv.kvcache.registry import register_kv_cache

__all__ = ["DenseKVCache"]


@register_kv_cache("dense")
class DenseKVCache(KVCache):
    """Exact attention over everything seen so far, in at most `cache_length` slots."""

    heads_share_positions: ClassVar[bool] = True

    @classmethod
    def max_tokens(cls, config: CacheSettings) -> int | None:
        """A dense cache holds at most `cache_length` tokens of a sequence."""
        return config.cache_length

    def drops_valid_by_construction(self) -> bool:
        return type(self).select_drop is DenseKVCache.select_drop

    def fills_in_order(self) -> bool:
        return type(self).select_drop is DenseKVCache.select_drop

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        """Drop the `T` lowest-numbered candidates without a token (empty slots, then the call's pads),
        so every new token is kept.

        Chosen from the positions (not the host counter) so that a compiled step does not depend on
        it. `check_room` (or `generate`'s check before the first call) makes sure there are `T` of them.
        """
        positions = candidates.positions
        n = positions.shape[2]
        index = torch.arange(n, device=positions.device)
        rank = torch.where(positions < 0, index, index + n)
        return torch.topk(rank, candidates.num_new, dim=2, largest=False, sorted=True).indices
