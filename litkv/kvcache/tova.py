"""`tova`: Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs";
kvpress `TOVAPress`).

At each call, evict the tokens that this call's queries attend to least: H2O without memory. With
`chunk_size=1` (decoding) the weights are those of the newest query, as in the paper; a longer call
sums them over its queries. With `heads="group"` (default) each KV head decides for itself (weights
summed over the group's query heads); with `heads="all"` the weights are summed over all the layer's
heads, as in the paper and kvpress, and every KV head keeps the same tokens.

With `mode="one-shot"` (kvpress's `TOVAPress`): the prompt's last query is kept while it is
prefilled; at the compression its attention (causal softmax, scale `1/sqrt(head_size)`) scores the
tokens, and its own token is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from litkv.kvcache.base import Candidates, Placement
from litkv.kvcache.options import PolicyOptions, ScoreOptions
from litkv.kvcache.policy import StateUpdate
from litkv.kvcache.registry import register_kv_cache
from litkv.kvcache.score import ScoreKVCache
from litkv.kvcache.snapkv import update_window, window_attention

__all__ = ["TOVAKVCache", "TOVAOptions"]

HEADS = ("group", "all")


@dataclass
class TOVAOptions(ScoreOptions):
    """`sinks`, `recent` (default 0), `mode`, `budget`, and `heads`: `group` (each KV head ranks by the
    weights of its own query heads) or `all` (the layer's heads together, as in the paper)."""

    default_recent_fraction: ClassVar[float] = 0.0  # as the paper and kvpress's TOVAPress: no recent window

    heads: str = "group"

    def check(self, cache_length: int) -> None:
        super().check(cache_length)
        if self.heads not in HEADS:
            raise ValueError(f"heads must be one of {HEADS}, got {self.heads!r}")


@register_kv_cache("tova")
class TOVAKVCache(ScoreKVCache):
    """Keeps the tokens that got the most attention from the current call's queries.

    Attributes:
        last_query: one-shot: the prompt's last query and its position per row (`None` until the first call).
    """

    Options: ClassVar[type[PolicyOptions]] = TOVAOptions
    needs = frozenset({"attn_weights", "queries"})
    row_state: ClassVar[tuple[str, ...]] = ("last_query",)
    last_query: tuple[torch.Tensor, torch.Tensor] | None

    def inputs(self) -> frozenset[str]:
        """The call's queries are read in one-shot mode only (the prompt's last query)."""
        return self.needs if self.options.mode == "one-shot" else self.needs - {"queries"}  # type: ignore[attr-defined]

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` this call's attention-weight sums (over all heads with `heads="all"`)."""
        return self._over_heads(candidates.attn_weights)

    def _over_heads(self, weights: torch.Tensor) -> torch.Tensor:
        if self.options.heads == "group":
            return weights
        return weights.sum(dim=1, keepdim=True).expand_as(weights)

    def oneshot_scores(self) -> torch.Tensor:
        """`(B, G, L)` attention of the prompt's last query; its own token `inf`."""
        if self.last_query is None:
            raise RuntimeError("TOVAKVCache.compress() before any prompt token was seen")
        query, query_pos = self.last_query
        pos = self.positions
        weights = self._over_heads(window_attention(query, self.cache.storage.read()[0], query_pos, pos, 1))
        return self.protect(weights.masked_fill(pos == query_pos[:, :1, None], float("inf")), pos)

    def update_state(self, placement: Placement, candidates: Candidates) -> StateUpdate | None:
        """One-shot, before the compression: keep the newest query of each row."""
        if self.before_compression():
            return {"last_query": update_window(self.last_query, candidates.queries, candidates.query_pos, 1)}
        return None
