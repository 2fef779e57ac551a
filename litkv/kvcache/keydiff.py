"""`keydiff`: keep the keys least similar to the mean key (KeyDiff, Park et al., 2025; kvpress
`KeyDiffPress`).

Per (row, KV head) and call, the anchor is the mean of the unit-normalised keys of all candidates
(empty slots and pads left out); a candidate's score is minus its cosine similarity to the anchor,
so the most typical keys are evicted and distinctive ones kept. No attention weights are needed, so
the layer keeps the fast attention path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from litkv.kvcache.base import Candidates
from litkv.kvcache.kernels import cpu_scores
from litkv.kvcache.machine import SlotMachine
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

    def __init__(self, cache: SlotMachine) -> None:
        super().__init__(cache)
        # asked once, outside any compiled step
        self.c_scores = cpu_scores.available(self.positions.device, self.shape.key_size)

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` minus the cosine similarity of each key to the anchor.

        Two products with the keys (no normalised copy of them): the anchor is the weighted sum of the
        keys with weights `1 / |k|` over the real candidates, the similarity `k . anchor / (|k| |anchor|)`;
        float32 keys on the CPU take the C pass (`cpu_scores.keydiff_scores`) instead.
        """
        keys = _float_keys(candidates)
        if self.c_scores and cpu_scores.applies(keys):
            return cpu_scores.keydiff_scores(keys, candidates.positions)
        norms = torch.linalg.vector_norm(keys, dim=-1).clamp(min=1e-12)  # (B, G, N)
        weights = _anchor_weights(norms, candidates.positions)
        return _minus_cosine(*_anchor_dots(keys, weights), norms)

    @classmethod
    def stacked_scores(cls, policies: Sequence[ScoreKVCache], records: Sequence[Candidates]) -> torch.Tensor:
        """The layers' decode-step scores `(n_layers, B, G, L + 1)`: per layer only what reads its keys (norms,
        anchor, dots), the elementwise rest once over the stacked layers (so each layer's part is what `score`
        gives it alone); float32 keys on the CPU: every layer's in one C call (`cpu_scores.keydiff_scores_layers`,
        the bits of `score`'s call per layer)."""
        if any(type(c) is not KeyDiffKVCache for c in policies) or any(r.keys is None for r in records):
            return super().stacked_scores(policies, records)
        keys = [_float_keys(r) for r in records]
        if all(c.c_scores for c in policies) and all(cpu_scores.applies(k) for k in keys):  # type: ignore[attr-defined]
            scores = cpu_scores.keydiff_scores_layers(keys, torch.stack([r.positions for r in records]))
            if scores is None:  # a call per layer
                pairs = zip(keys, records, strict=True)
                scores = torch.stack([cpu_scores.keydiff_scores(k, r.positions) for k, r in pairs])
            cls.check_stacked(policies, records, scores)
            return scores
        norms = torch.stack([torch.linalg.vector_norm(k, dim=-1) for k in keys]).clamp(min=1e-12)  # (n, B, G, N)
        weights = _anchor_weights(norms, torch.stack([r.positions for r in records]))
        dots, anchor_norms = zip(*(_anchor_dots(k, w) for k, w in zip(keys, weights, strict=True)), strict=True)
        scores = _minus_cosine(torch.stack(dots), torch.stack(anchor_norms), norms)
        cls.check_stacked(policies, records, scores)
        return scores


def _float_keys(candidates: Candidates) -> torch.Tensor:
    """The candidates' keys, detached; 16-bit keys in float32 (their products in float32)."""
    keys = candidates.keys.detach()  # type: ignore[union-attr]
    return keys if keys.dtype in (torch.float32, torch.float64) else keys.float()


def _anchor_weights(norms: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`(..., N)` weight of each key in the anchor: `1 / |k|` over the real candidates, divided by their count
    (norms (clamped away from 0), positions `(..., N)`; leading dims `(B, G)`, or `(n, B, G)` for layers stacked)."""
    real = positions >= 0
    inverse = torch.where(real, norms.reciprocal(), 0.0)
    return inverse / real.sum(dim=-1, keepdim=True).clamp(min=1)


def _anchor_dots(keys: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's `(B, G, N)` dot products of its keys `(B, G, N, D)` with the anchor (the keys summed with
    `weights` `(B, G, N)`), and the anchor's norm `(B, G, 1)`."""
    anchor = torch.matmul(weights[:, :, None], keys)  # (B, G, 1, D)
    dots = torch.matmul(keys, anchor.transpose(2, 3))[..., 0]
    return dots, torch.linalg.vector_norm(anchor, dim=-1)


def _minus_cosine(dots: torch.Tensor, anchor_norms: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """`-dots / (|k| |anchor|)` elementwise (dots and norms `(..., N)`, the norms clamped away from 0;
    anchor_norms `(..., 1)`)."""
    return -dots / (norms * anchor_norms.clamp(min=1e-12))
