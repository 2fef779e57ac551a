"""AdaKV per-head budgets (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference"; kvpress `AdaKVPress`) for any policy with a one-shot mode.

`adakv(policy)` is `one_shot(policy, AdaKV)`: the policy run one-shot, its compression (`AdaKV`, a
`litkv.kvcache.one_shot.OneShot`) keeping `budget x n_query_groups` tokens per (row, layer) in total,
allocated across the KV heads by score: each head first keeps its `max(1, int(budget * alpha_safeguard))`
best tokens (the safeguard), then the best remaining scores of all heads of the row together fill the rest
(`adakv_keep`). Scores must be comparable across heads (softmax-normalised ones are: expected-attention,
snapkv, tova; key norms are too).

Memory: the kept tokens are moved before `num_filled`, right-aligned in each head (`compact_slots`), so head `g` uses
`n_g` slots with `sum_g n_g = budget x G`; the slot buffers keep their size (`cache_length`), since
litkv's storage is one `(B, G, L, D)` tensor per layer. `AdaKV.used_slots()` (`cache.one_shot.used_slots()`)
gives the per-head counts from which the bytes of a ragged layout (`sum_g n_g`) or a padded one
(`G x max_g n_g`) follow.

Use by path, e.g. `KVCacheConfig("litkv.kvcache.adakv:AdaKVExpectedAttention", options={"mode":
"one-shot", "budget": 128, "alpha_safeguard": 0.2})` (`mode` defaults to `"one-shot"`, the only one).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from litkv.kvcache.expected_attention import ExpectedAttentionKVCache
from litkv.kvcache.keydiff import KeyDiffKVCache
from litkv.kvcache.knorm import KNormKVCache
from litkv.kvcache.one_shot import OneShot, one_shot
from litkv.kvcache.options import PolicyOptions, check_float
from litkv.kvcache.policy import Policy
from litkv.kvcache.snapkv import SnapKVKVCache
from litkv.kvcache.tova import TOVAKVCache

__all__ = [
    "AdaKV",
    "AdaKVExpectedAttention",
    "AdaKVKNorm",
    "AdaKVKeyDiff",
    "AdaKVSnapKV",
    "AdaKVTOVA",
    "adakv",
    "adakv_keep",
]


def adakv_keep(scores: torch.Tensor, positions: torch.Tensor, budget: int, alpha: float) -> torch.Tensor:
    """`(B, G, L)` bool: AdaKV's kept set of `budget x G` tokens per row from `scores` `(B, G, L)` (highest
    kept; slots at position `-1` never), each head keeping at least its `max(1, int(budget alpha))` best."""
    b, g, n = scores.shape
    rank = scores.masked_fill(positions < 0, float("-inf"))
    safe = max(1, int(budget * alpha)) if alpha > 0 else 0
    if safe:
        top = torch.topk(rank, min(safe, n), dim=2).indices
        rank = rank.scatter(2, top, float("inf")).masked_fill(positions < 0, float("-inf"))
    kept = torch.topk(rank.reshape(b, g * n), min(budget * g, g * n), dim=1).indices
    keep = torch.zeros(b, g * n, dtype=torch.bool, device=scores.device).scatter_(1, kept, True)
    return keep.view(b, g, n) & (positions >= 0)


class AdaKV(OneShot):
    """The one-shot compression with AdaKV's allocation across the KV heads (`adakv_keep`); option
    `alpha_safeguard` (0.2, as kvpress)."""

    option_fields: ClassVar[tuple[tuple[str, type, object], ...]] = (("alpha_safeguard", float, 0.2),)

    @classmethod
    def check_options(cls, options: PolicyOptions) -> None:
        check_float("alpha_safeguard", options.alpha_safeguard, minimum=0.0, maximum=1.0)  # type: ignore[attr-defined]

    def select_keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return adakv_keep(scores, positions, self.budget, self.options.alpha_safeguard)  # type: ignore[attr-defined]

    def used_slots(self) -> torch.Tensor:
        """`(B, G)` filled slots per (row, KV head)."""
        return (self.cache.positions >= 0).sum(dim=2)


def adakv(policy: type[Policy]) -> type[Policy]:
    """`policy` run one-shot with AdaKV's per-head budgets at the compression (`one_shot(policy, AdaKV)`), as
    a class named `AdaKV<policy>` of this module; its options add `alpha_safeguard` to the policy's own."""
    return one_shot(policy, AdaKV, module=__name__)


AdaKVExpectedAttention = adakv(ExpectedAttentionKVCache)
AdaKVSnapKV = adakv(SnapKVKVCache)
AdaKVTOVA = adakv(TOVAKVCache)
AdaKVKNorm = adakv(KNormKVCache)
AdaKVKeyDiff = adakv(KeyDiffKVCache)
