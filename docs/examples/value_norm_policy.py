"""Value norm: keep the tokens whose value vectors have the largest L2 norm.

A complete litkv policy (not a built-in). Use it by name once this module is imported
(``policy="value-norm"``), or by path without importing it first
(``policy="value_norm_policy:ValueNormKVCache"``, module on ``sys.path``).
"""

from __future__ import annotations

import torch

from litkv import register_kv_cache
from litkv.kvcache import Candidates, ScoreKVCache


@register_kv_cache("value-norm")
class ValueNormKVCache(ScoreKVCache):
    """Evicts, per (row, KV head), the candidates whose values have the smallest L2 norm.

    A token adds its attention weight times its value to the output: a small value changes the output
    little, whatever its weight. Needs no attention weights, so the layer keeps the fast attention
    path. Options (those of every `ScoreKVCache`): `sinks`, `recent`.
    """

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` L2 norm of each candidate's value (as stored), in float32."""
        return candidates.values.float().norm(dim=-1)
