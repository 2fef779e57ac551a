"""AdaKV per-head budgets (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference"; kvpress `AdaKVPress`) for any score policy in one-shot mode.

`adakv(policy_class)` makes a subclass whose one-shot compression keeps `budget x n_query_groups`
tokens per (row, layer) in total, allocated across the KV heads by score: each head first keeps its
`max(1, int(budget * alpha_safeguard))` best tokens (the safeguard), then the best remaining scores of
all heads of the row together fill the rest. Scores must be comparable across heads (softmax-normalised
ones are: expected-attention, snapkv, tova; key norms are too).

Memory: the kept tokens are moved to the first slots of each head (`compact_slots`), so head `g` uses
`n_g` slots with `sum_g n_g = budget x G`; the slot buffers keep their size (`cache_length`), since
litkv's storage is one `(B, G, L, D)` tensor per layer. `used_slots()` gives the per-head counts from
which the bytes of a ragged layout (`sum_g n_g`) or a padded one (`G x max_g n_g`) follow.

Use by path, e.g. `KVCacheConfig("litkv.kvcache.adakv:AdaKVExpectedAttention", options={"mode":
"one-shot", "budget": 128, "alpha_safeguard": 0.2})`.
"""

from __future__ import annotations

from dataclasses import field, make_dataclass
from typing import Any, ClassVar

import torch

from litkv.kvcache.expected_attention import ExpectedAttentionKVCache
from litkv.kvcache.keydiff import KeyDiffKVCache
from litkv.kvcache.knorm import KNormKVCache
from litkv.kvcache.options import PolicyOptions, ScoreOptions, check_float
from litkv.kvcache.score import ScoreKVCache
from litkv.kvcache.snapkv import SnapKVKVCache
from litkv.kvcache.tova import TOVAKVCache

__all__ = [
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


def _check(self: Any, cache_length: int) -> None:
    type(self).__mro__[1].check(self, cache_length)
    check_float("alpha_safeguard", self.alpha_safeguard, minimum=0.0, maximum=1.0)
    if self.mode != "one-shot":
        raise ValueError(f"AdaKV allocates the budget when a one-shot cache compresses: mode must be 'one-shot', "
                         f"got {self.mode!r}")  # fmt: skip


def adakv(policy_class: type[ScoreKVCache]) -> type[ScoreKVCache]:
    """A subclass of `policy_class` with AdaKV's allocation at the one-shot compression; its options add
    `alpha_safeguard` (0.2, as kvpress) to the policy's own."""
    base_options = policy_class.Options
    if not issubclass(base_options, ScoreOptions):
        raise TypeError(f"adakv needs a score policy (ScoreOptions), got {policy_class.__name__}")
    options = make_dataclass(
        f"AdaKV{base_options.__name__}",
        [("alpha_safeguard", float, field(default=0.2))],
        bases=(base_options,),
        namespace={"check": _check, "__module__": __name__},
    )

    def select_keep(self: ScoreKVCache, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return adakv_keep(scores, positions, self.budget, self.options.alpha_safeguard)

    def used_slots(self: ScoreKVCache) -> torch.Tensor:
        """`(B, G)` filled slots per (row, KV head)."""
        return (self.positions >= 0).sum(dim=2)

    namespace: dict[str, Any] = {
        "Options": options,
        "select_keep": select_keep,
        "used_slots": used_slots,
        "__module__": __name__,
        "__doc__": f"{policy_class.__name__} with AdaKV per-head budgets at the one-shot compression.",
    }
    cls = type(f"AdaKV{policy_class.__name__.removesuffix('KVCache')}", (policy_class,), namespace)
    cls.__annotations__ = {"Options": ClassVar[type[PolicyOptions]]}
    return cls


AdaKVExpectedAttention = adakv(ExpectedAttentionKVCache)
AdaKVSnapKV = adakv(SnapKVKVCache)
AdaKVTOVA = adakv(TOVAKVCache)
AdaKVKNorm = adakv(KNormKVCache)
AdaKVKeyDiff = adakv(KeyDiffKVCache)
