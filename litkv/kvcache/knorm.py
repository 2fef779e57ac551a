"""`knorm`: keep the keys with the smallest L2 norm (Devoto et al., 2024, "A Simple and Effective
L2 Norm-Based Strategy for KV Cache Compression"; kvpress `KnormPress`).

Keys with a small norm tend to receive high attention; no attention weights are needed, so the
layer keeps the fast attention path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from litkv.kvcache.base import Candidates
from litkv.kvcache.options import PolicyOptions, ScoreOptions
from litkv.kvcache.registry import register_kv_cache
from litkv.kvcache.score import ScoreKVCache

__all__ = ["KNormKVCache", "KNormOptions"]


@dataclass
class KNormOptions(ScoreOptions):
    """`sinks`, `recent` (default 0, as kvpress's `KnormPress`), `mode`, `budget`."""

    default_recent_fraction: ClassVar[float] = 0.0


@register_kv_cache("knorm")
class KNormKVCache(ScoreKVCache):
    """Evicts the candidates whose keys have the largest L2 norm."""

    Options: ClassVar[type[PolicyOptions]] = KNormOptions

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` minus the key norms (computed in float32)."""
        return -candidates.keys.float().norm(dim=-1)
