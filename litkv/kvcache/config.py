"""`KVCacheConfig`: how each attention layer caches keys and values (plain, validated data).

Building caches from it is `GPT.build_kv_caches` / `KVCaches.build`; chunking a run from it is
`litkv.modeling.runner.ChunkPlan.of`. The policy and storage names resolve through their registries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from litkv.core.validation import FieldError, require_int
from litkv.kvcache.base import KVCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.options import PolicyOptions, check_int, parse_options
from litkv.kvcache.registry import get_kv_cache_class
from litkv.kvcache.storage import CacheShape
from litkv.kvcache.storage_kinds import check_storage_name

__all__ = ["DEFAULT_CHUNK_SIZE", "ChunkPlan", "KVCacheConfig"]

DEFAULT_CHUNK_SIZE = 256


@dataclass
class KVCacheConfig:
    """How each attention layer caches keys and values.

    Args:
        policy: Name of a registered policy (``dense``, ``last-recent``, ``h2o``, ``qh2o``, ...; see
            `litkv.kvcache.known_policies()`) or a ``"package.module:Class"`` path to a `KVCache` subclass.
        cache_length: Number of slots per (batch row, KV head) and layer.
        chunk_size: Number of tokens per call after the first (prefill) chunk. At most `cache_length`.
            ``None``: ``min(256, cache_length)`` (see `chunk_length`).
        prefill_length: Length of the first (prefill) chunk. ``None``: `chunk_size`. At most `cache_length`.
            While the cache is not full, chunking does not change any result; a longer first chunk only
            trades memory for speed. Quantised storage is the exception: new tokens are attended as
            they are stored, but a key computed in another chunk shape can differ in its last float
            bit (matmul kernels round by shape), which flips a code at a rounding boundary and moves
            the key by a whole quantum; later layers then see other inputs, and the flips cascade.
            On the shipped model (526 tokens, 1,024 slots, nothing evicted) chunk 1 and chunk 16 give
            logits up to 0.45 apart with int4 and 0.09 with int8 (float: 3e-5).
        storage: Where slots live: ``"float"`` (model dtype), ``"int8"`` or ``"int4"`` (quantised), or a
            format registered with `litkv.kvcache.register_storage`.
        quant_group_size: Group size along the head dimension for quantised storage.
        options: The policy's own options by name (each policy's `Options` dataclass lists them, e.g.
            ``{"sinks": 4, "recent": 128}``); on the command line ``--kv_cache.sinks 4``. Unknown names
            are an error naming the policy's options.
    """

    policy: str = "dense"
    cache_length: int = 1024
    chunk_size: int | None = None
    prefill_length: int | None = None
    storage: str = "float"
    quant_group_size: int = 64
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_sizes()
        if not isinstance(self.policy, str) or not self.policy:
            raise TypeError(f"policy must be a non-empty string, got {self.policy!r}")
        check_storage_name(self.storage)
        if self.options is None:
            self.options = {}
        cls = get_kv_cache_class(self.policy)
        self._policy_options = parse_options(cls.Options, self.options, self.policy, self.cache_length)

    def _check_sizes(self) -> None:
        """ValueError (a `FieldError` naming the fields) unless the sizes are ints that fit together."""
        _check_size("cache_length", self.cache_length)
        if self.chunk_size is not None:
            _check_size("chunk_size", self.chunk_size)
        _check_size("quant_group_size", self.quant_group_size)
        if self.chunk_length > self.cache_length:
            given = "" if self.chunk_size is not None else f" (the default min({DEFAULT_CHUNK_SIZE}, cache_length))"
            raise FieldError(
                f"chunk_size must be <= cache_length, got chunk_size={self.chunk_length}{given} and "
                f"cache_length={self.cache_length}: lower chunk_size or raise cache_length",
                ("chunk_size", "cache_length"),
            )
        if self.prefill_length is not None:
            _check_size("prefill_length", self.prefill_length)
            if self.prefill_length > self.cache_length:
                raise FieldError(
                    f"prefill_length must be <= cache_length, got prefill_length={self.prefill_length} "
                    f"and cache_length={self.cache_length}",
                    ("prefill_length", "cache_length"),
                )

    @property
    def policy_class(self) -> type[KVCache]:
        """The `KVCache` subclass named by `policy`."""
        return get_kv_cache_class(self.policy)

    def make_cache(self, shape: CacheShape, device: torch.device | None, dtype: torch.dtype) -> SlotMachine:
        """A fresh layer cache running this config's policy (`shape`: its sizes)."""
        return SlotMachine(self.policy_class, self, shape, device, dtype)

    @property
    def policy_options(self) -> PolicyOptions:
        """`options`, validated into the policy's `Options` dataclass."""
        return self._policy_options

    @property
    def chunk_length(self) -> int:
        """Tokens per call after the prefill chunk: `chunk_size`, or ``min(256, cache_length)``."""
        return min(DEFAULT_CHUNK_SIZE, self.cache_length) if self.chunk_size is None else self.chunk_size

    @property
    def first_chunk_length(self) -> int:
        """Length of the first (prefill) chunk."""
        return self.chunk_length if self.prefill_length is None else self.prefill_length

    def chunk_bounds(self, seq_len: int) -> list[tuple[int, int]]:
        """The chunks `[(start, end), ...]` of one row of `seq_len` tokens (`ChunkPlan.of(self).bounds`)."""
        return ChunkPlan.of(self).bounds(seq_len)


def _check_size(name: str, value: object) -> None:
    """TypeError unless `value` is an int; a `FieldError` naming `name` if it is below 1."""
    try:
        check_int(name, value, minimum=1)
    except ValueError as err:
        raise FieldError(str(err), (name,)) from None


@dataclass(frozen=True)
class ChunkPlan:
    """How a run cuts each row: a first chunk of `first` tokens, then chunks of `size` tokens.

    Chunking is a setting of the run, taken from the cache config's `prefill_length` and `chunk_size`
    (`ChunkPlan.of`); `litkv.modeling.runner` applies it to each row from its own first token.
    """

    first: int
    size: int

    def __post_init__(self) -> None:
        for name, value in (("first", self.first), ("size", self.size)):
            require_int(f"ChunkPlan.{name}", value, 1)

    @classmethod
    def of(cls, kv_cache: KVCacheConfig | Sequence[KVCacheConfig]) -> ChunkPlan:
        """The plan of a cache config (or one per layer; they must agree: one call runs all layers)."""
        configs = [kv_cache] if isinstance(kv_cache, KVCacheConfig) else list(kv_cache)
        first = configs[0]
        for layer, cfg in enumerate(configs[1:], start=1):
            if (cfg.first_chunk_length, cfg.chunk_length) != (first.first_chunk_length, first.chunk_length):
                raise ValueError(
                    "per-layer KV cache configs must chunk the same way: layer 0 has prefill_length="
                    f"{first.first_chunk_length}, chunk_size={first.chunk_length}; layer {layer} has "
                    f"prefill_length={cfg.first_chunk_length}, chunk_size={cfg.chunk_length}"
                )
        return cls(first.first_chunk_length, first.chunk_length)

    def bounds(self, length: int) -> list[tuple[int, int]]:
        """`[(start, end), ...]` covering `range(length)`: the first chunk, then chunks of `size`."""
        out, start, end = [], 0, min(self.first, length)
        while start < length:
            out.append((start, end))
            start, end = end, min(end + self.size, length)
        return out
