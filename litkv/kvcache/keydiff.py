"""`keydiff`: keep the keys least similar to the mean key (KeyDiff, Park et al., 2025; kvpress
`KeyDiffPress`).

Per (row, KV head) and call, the anchor is the mean of the unit-normalised keys of all candidates
(empty slots and pads left out); a candidate's score is minus its cosine similarity to the anchor,
so the most typical keys are evicted and distinctive ones kept. No attention weights are needed, so
the layer keeps the fast attention path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from litkv.kvcache.base import Candidates
from litkv.kvcache.options import PolicyOptions, ScoreOptions
from litkv.kvcache.registry import register_kv_cache
from litkv.kvcache.score import ScoreKVCache

__all__ = ["KeyDiffKVCache", "KeyDiffOptions"]


@dataclass
class KeyDiffOptions(ScoreOptions):
    """`sinks`, and `recent` (default a quarter of the cache: on the shipped model a recent window of
    1/16 and 1/8 of the cache lost needles near the end of the prompt at 128-256 slots, 1/4 did not)."""

    default_recent_fraction: ClassVar[float] = 0.25


@register_kv_cache("keydiff")
class KeyDiffKVCache(ScoreKVCache):
    """Evicts the candidates whose keys are most similar (cosine) to the mean normalised key."""

    Options: ClassVar[type[PolicyOptions]] = KeyDiffOptions

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` minus the cosine similarity of each key to the anchor.

        Two products with the keys (no normalised copy of them): the anchor is the weighted sum of the
        keys with weights `1 / |k|` over the real candidates, the similarity `k . anchor / (|k| |anchor|)`.
        """
        keys = candidates.keys.detach()
        if keys.dtype not in (torch.float32, torch.float64):  # products of 16-bit keys in float32
            keys = keys.float()
        norms = torch.linalg.vector_norm(keys, dim=-1).clamp(min=1e-12)  # (B, G, N)
        real = candidates.positions >= 0
        weights = torch.where(real, norms.reciprocal(), 0.0) / real.sum(dim=2, keepdim=True).clamp(min=1)
        anchor = torch.matmul(weights[:, :, None], keys)  # (B, G, 1, D)
        dots = torch.matmul(keys, anchor.transpose(2, 3))[..., 0]  # (B, G, N)
        return -dots / (norms * torch.linalg.vector_norm(anchor, dim=-1).clamp(min=1e-12))
