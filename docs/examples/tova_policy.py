"""TOVA (Oren et al., 2024): keep the tokens that the newest queries attend to most.

A complete litkv policy. Use it by name once this module is imported (``policy="tova"``), or by
path without importing it first (``policy="tova_policy:TOVAKVCache"``, module on ``sys.path``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from litkv import register_kv_cache
from litkv.kvcache import Candidates, ScoreKVCache


@register_kv_cache("tova")
class TOVAKVCache(ScoreKVCache):
    """Evicts the tokens that got the least attention from this call's queries.

    Decisions are per (row, KV head): the weights are summed over the group's query heads (and over
    the call's queries; with ``chunk_size=1`` that is the newest query, as in the paper).
    """

    needs_attn_weights: ClassVar[bool] = True  # ask attention for the weight sums

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` weights of this call: no memory of earlier calls."""
        return candidates.attn_weights
