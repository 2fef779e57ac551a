"""Decayed H2O: H2O whose accumulated attention fades by a factor `decay` at every call.

A litkv policy with its own option and per-slot state. ``decay=1`` is H2O (without
``normalize_scores``); ``decay=0`` is TOVA (this call's attention only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from litkv import register_kv_cache
from litkv.kvcache import Candidates, Placement, PolicyOptions, ScoreKVCache, ScoreOptions
from litkv.kvcache.options import check_float

if TYPE_CHECKING:
    from litkv import KVCacheConfig
    from litkv.kvcache import CacheShape


@dataclass
class DecayedH2OOptions(ScoreOptions):
    """`sinks`, `recent` (from `ScoreOptions`) and `decay` in [0, 1]."""

    decay: float = 0.9

    def check(self, cache_length: int) -> None:
        super().check(cache_length)
        check_float("decay", self.decay, minimum=0.0, maximum=1.0)


@register_kv_cache("decayed-h2o")
class DecayedH2OKVCache(ScoreKVCache):
    """Keeps the tokens with the largest decayed attention `decay * past + this call's weights`.

    Attributes:
        past: `(B, G, L)` float32 decayed attention of each slot's token (0 for empty slots).
    """

    Options: ClassVar[type[PolicyOptions]] = DecayedH2OOptions
    needs_attn_weights: ClassVar[bool] = True
    slot_state: ClassVar[tuple[str, ...]] = ("past",)  # per-slot state: snapshots and undo carry it

    def __init__(
        self, config: KVCacheConfig, shape: CacheShape, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        super().__init__(config, shape, device, dtype)
        self.past = torch.zeros_like(self.positions, dtype=torch.float32)

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)`: the slots' decayed past plus this call's weights (new tokens: no past)."""
        return self.options.decay * F.pad(self.past, (0, candidates.num_new)) + candidates.attn_weights

    def after_write(self, placement: Placement, candidates: Candidates) -> None:
        """Move each surviving candidate's score into the slot it now holds."""
        self.past = placement.carry(self.score(candidates)).masked_fill(self.positions < 0, 0.0)
