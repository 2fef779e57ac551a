"""The two protocols around a layer cache: what the model's attention needs of it (`LayerCache`, met by
`litkv.kvcache.base.KVCache` and the gradient engine's replay cache) and what a cache reads of its
configuration (`CacheSettings`, met by `litkv.kvcache.config.KVCacheConfig`)."""

from __future__ import annotations

from typing import Protocol

import torch

from litkv.kvcache.options import PolicyOptions
from litkv.kvcache.storage import PackedSlots

__all__ = ["CacheSettings", "LayerCache"]


class CacheSettings(Protocol):
    """What a cache reads of its configuration (`litkv.kvcache.config.KVCacheConfig` is the one
    implementation; typed by protocol so that the contract does not import the config: no import circle)."""

    policy: str
    cache_length: int
    storage: str
    quant_group_size: int

    @property
    def policy_options(self) -> PolicyOptions: ...


class LayerCache(Protocol):
    """What an attention layer needs from its cache (`KVCache` and the gradient engine's replay cache)."""

    needs_attn_weights: bool
    needs_hidden: bool
    heads_share_positions: bool
    positions: torch.Tensor  # (B, G, n) token position of each cached slot, -1 when empty

    def attend_inputs(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        input_pos: torch.Tensor,
        queries: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | PackedSlots, torch.Tensor | PackedSlots, torch.Tensor]: ...

    def evict_and_store(self, attn_weights: torch.Tensor | None) -> None: ...

    def nbytes(self) -> int: ...
