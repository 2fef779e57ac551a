"""`KVCaches`: the KV caches of one model run, as one object (like Hugging Face's `Cache`).

It owns the layer caches (one per attention layer), the last position each row has seen, the undo
log recording the calls (if one is kept) and the compile mode; whole-model operations are loops over
the layers. A conversation or a request is one such object; its value (a copy that can be saved,
forked, merged) is a `litkv.CacheState` (`litkv.snapshot` / `litkv.restore`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from litkv.kvcache.base import KVCache, LayerCache

__all__ = ["KVCaches", "CallRecorder"]


class CallRecorder(Protocol):
    """What records the calls through a `KVCaches` (the undo log, `litkv.undo.UndoLog`)."""

    def attach(self, caches: KVCaches) -> None: ...


class KVCaches:
    """One cache per layer, plus the run's per-row state.

    Attributes:
        layers: the layer caches (`KVCache`, or the gradient engine's replay caches).
        last_pos: `(B,)` int64 largest position each row has seen (`-1`: none yet), `None` before the
            first call.
        undo_log: the recorder of the calls, when one is kept (`litkv.keep_undo_log`).
    """

    def __init__(self, layers: Sequence[LayerCache]) -> None:
        if not layers:
            raise ValueError("KVCaches needs at least one layer cache")
        self.layers: list[LayerCache] = list(layers)
        self.last_pos: torch.Tensor | None = None
        self.undo_log: CallRecorder | None = None
        for cache in self.policy_caches:  # decode steps evict at `flush`, all layers together
            cache.defer_staged = True

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerCache]:
        return iter(self.layers)

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    @property
    def batch_size(self) -> int:
        return self.layers[0].positions.shape[0]

    @property
    def policy_caches(self) -> list[KVCache]:
        """The layers that are policy caches (all of them, except during the gradient engine's replay)."""
        return [cache for cache in self.layers if isinstance(cache, KVCache)]

    # -- compile mode ---------------------------------------------------------------------------

    @property
    def static_shapes(self) -> bool:
        """Every call attends all slots and leaves the host counters to `advance` (compiled decode)."""
        return any(cache.static_shapes for cache in self.policy_caches)

    @static_shapes.setter
    def static_shapes(self, value: bool) -> None:
        for cache in self.policy_caches:
            cache.static_shapes = value

    def advance(self, num_new: int) -> None:
        """Count `num_new` tokens per row in every layer's host counter (after a compiled step)."""
        for cache in self.policy_caches:
            cache.advance(num_new)

    def end_prefill(self) -> None:
        """The prompt is in: every layer's `end_prefill` (one-shot policies compress to their budget)."""
        for cache in self.policy_caches:
            cache.end_prefill()

    def flush(self) -> None:
        """Finish the decode-step evictions that wait (`KVCache.defer_staged`): the end of a model call.

        Layers of one class go to that class's `evict_deferred` together, in layer order (a score policy
        chooses for all of them at once). A layer whose eviction did not wait is left alone.
        """
        waiting = [cache for cache in self.policy_caches if cache.has_deferred]
        while waiting:
            kind = type(waiting[0])
            kind.evict_deferred([cache for cache in waiting if type(cache) is kind])
            waiting = [cache for cache in waiting if type(cache) is not kind]

    # -- positions ------------------------------------------------------------------------------

    def observe(self, input_pos: torch.Tensor, check: bool) -> None:
        """Take note of a call's positions `(B, T)` (`-1` at pads): `last_pos` moves to each row's largest.

        Args:
            input_pos: the call's positions.
            check: raise ValueError naming row, index and values unless the row's positions increase
                across calls, or when a layer's cache has no room for the call (before anything changes;
                host reads, skipped for trusted decode steps).
        """
        if check:
            self._check_increasing(input_pos)
            for cache in self.policy_caches:  # a call a cache refuses changes nothing, last_pos included
                if not cache.static_shapes and input_pos.shape[1] <= cache.cache_length:  # else: a longer error
                    cache.check_room(input_pos)
        last = input_pos.amax(dim=1)
        self.last_pos = last if self.last_pos is None else torch.maximum(self.last_pos, last)

    def _check_increasing(self, input_pos: torch.Tensor) -> None:
        running = torch.cummax(input_pos, dim=1).values
        before = torch.full_like(input_pos[:, :1], -1) if self.last_pos is None else self.last_pos[:, None]
        previous = torch.cat((before, running[:, :-1]), dim=1).clamp(min=before)
        bad = (input_pos >= 0) & (input_pos <= previous)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"positions must increase: row {row} has position {int(input_pos[row, col])} at index {col} "
                f"after position {int(previous[row, col])}"
            )

    # -- sizes ----------------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes of keys and values held by all layers (quantised: codes, scales and offsets)."""
        return sum(cache.nbytes() for cache in self.layers)
