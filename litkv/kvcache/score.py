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
`one-shot` (`OneShot`): the cache keeps every prompt token (it must have room for the whole prompt),
then `compress()` keeps `budget` tokens per (row, KV head), scored by `oneshot_scores()`, and moves
them to the first slots; decoding then fills the freed slots without eviction (continuous eviction
resumes only if the cache fills up again). `compress()` runs by itself at the first one-token call
after the prompt (the first decode step), or when a caller invokes it (at the end of the prompt,
before a question that must not be compressed, as kvpress's pipeline does). A one-token prompt chunk
looks like a decode step: with such chunks, call `compress_all` after the prompt.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch

from litkv.kvcache.base import Candidates, KVCache, drop_lowest
from litkv.kvcache.candidates import keep_highest
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.options import PolicyOptions, ScoreOptions

__all__ = ["OneShot", "ScoreKVCache", "compact_slots", "compress_all", "compress_layers", "keep_across_layers"]


def compact_slots(cache: SlotMachine, keep: torch.Tensor) -> None:
    """Move the slots marked in `keep` `(B, G, L)` to the front of each (row, KV head), in slot order,
    and empty the others (position `-1`); `num_filled` becomes the largest kept count."""
    length = cache.cache_length
    if cache.journal is not None:
        cache.journal(cache, torch.arange(length, device=keep.device).expand(keep.shape))
    order = torch.sort((~keep).to(torch.int8), dim=2, stable=True).indices  # kept slots first
    kept = keep.gather(2, order)
    tensors = {}
    for name, tensor in cache.state_tensors().items():
        if name == "positions" or name.startswith(("storage.", "slot.")):
            index = order.view(*order.shape, *[1] * (tensor.dim() - 3)).expand(*order.shape, *tensor.shape[3:])
            tensor = tensor.gather(2, index)
        tensors[name] = tensor.clone()
    tensors["positions"] = tensors["positions"].masked_fill(~kept, -1)
    cache.load_state_tensors(tensors, int(keep.sum(dim=2).max()) if keep.numel() else 0)


def compress_all(caches: Sequence[object]) -> None:
    """`compress()` every one-shot cache of `caches` (one per layer) that has not compressed yet: the end
    of the prompt (what `KVCaches.end_prefill` does; `generate` calls it after the prefill). The caches
    that rank across layers (`OneShot.compresses_across_layers`) are compressed together (`compress_layers`
    on their `oneshot_scores()`). Other caches are left alone."""
    machines = [c for c in caches if isinstance(c, SlotMachine) and isinstance(c.policy, OneShot)]
    across = [c for c in machines if c.policy.compresses_across_layers() and not c.policy.compressed]
    if across:
        for cache in across:
            cache.check_idle("compress_all()")
        compress_layers(across, torch.stack([c.policy.oneshot_scores().to(torch.float32) for c in across]))
    for cache in machines:
        if not any(cache is c for c in across):
            cache.end_prefill()


def keep_across_layers(
    scores: torch.Tensor, positions: torch.Tensor, budget: int, layerwise: bool = False, n_sink: int = 0
) -> torch.Tensor:
    """`(n_layers, B, G, L)` bool: the kept slots from `scores` `(n_layers, B, G, L)` (highest kept, positions
    below `n_sink` first, slots at position `-1` never): per row the `budget x G x n_layers` best over all
    layers and heads, or with `layerwise` the `budget x G` best of each layer."""
    n, b, g, length = scores.shape
    rank = scores.to(torch.float32).masked_fill((positions >= 0) & (positions < n_sink), float("inf"))
    rank = rank.masked_fill(positions < 0, float("-inf"))
    if layerwise:
        flat = rank.reshape(n, b, g * length)
        top = torch.topk(flat, min(budget * g, g * length), dim=2).indices
        keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(2, top, True)
    else:
        flat = rank.permute(1, 0, 2, 3).reshape(b, n * g * length)
        top = torch.topk(flat, min(budget * g * n, n * g * length), dim=1).indices
        keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, top, True)
        keep = keep.view(b, n, g, length).permute(1, 0, 2, 3)
    return keep.reshape(n, b, g, length) & (positions >= 0)


def compress_layers(
    caches: Sequence[SlotMachine], scores: torch.Tensor, layerwise: bool = False, n_sink: int = 0
) -> None:
    """Compress the layers' caches (of one-shot policies) together by `scores` `(n_layers, B, G, L)`
    (`keep_across_layers` with their common `budget`): the kept slots move to the front of each head
    (`compact_slots`)."""
    if not caches:
        raise ValueError("compress_layers needs at least one one-shot cache")
    policies = [c.policy for c in caches]
    if not all(isinstance(p, OneShot) for p in policies):
        raise ValueError(
            f"compress_layers: every layer needs a one-shot policy, got {[type(p).__name__ for p in policies]}"
        )
    budgets = {p.budget for p in policies}  # type: ignore[attr-defined]
    if len(budgets) != 1 or None in budgets:
        raise ValueError(f"compress_layers: every layer needs one one-shot budget, got {sorted(map(str, budgets))}")
    positions = torch.stack([c.positions for c in caches])
    keep = keep_across_layers(scores, positions, budgets.pop(), layerwise, n_sink)  # type: ignore[arg-type]
    for cache, layer_keep in zip(caches, keep, strict=True):
        compact_slots(cache, layer_keep)
        cache.policy.compressed = True  # type: ignore[attr-defined]


def check_no_nan(scores: torch.Tensor, where: str, inputs: Sequence[torch.Tensor | None] = ()) -> None:
    """ValueError naming the policy's method when `scores` holds a NaN (it would evict arbitrarily) while
    its `inputs` (the cached and new keys, the new values, the attention weights) are finite: a NaN the model produced
    is not the policy's, and the caller's own check (a NaN loss, NaN logits) names it."""
    if bool(torch.isnan(scores).any()) and all(t is None or bool(torch.isfinite(t).all()) for t in inputs):
        raise ValueError(f"{where} returned NaN scores: a NaN cannot be ranked, so the eviction would be arbitrary")


class OneShot(KVCache):
    """The one-shot mode of a policy (`options.mode == "one-shot"`, `options.budget`): no eviction until
    `compress()`, which keeps the `budget` highest `oneshot_scores()` per (row, KV head)."""

    def __init__(self, cache: SlotMachine) -> None:
        super().__init__(cache)
        self.one_shot = getattr(self.options, "mode", "continuous") == "one-shot"
        self.budget = getattr(self.options, "budget", None)
        self.compressed = False

    @abstractmethod
    def oneshot_scores(self) -> torch.Tensor:
        """`(B, G, L)` score of each slot's token at the end of the prompt (highest kept; `inf`: always kept)."""

    def compresses_across_layers(self) -> bool:
        """Whether the compression ranks this layer's `oneshot_scores()` against the other layers' (then
        `compress_all` / `KVCaches.end_prefill` compress the layers together, not `compress()`)."""
        return False

    def compress(self) -> None:
        """Keep the `budget` best-scored tokens of each (row, KV head), moved to the first slots."""
        if not self.one_shot:
            raise RuntimeError(f"{type(self).__name__}.compress() is for mode='one-shot', got {self.options.mode!r}")
        self.cache.check_idle("compress()")
        scores = self.oneshot_scores().to(torch.float32)
        check_no_nan(scores, f"{type(self).__name__}.oneshot_scores")  # once per prompt
        compact_slots(self.cache, self.select_keep(scores, self.positions))
        self.compressed = True

    def select_keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`(B, G, L)` bool: the `budget` highest float32 `scores` of each (row, KV head) among the filled
        slots, equal scores broken by position (`keep_highest`: not by the slots the tokens sit in)."""
        rank = scores.masked_fill(positions < 0, float("-inf"))
        top = keep_highest(rank, positions, min(self.budget, self.cache_length))
        return torch.zeros_like(positions, dtype=torch.bool).scatter_(2, top, True) & (positions >= 0)

    def end_prefill(self) -> None:
        """The end of the prompt: a one-shot cache compresses (once)."""
        if self.one_shot and not self.compressed:
            self.compress()

    def check_room(self, input_pos: torch.Tensor) -> None:
        """One-shot: the whole prompt must fit before the compression."""
        over = self.cache.overflow(input_pos, self.cache_length) if self.one_shot and not self.compressed else None
        if over is not None:
            row, held, need = over
            raise ValueError(
                f"{type(self).__name__} in mode='one-shot' keeps the whole prompt until it is compressed: "
                f"cache_length={self.cache_length}, row {row} holds {held} tokens, {need - held} more do not fit. "
                "Use cache_length >= prompt length (the budget sets what is kept)"
            )

    def flags(self) -> dict[str, bool]:
        """One-shot: whether the cache compressed (`"row.one_shot_compressed"` in the state)."""
        return {"one_shot_compressed": self.compressed} if self.one_shot else {}

    def set_flags(self, flags: Mapping[str, bool]) -> None:
        if self.one_shot:
            self.compressed = flags["one_shot_compressed"]


class ScoreKVCache(OneShot):
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
        """`score(candidates)` as `(B, G, L + T)` float32; ValueError naming the shapes when it is not."""
        scores = self.score(candidates)
        expected = tuple(candidates.positions.shape)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected:
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"{type(self).__name__}.score must return shape {expected} (B, G, L + T), got {got}")
        if not self.cache.static_shapes and (candidates.num_new > 1 or scores.device.type == "cpu"):
            # a prompt chunk, or a decode step on the CPU (no queue to stall): a device's decode steps read nothing
            inputs = (candidates.keys, candidates.new_keys, candidates.new_values, candidates.attn_weights)
            check_no_nan(scores, f"{type(self).__name__}.score", inputs)
        return scores.to(torch.float32)

    def lowest(self, scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
        """`(..., k)` indices of the `k` lowest-ranked candidates of `scores`, `positions` `(..., N)`:
        pads and empty slots first, then the lowest scores outside the sinks and the recent window."""
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
        `checked_score`. A class may compute what its layers share once (`learned`: every layer's gate
        logits in one product), as long as each layer gets the scores it would get alone."""
        return torch.stack([c.checked_score(r) for c, r in zip(policies, calls, strict=True)])

    def _protected(self, positions: torch.Tensor) -> torch.Tensor | None:
        """`(..., N)` bool: sinks and the `recent` newest candidates (by position) of each row and head.

        Pads and empty slots may be marked too (when a row has fewer than `recent` tokens); the
        caller ranks them first anyway. `None` when nothing is protected.
        """
        recent, sinks = self.recent, self.sinks
        protected = None
        if recent > 0:
            n = positions.shape[-1]
            kth = torch.kthvalue(positions, n - recent + 1, dim=-1, keepdim=True).values
            protected = positions >= kth
        if sinks > 0:
            is_sink = (positions >= 0) & (positions < sinks)
            protected = is_sink if protected is None else protected | is_sink
        return protected
