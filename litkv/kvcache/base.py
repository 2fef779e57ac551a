"""`KVCache`: the class a policy author subclasses (the policy side of a layer cache).

A policy implements `select_drop(candidates)` only (which `T` candidates lose their slot), or through
`ScoreKVCache`, `score(candidates)`; what it declares and may implement is `litkv.kvcache.policy.Policy`.
The layer cache that runs it (`litkv.kvcache.machine.SlotMachine`: storage, positions, the undo journal,
static shapes for compiled steps, snapshots, checks) builds one instance per layer and binds it to itself;
the instance reads the cache's slots through the read-only views below, and keeps its declared state in
its attributes (allocated at the binding, written by the machinery from what `update_state` returns).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from litkv.kvcache.candidates import Candidates, Placement, drop_lowest
from litkv.kvcache.layer_cache import CacheSettings, LayerCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.one_shot import OneShot
from litkv.kvcache.policy import Policy
from litkv.kvcache.state_tensors import SlotState, allocate
from litkv.kvcache.storage import CacheShape

__all__ = [
    "CacheSettings",
    "Candidates",
    "CacheShape",
    "KVCache",
    "LayerCache",
    "Placement",
    "SlotState",
    "drop_lowest",
]


class KVCache(Policy):
    """A policy, bound to the layer cache that runs it (`cache`). Subclass it (or `ScoreKVCache`) and implement
    `select_drop`; build it through its cache (`SlotMachine(policy_class, config, shape, device, dtype)`,
    `KVCacheConfig.make_cache`), never alone.

    Optional classmethod (the one opt-in of the batched decode step):
        select_drop_layers(policies, calls) -> `(n_layers, B, G, 1)`: the drops of the waiting decode steps
            of several layers of the class at once (`calls`: their `Candidates`, weights set), each as its
            own `select_drop` would choose. `KVCaches.evict_waiting` then places and writes them; a class
            without it (or a subclass with its own `select_drop`) is evicted layer by layer.

    In one-shot mode (`options={"mode": "one-shot", "budget": N}`) its cache composes `compression` (`OneShot`;
    `litkv.kvcache.one_shot`), which ranks the slots by `oneshot_scores()`; the policy reads it as `one_shot`.
    """

    compression: ClassVar[type[OneShot]] = OneShot

    def __new__(cls, *args: object) -> KVCache:
        if args and (len(args) != 1 or not isinstance(args[0], SlotMachine)):  # built as a cache was before
            name = cls.__name__
            raise TypeError(
                f"{name} is a policy, built by its layer cache: SlotMachine({name}, config, shape, device, dtype) "
                f"or config.make_cache(shape, device, dtype), not {name}(config, shape, device, dtype)"
            )
        return super().__new__(cls)

    def __init__(self, cache: SlotMachine) -> None:
        object.__setattr__(self, "cache", cache)
        self.options = cache.config.policy_options
        if not isinstance(self.options, self.Options):
            raise TypeError(
                f"{type(self).__name__} expects options of type {self.Options.__name__}, got "
                f"{type(self.options).__name__} (config.policy={cache.config.policy!r})"
            )
        allocate(self, cache.positions)  # the declared per-slot and per-row state

    @property
    def positions(self) -> torch.Tensor:
        """`(B, G, L)` int64 token position of each slot of the cache, `-1` when empty (the cache's)."""
        return self.cache.positions

    @property
    def cache_length(self) -> int:
        """`L`: the slots per (row, KV head)."""
        return self.cache.cache_length

    @property
    def config(self) -> CacheSettings:
        """The cache's configuration (`KVCacheConfig`)."""
        return self.cache.config

    @property
    def shape(self) -> CacheShape:
        """The cache's sizes (batch, KV heads, slots, key and value sizes)."""
        return self.cache.shape

    @property
    def one_shot(self) -> OneShot | None:
        """The one-shot compression its cache runs (`budget`, `compressed`), `None` outside one-shot mode."""
        return self.cache.one_shot  # type: ignore[return-value]

    def before_compression(self) -> bool:
        """Whether the cache is one-shot and has not compressed yet (it keeps the whole prompt)."""
        one_shot = self.cache.one_shot
        return one_shot is not None and not one_shot.compressed
