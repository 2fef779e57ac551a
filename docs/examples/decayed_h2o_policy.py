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
    """`sinks`, `recent` (from `ScoreOptions`; default half the cache, as H2O) and `decay` in [0, 1]."""

    default_recent_fraction: ClassVar[float] = 0.5

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
    needs = frozenset({"attn_weights"})  # the call's attention-weight sums (attention takes its eager path)
    # per-slot state, declared: the cache allocates `self.past` (B, G, L) float32 zeros; snapshots and undo carry it
    slot_state: ClassVar[Mapping[str, SlotState]] = {"past": SlotState(fill=0.0, dtype=torch.float32)}
    past: torch.Tensor  # read it; the cache writes what `update_state` returns

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)`: the slots' decayed past plus this call's weights (new tokens: no past)."""
        return candidates.once(self.decayed)  # computed once per call, read again by update_state

    def decayed(self, candidates: Candidates) -> torch.Tensor:
        return self.options.decay * F.pad(self.past, (0, candidates.num_new)) + candidates.attn_weights

    def update_state(self, placement: Placement, candidates: Candidates) -> dict[str, torch.Tensor]:
        """Each surviving candidate's score, moved into the slot it now holds (0 in empty slots)."""
        return {"past": placement.carry(candidates.once(self.decayed)).masked_fill(self.positions < 0, 0.0)}
