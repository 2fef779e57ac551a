"""Model configuration (LitGPT's `Config`, reused as is) and the KV cache configuration."""

from __future__ import annotations

from dataclasses import dataclass

from litgpt.config import Config

__all__ = ["Config", "KVCacheConfig", "STORAGE_KINDS"]

STORAGE_KINDS = ("float", "int8", "int4")
DEFAULT_CHUNK_SIZE = 256


@dataclass
class KVCacheConfig:
    """How each attention layer caches keys and values.

    Args:
        policy: Name of a registered policy (``dense``, ``last-recent``, ``h2o``, ``qh2o``, ...) or a
            ``"package.module:Class"`` path to a `KVCache` subclass.
        cache_length: Number of slots per (batch row, KV head) and layer.
        chunk_size: Number of tokens per call after the first (prefill) chunk. At most `cache_length`.
            ``None``: ``min(256, cache_length)`` (see `chunk_length`).
        prefill_length: Length of the first (prefill) chunk. ``None``: `chunk_size`. At most `cache_length`.
            While the cache is not full, chunking does not change any result; a longer first chunk only
            trades memory for speed. (Quantised storage: new tokens are attended as they are stored, so
            the same holds up to a rare code flipping at a rounding boundary when a key computed in
            another chunk shape differs in its last float bit.)
        storage: Where slots live: ``"float"`` (model dtype), ``"int8"`` or ``"int4"`` (quantised).
        quant_group_size: Group size along the head dimension for quantised storage.
        sinks: Number of initial tokens that are never evicted (StreamingLLM attention sinks).
        recent: Number of newest tokens that score-based policies never evict. ``None``: policy default
            (half the cache for ``h2o`` and ``qh2o``, 0 otherwise).
        normalize_scores: H2O option: divide accumulated attention by the number of queries that could
            attend to the token.
        quant_error_weight: ``qh2o`` option: weight of the quantisation-error term in the score.
    """

    policy: str = "dense"
    cache_length: int = 1024
    chunk_size: int | None = None
    prefill_length: int | None = None
    storage: str = "float"
    quant_group_size: int = 64
    sinks: int = 0
    recent: int | None = None
    normalize_scores: bool = False
    quant_error_weight: float = 0.5

    def __post_init__(self) -> None:
        _check_int("cache_length", self.cache_length, minimum=1)
        if self.chunk_size is not None:
            _check_int("chunk_size", self.chunk_size, minimum=1)
        _check_int("quant_group_size", self.quant_group_size, minimum=1)
        _check_int("sinks", self.sinks, minimum=0)
        if not isinstance(self.policy, str) or not self.policy:
            raise TypeError(f"policy must be a non-empty string, got {self.policy!r}")
        if ":" not in self.policy:
            from litkv.kvcache.registry import check_policy_name

            check_policy_name(self.policy)
        if self.chunk_length > self.cache_length:
            raise ValueError(
                f"chunk_size must be <= cache_length, got chunk_size={self.chunk_length} and "
                f"cache_length={self.cache_length}"
            )
        if self.prefill_length is not None:
            _check_int("prefill_length", self.prefill_length, minimum=1)
            if self.prefill_length > self.cache_length:
                raise ValueError(
                    f"prefill_length must be <= cache_length, got prefill_length={self.prefill_length} "
                    f"and cache_length={self.cache_length}"
                )
        if self.storage not in STORAGE_KINDS:
            raise ValueError(f"storage must be one of {list(STORAGE_KINDS)}, got {self.storage!r}")
        if self.recent is not None:
            _check_int("recent", self.recent, minimum=0)
        if self.sinks + self.recent_length > self.cache_length:
            raise ValueError(
                f"sinks + recent must be <= cache_length, got sinks={self.sinks}, "
                f"recent={self.recent_length}, cache_length={self.cache_length}"
            )
        if not isinstance(self.normalize_scores, bool):
            raise TypeError(f"normalize_scores must be a bool, got {self.normalize_scores!r}")
        if not isinstance(self.quant_error_weight, (int, float)) or self.quant_error_weight < 0:
            raise ValueError(f"quant_error_weight must be a float >= 0, got {self.quant_error_weight!r}")

    @property
    def recent_length(self) -> int:
        """The recent window actually used: `recent`, or the policy default."""
        if self.recent is not None:
            return self.recent
        if self.policy in ("h2o", "qh2o"):
            return self.cache_length // 2
        return 0

    @property
    def chunk_length(self) -> int:
        """Tokens per call after the prefill chunk: `chunk_size`, or ``min(256, cache_length)``."""
        return min(DEFAULT_CHUNK_SIZE, self.cache_length) if self.chunk_size is None else self.chunk_size

    @property
    def first_chunk_length(self) -> int:
        """Length of the first (prefill) chunk."""
        return self.chunk_length if self.prefill_length is None else self.prefill_length

    def chunk_bounds(self, seq_len: int) -> list[tuple[int, int]]:
        """Split ``range(seq_len)`` into ``[(start, end), ...]``: the prefill chunk, then `chunk_size`."""
        bounds = []
        start, end = 0, min(self.first_chunk_length, seq_len)
        while start < seq_len:
            bounds.append((start, end))
            start, end = end, min(end + self.chunk_length, seq_len)
        return bounds


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
