"""`last-recent`: a sliding window over the most recent tokens, plus optional attention sinks.

With `mode="one-shot"` (kvpress's `StreamingLLMPress`): the whole prompt is kept, then compressed to
its `sinks` first tokens and its `budget - sinks` newest ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from litkv.kvcache.base import Candidates
from litkv.kvcache.options import LastRecentOptions, PolicyOptions
from litkv.kvcache.registry import register_kv_cache
from litkv.kvcache.score import OneShot
from litkv.kvcache.storage import CacheShape

if TYPE_CHECKING:
    from litkv.config import KVCacheConfig

__all__ = ["LastRecentKVCache"]


@register_kv_cache("last-recent")
class LastRecentKVCache(OneShot):
    """Keeps the `cache_length - sinks` most recent tokens and the first `sinks` tokens (StreamingLLM,
    Xiao et al., 2024). Options: `sinks`, `mode`, `budget`."""

    Options: ClassVar[type[PolicyOptions]] = LastRecentOptions
    heads_share_positions: ClassVar[bool] = True

    def __init__(
        self, config: KVCacheConfig, shape: CacheShape, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        super().__init__(config, shape, device, dtype)
        self._init_one_shot()

    def drops_valid_by_construction(self) -> bool:
        return type(self).select_drop is LastRecentKVCache.select_drop

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        """Drop the oldest tokens (empty slots and pads first); tokens at positions `< sinks` stay."""
        return torch.topk(self._age_score(candidates.positions), candidates.num_new, dim=2, largest=False).indices

    def oneshot_scores(self) -> torch.Tensor:
        """`(B, G, L)` the slots' positions, sinks highest: the newest and the sinks are kept."""
        return self._age_score(self.positions).to(torch.float64)

    def _age_score(self, positions: torch.Tensor) -> torch.Tensor:
        is_sink = (positions >= 0) & (positions < self.options.sinks)
        return positions.masked_fill(is_sink, torch.iinfo(torch.long).max)
