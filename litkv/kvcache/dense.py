"""`dense`: keeps every token; an error when full."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from litkv.kvcache.base import Candidates, KVCache
from litkv.kvcache.registry import register_kv_cache

if TYPE_CHECKING:
    from litkv.config import KVCacheConfig

__all__ = ["DenseKVCache"]


@register_kv_cache("dense")
class DenseKVCache(KVCache):
    """Exact attention over everything seen so far, in at most `cache_length` slots."""

    heads_share_positions: ClassVar[bool] = True

    @classmethod
    def max_tokens(cls, config: KVCacheConfig) -> int | None:
        """A dense cache holds at most `cache_length` tokens of a sequence."""
        return config.cache_length

    def drops_valid_by_construction(self) -> bool:
        return type(self).select_drop is DenseKVCache.select_drop

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        """Drop the empty slots `[num_filled, num_filled + T)`, so every new token is kept."""
        b, g, total = candidates.positions.shape
        t = total - self.cache_length
        drop = torch.arange(self.num_filled, self.num_filled + t, device=candidates.positions.device)
        return drop.expand(b, g, t)
