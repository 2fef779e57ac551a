"""`ScoreKVCache`: the base of score-based eviction policies (H2O, TOVA, SnapKV, KeyDiff, ...).

A policy implements `score(candidates)` only: one number per candidate (the `L` cached tokens and the
`T` new ones of the call), the lowest are evicted. The base class does the rest, per (batch row, KV
head):

- empty slots and pad tokens (position `-1`) go first;
- the `sinks` first tokens (positions `< sinks`) and the `recent` newest tokens are never evicted
  (options of every score policy, `ScoreOptions`);
- among the others, the `T` lowest-scored candidates lose their slot (top-k).

Per-slot state of a policy (H2O's accumulated attention, say) is declared in `slot_state` (the base
allocates it) and kept by the policy: build it per candidate in `score` or `update_state` and carry it
into the slots with `placement.carry`.

A decode step's eviction is chosen for all layers at once (`select_drop_layers`, called by
`KVCaches.evict_waiting`): each layer's scores (`stacked_scores`), then one selection over the
stacked layers.

Modes (`ScoreOptions.mode`): `continuous` (the above, at every call once the cache is full) or
`one-shot`: the cache keeps every prompt token, then its one-shot compression (`litkv.kvcache.one_shot.OneShot`,
composed by the layer cache beside the policy) keeps `budget` tokens per (row, KV head) by `oneshot_scores()`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from litkv.kvcache.base import Candidates, KVCache, drop_lowest
from litkv.kvcache.call_checks import check_no_nan
from litkv.kvcache.candidates import newest
from litkv.kvcache.kernels.cpu_select import lowest_one
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.options import PolicyOptions, ScoreOptions

__all__ = ["ScoreKVCache"]

_MOVED = ("compact_slots", "compress_all", "compress_layers", "keep_across_layers")


def __getattr__(name: str) -> object:
    """A one-line ImportError for the names the one-shot compression took away (`from ... import OneShot`)."""
    if name == "OneShot":
        raise ImportError(
            "litkv.kvcache.score.OneShot is gone: a policy no longer subclasses OneShot; subclass ScoreKVCache (or "
            "KVCache) and implement oneshot_scores(); the cache composes the compression (options mode='one-shot', "
            "budget=N, or litkv.kvcache.one_shot.one_shot(policy)), see docs/custom_policy.md"
        )
    if name in _MOVED:
        raise ImportError(f"litkv.kvcache.score.{name} moved to litkv.kvcache.one_shot.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ScoreKVCache(KVCache):
    """Evicts, per (row, KV head), the candidates with the lowest `score()`; keeps sinks and recent tokens."""

    Options: ClassVar[type[PolicyOptions]] = ScoreOptions

    def __init__(self, cache: SlotMachine) -> None:
        super().__init__(cache)
        if not isinstance(self.options, ScoreOptions):
            raise TypeError(f"{type(self).__name__}.Options must subclass ScoreOptions, got {type(self.options)}")
        self.sinks = self.options.protected_sinks()
        self.recent = self.options.recent_length(self.cache_length)

    @abstractmethod
    def score(self, candidates: Candidates) -> torch.Tensor:
        """Score of each candidate of this call; the lowest are evicted.

        Args:
            candidates: the call's record (positions `(B, G, L + T)`, keys, values, and what the class
                asked for). Scores of empty slots and pads (position `-1`) are ignored.

        Returns:
            `(B, G, L + T)` scores (any float dtype).
        """

    def oneshot_scores(self) -> torch.Tensor:
        """`(B, G, L)` `score()` of the slots as a call without new tokens would see them; sinks and the
        `recent` newest tokens score `inf`. Policies whose score needs the prompt's queries override it."""
        keys, values = self.cache.storage.read()
        b, g, _ = self.positions.shape
        none = keys[:, :, :0]
        candidates = Candidates(
            self.positions.clone(), keys, values, none, values[:, :, :0],
            torch.zeros(b, 0, dtype=torch.long, device=keys.device),
        )  # fmt: skip
        if self.cache.needs_attn_weights:
            candidates.attn_weights = torch.zeros_like(self.positions, dtype=torch.float32)
        return self.protect(self.score(candidates).to(torch.float32), self.positions)

    def protect(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`scores` with the sinks and the `recent` newest tokens set to `inf`."""
        protected = self._protected(positions)
        return scores if protected is None else scores.masked_fill(protected, float("inf"))

    def drops_valid_by_construction(self) -> bool:
        """Its own `select_drop` (a top-k, unless overridden) gives distinct in-range indices."""
        return type(self).select_drop is ScoreKVCache.select_drop

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        """The `T` lowest-ranked candidates: pads and empty slots, then the lowest scores outside the
        sinks and the recent window."""
        return self.lowest(self.checked_score(candidates), candidates.positions, candidates.num_new)

    def checked_score(self, candidates: Candidates) -> torch.Tensor:
        """`score(candidates)` as `(B, G, L + T)` float32; ValueError naming the shapes when it is not, or
        naming the class when it holds a NaN that its inputs do not (`check_no_nan`)."""
        scores = self._shaped_score(candidates)
        if self._checks_nan(candidates, scores):
            self._check_no_nan(candidates, scores)
        return scores.to(torch.float32)

    def _shaped_score(self, candidates: Candidates) -> torch.Tensor:
        """`score(candidates)`; ValueError naming the shapes unless it is a `(B, G, L + T)` tensor."""
        scores = self.score(candidates)
        expected = tuple(candidates.positions.shape)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected:
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"{type(self).__name__}.score must return shape {expected} (B, G, L + T), got {got}")
        return scores

    def _checks_nan(self, candidates: Candidates, scores: torch.Tensor) -> bool:
        """A prompt chunk, or a decode step on the CPU (no queue to stall): a device's decode steps read nothing."""
        return not self.cache.static_shapes and (candidates.num_new > 1 or scores.device.type == "cpu")

    def _check_no_nan(self, candidates: Candidates, scores: torch.Tensor) -> None:
        inputs = (candidates.keys, candidates.new_keys, candidates.new_values, candidates.attn_weights)
        check_no_nan(scores, f"{type(self).__name__}.score", inputs)

    def lowest(self, scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
        """`(..., k)` indices of the `k` lowest-ranked candidates of `scores`, `positions` `(..., N)`:
        pads and empty slots first, then the lowest scores outside the sinks and the recent window (a decode step's
        one drop on the CPU: the C pass `cpu_select.lowest_one`, the same answer)."""
        if k == 1 and type(self)._protected is ScoreKVCache._protected:
            drop = lowest_one(scores, positions, self.recent, self.sinks)
            if drop is not None:
                return drop
        protected = self._protected(positions)
        if protected is not None:
            scores = scores.masked_fill(protected, float("inf"))
        return drop_lowest(scores.masked_fill(positions < 0, float("-inf")), positions, k)

    @classmethod
    def select_drop_layers(cls, policies: Sequence[ScoreKVCache], calls: Sequence[Candidates]) -> torch.Tensor:
        """`(n_layers, B, G, 1)`: the decode-step drops of `policies` (layers of this class with one
        configuration, `KVCaches.evict_waiting`) with one selection (sinks, recent window, lowest score)
        over their stacked `(n_layers, B, G, L + 1)` scores, each layer's as its `select_drop` would pick."""
        scores = cls.stacked_scores(policies, calls)
        return policies[0].lowest(scores, torch.stack([c.positions for c in calls]), 1)

    @classmethod
    def stacked_scores(cls, policies: Sequence[ScoreKVCache], calls: Sequence[Candidates]) -> torch.Tensor:
        """`(n_layers, B, G, L + 1)` float32 scores of the layers' waiting decode steps: each layer's
        `checked_score` (the NaN check reads all layers at once, then each to name the culprit). A class may
        compute what its layers share once (`learned`: every layer's gate logits in one product), as long as
        each layer gets the scores it would get alone."""
        stacked = torch.stack([c._shaped_score(r) for c, r in zip(policies, calls, strict=True)]).to(torch.float32)
        cls.check_stacked(policies, calls, stacked)
        return stacked

    @classmethod
    def check_stacked(
        cls, policies: Sequence[ScoreKVCache], calls: Sequence[Candidates], stacked: torch.Tensor
    ) -> None:
        """The NaN check of `checked_score` over stacked scores `(n_layers, B, G, L + 1)`: one read for all layers,
        then each layer's to name the culprit."""
        if policies[0]._checks_nan(calls[0], stacked) and bool(torch.isnan(stacked).any()):
            for c, r, layer_scores in zip(policies, calls, stacked, strict=True):
                c._check_no_nan(r, layer_scores)

    def _protected(self, positions: torch.Tensor) -> torch.Tensor | None:
        """`(..., N)` bool: sinks and the `recent` newest candidates (by position) of each row and head.

        Pads and empty slots may be marked too (when a row has fewer than `recent` tokens); the
        caller ranks them first anyway. `None` when nothing is protected.
        """
        recent, sinks = self.recent, self.sinks
        protected = None
        if recent > 0:
            protected = newest(positions, recent)
        if sinks > 0:
            is_sink = (positions >= 0) & (positions < sinks)
            protected = is_sink if protected is None else protected | is_sink
        return protected
