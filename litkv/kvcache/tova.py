"""`tova`: Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs").

At each call, evict the tokens that this call's queries attend to least: H2O without memory. With
`chunk_size=1` (decoding) the weights are those of the newest query, as in the paper; a longer call
sums them over its queries. TOVA averages over heads; here each KV head decides for itself (weights
summed over the group's query heads).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from litkv.kvcache.base import Candidates
from litkv.kvcache.registry import register_kv_cache
from litkv.kvcache.score import ScoreKVCache

__all__ = ["TOVAKVCache"]


@register_kv_cache("tova")
class TOVAKVCache(ScoreKVCache):
    """Keeps the tokens that got the most attention from the current call's queries."""

    needs_attn_weights: ClassVar[bool] = True

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` this call's attention-weight sums."""
        return candidates.attn_weights
