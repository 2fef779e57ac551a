"""Decayed H2O: H2O whose accumulated attention fades by a factor `decay` at every call.

A litkv policy with its own option and per-slot state. ``decay=1`` is H2O (without
``normalize_scores``); ``decay=0`` is TOVA (this call's attention only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from litkv import register_kv_cache
from litkv.kvcache import Candidates, Placement, PolicyOptions, ScoreKVCache, ScoreOptions, SlotState
from litkv.kvcache.options import check_float


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
    # per-slot state, declared: the base allocates `self.past` (B, G, L) float32 zeros; snapshots and undo carry it
    slot_state: ClassVar[Mapping[str, SlotState]] = {"past": SlotState(fill=0.0, dtype=torch.float32)}
    past: torch.Tensor

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)`: the slots' decayed past plus this call's weights (new tokens: no past)."""
        return self.options.decay * F.pad(self.past, (0, candidates.num_new)) + candidates.attn_weights

    def after_write(self, placement: Placement, candidates: Candidates) -> None:
        """Move each surviving candidate's score into the slot it now holds."""
        self.past = placement.carry(self.score(candidates)).masked_fill(self.positions < 0, 0.0)
