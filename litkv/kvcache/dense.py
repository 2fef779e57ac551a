"""`dense`: keeps every token; an error when full."""

from __future__ import annotations

from typing import ClassVar

import torch

from litkv.kvcache.base import KVCache

__all__ = ["DenseKVCache"]


class DenseKVCache(KVCache):
    """Exact attention over everything seen so far, in at most `cache_length` slots."""

    heads_share_positions: ClassVar[bool] = True

    def check_room(self, num_new: int) -> None:
        if self.num_filled + num_new > self.cache_length:
            raise ValueError(
                f"dense KV cache is full: cache_length={self.cache_length}, {self.num_filled} slots used, "
                f"{num_new} new tokens do not fit (need {self.num_filled + num_new}). Use a larger "
                "cache_length or a policy that evicts, e.g. 'last-recent' or 'h2o'"
            )

    def drops_valid_by_construction(self) -> bool:
        """Its own `select_drop` (not an override) gives distinct in-range indices."""
        return type(self).select_drop is DenseKVCache.select_drop

    def select_drop(self, positions: torch.Tensor, attn_weights: torch.Tensor | None) -> torch.Tensor:
        """Drop the empty slots `[num_filled, num_filled + T)`, so every new token is kept."""
        b, g, total = positions.shape
        t = total - self.cache_length
        drop = torch.arange(self.num_filled, self.num_filled + t, device=positions.device)
        return drop.expand(b, g, t)
