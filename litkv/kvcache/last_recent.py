"""`last-recent`: a sliding window over the most recent tokens, plus optional attention sinks."""

from __future__ import annotations

from typing import ClassVar

import torch

from litkv.kvcache.base import KVCache

__all__ = ["LastRecentKVCache"]


class LastRecentKVCache(KVCache):
    """Keeps the `cache_length - sinks` most recent tokens and the first `sinks` tokens (StreamingLLM)."""

    heads_share_positions: ClassVar[bool] = True

    def drops_valid_by_construction(self) -> bool:
        """Its own `select_drop` (not an override) gives distinct in-range indices."""
        return type(self).select_drop is LastRecentKVCache.select_drop

    def select_drop(self, positions: torch.Tensor, attn_weights: torch.Tensor | None) -> torch.Tensor:
        """Drop the oldest tokens (empty slots and pads first); tokens at positions `< sinks` stay."""
        t = positions.shape[2] - self.cache_length
        is_sink = (positions >= 0) & (positions < self.config.sinks)
        score = positions.masked_fill(is_sink, torch.iinfo(torch.long).max)
        return torch.topk(score, t, dim=2, largest=False).indices
