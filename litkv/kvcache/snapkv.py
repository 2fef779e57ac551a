"""`snapkv`: SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation";
kvpress `SnapKVPress`).

At each call, the observation window (the last `window` non-pad queries of the call, per row) attends
to every candidate, causally by position (a query at position `p` sees tokens at positions `0..p`),
with scale `1/sqrt(head_size)` (the model's own scale may differ, e.g. Gemma's); the softmax weights
are averaged over the window queries and summed over the KV group's query heads, then smoothed with
an average pool of width `kernel` over neighbouring tokens (neighbours in token position among the
candidates: slots are sorted by position, pooled with zero padding at the ends, and unsorted). The
paper compresses once, after the prompt; here every call evicts, so during decoding the window is the
newest query. With `keep_max` (default), a token's score is the largest pooled score it got in any
call since it entered the cache (during prefill too), so tokens that a past window needed are not
forgotten when the window moves on.

With `mode="one-shot"` (as in the paper and kvpress's `SnapKVPress`): the last `window` queries of the
prompt are kept (post-RoPE) while it is prefilled; at the compression their attention is averaged, the
window's own tokens are kept and score 0 in the pool (kvpress pools the tokens before the window only,
with zero padding), and the `budget` best pooled tokens are kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from litkv.kvcache.base import Candidates, Placement, SlotState
from litkv.kvcache.kernels import cpu_scores
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.options import PolicyOptions, ScoreOptions, check_bool, check_int
from litkv.kvcache.policy import StateUpdate
from litkv.kvcache.registry import register_kv_cache
from litkv.kvcache.score import ScoreKVCache

__all__ = ["SnapKVKVCache", "SnapKVOptions", "pool_by_position", "update_window", "window_attention", "window_mean"]


@dataclass
class SnapKVOptions(ScoreOptions):
    """`sinks`, `recent` (default half the cache), `window` (observation window, queries per call),
    `kernel` (odd width of the average pool over neighbouring tokens, 1: none), `keep_max` (running maximum).

    Defaults from `litkv evaluate` on the shipped model (budgets 128-512, chunks of 64): a recent window
    of half the cache beat a quarter (KL to dense 0.019 vs 0.024 at 128 slots, 0.0070 vs 0.0084 at 256);
    without `keep_max` the pass key at mid depth was lost at 128 slots (recall 0.20 vs 0.38); windows of
    32/64 and kernels of 1/15 were no better overall."""

    default_recent_fraction: ClassVar[float] = 0.5

    window: int = 16
    kernel: int = 7
    keep_max: bool = True

    def check(self, cache_length: int) -> None:
        super().check(cache_length)
        check_int("window", self.window, minimum=1)
        check_int("kernel", self.kernel, minimum=1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (the pool is centred on each token), got {self.kernel}")
        check_bool("keep_max", self.keep_max)
        if self.mode == "one-shot" and self.budget < self.window:
            raise ValueError(
                f"mode='one-shot' keeps the observation window: budget must be >= window, got budget={self.budget}, "
                f"window={self.window}"
            )


def window_attention(queries: torch.Tensor, keys: torch.Tensor, query_pos: torch.Tensor,
                     key_pos: torch.Tensor, window: int) -> torch.Tensor:  # fmt: skip
    """Causal softmax weights of the last `window` non-pad queries over the keys, averaged over those
    queries and summed over each group's heads: queries `(B, H, T, D)`, keys `(B, G, N, D)`, query_pos
    `(B, T)`, key_pos `(B, G, N)` -> `(B, G, N)` float32 (0 for rows without a non-pad query)."""
    b, h, t, d = queries.shape
    g = keys.shape[1]
    if t == 1:
        return _one_query_attention(queries, keys, query_pos, key_pos)
    valid = query_pos >= 0
    in_window = valid & (valid.flip(1).cumsum(1).flip(1) <= window)  # (B, T)
    order = torch.arange(t, device=query_pos.device).expand(b, t)
    index = torch.topk(torch.where(in_window, order, -1), min(window, t), dim=1).indices  # (B, W)
    q_pos = torch.where(in_window.gather(1, index), query_pos.gather(1, index), -1)
    q = queries.detach().float().gather(2, index[:, None, :, None].expand(b, h, -1, d))
    logits = torch.einsum("bgqwd,bgnd->bgqwn", q.view(b, g, h // g, -1, d), keys.detach().float()) * d**-0.5
    allowed = (key_pos[:, :, None, :] >= 0) & (key_pos[:, :, None, :] <= q_pos[:, None, :, None])  # (B, G, W, N)
    weights = torch.softmax(logits.masked_fill(~allowed[:, :, None], float("-inf")), dim=-1)
    weights = weights.nan_to_num(0.0).sum(dim=(2, 3))
    return weights / in_window.sum(dim=1).clamp(min=1)[:, None, None]


def _one_query_attention(queries: torch.Tensor, keys: torch.Tensor, query_pos: torch.Tensor,
                         key_pos: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`window_attention` of a one-query call (a decode step; the window is the query unless it is a pad):
    queries `(B, H, 1, D)`, keys `(B, G, N, D)`, query_pos `(B, 1)`, key_pos `(B, G, N)` -> `(B, G, N)` float32."""
    return _one_query_weights(_one_query_logits(queries, keys), query_pos, key_pos)


def _one_query_logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scaled float32 logits `(B, G, P, N)` of one query per head, queries `(B, H, 1, D)`, over keys `(B, G, N, D)`."""
    b, h, _, d = queries.shape
    g, n = keys.shape[1], keys.shape[2]
    q = queries.detach().float().reshape(b * g, h // g, d)
    logits = torch.bmm(q, keys.detach().float().reshape(b * g, n, d).transpose(1, 2)).mul_(d**-0.5)
    return logits.view(b, g, h // g, n)


def _one_query_weights(logits: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Causal softmax of `_one_query_logits` `(..., B, G, P, N)` (leading dims: layers stacked), summed over the
    group's heads: query_pos `(B, 1)`, key_pos `(..., B, G, N)` -> `(..., B, G, N)` float32. Row by row, so a
    stack of layers gets each layer's own result."""
    allowed = (key_pos >= 0) & (key_pos <= query_pos[:, :, None])  # a pad query (-1) sees nothing
    logits = torch.where(allowed[..., None, :], logits, float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num_(0.0).sum(dim=-2)


def update_window(
    window: tuple[torch.Tensor, torch.Tensor] | None, queries: torch.Tensor, query_pos: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` newest non-pad queries of each row after a call: `window` (queries `(B, H, size, D)` float32,
    positions `(B, size)`, `-1` where empty) or `None`, and the call's queries `(B, H, T, D)` and `query_pos`."""
    q, pos = queries.detach().float(), query_pos
    if window is not None:
        q, pos = torch.cat((window[0], q), dim=2), torch.cat((window[1], pos), dim=1)
    if pos.shape[1] < size:
        missing = size - pos.shape[1]
        q = F.pad(q, (0, 0, 0, missing))
        pos = F.pad(pos, (0, missing), value=-1)
    index = torch.topk(pos, size, dim=1).indices  # (B, size)
    b, h, _, d = q.shape
    return q.gather(2, index[:, None, :, None].expand(b, h, size, d)), pos.gather(1, index)


def pool_by_position(scores: torch.Tensor, positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average pool of `scores` `(..., N)` over neighbours in token order along the last dim (`positions` of
    the same shape; empty slots sort first and must score 0, so they act as the zero padding of the pool).
    Each row is pooled on its own (leading dims `(B, G)`, or `(n, B, G)` for layers stacked)."""
    if kernel == 1:
        return scores
    order = torch.sort(positions, dim=-1, stable=True).indices
    return torch.empty_like(scores).scatter_(-1, order, window_mean(scores.gather(-1, order), kernel))


def window_mean(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """Mean of each element's window of `kernel` (odd) neighbours along the last dim of `x` `(..., N)`, zeros
    outside: `F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)` (zero padding counted) as `kernel`
    whole-tensor additions, from the window's first element to its last, then one division (a pool over
    many short rows costs several times more on the CPU)."""
    n, half = x.shape[-1], kernel // 2
    padded = F.pad(x, (half, half))
    total = padded[..., :n].clone()
    for i in range(1, kernel):
        total.add_(padded[..., i : i + n])
    return total.div_(kernel)


def _kept_scores(
    options: SnapKVOptions, weights: torch.Tensor, pos: torch.Tensor, best: torch.Tensor | None
) -> torch.Tensor:
    """Pooled `weights` `(..., L + T)` at `pos`, 0 at empty slots and pads, maxed with the slots' `best`
    `(..., L)` (the running maximum; `None` without `keep_max`)."""
    pooled = pool_by_position(weights, pos, options.kernel).masked_fill(pos < 0, 0.0)
    return pooled if best is None else torch.maximum(F.pad(best, (0, pos.shape[-1] - best.shape[-1])), pooled)


@register_kv_cache("snapkv")
class SnapKVKVCache(ScoreKVCache):
    """Keeps the tokens the observation window attends to most (pooled), plus sinks and the recent window.

    Attributes:
        best: `(B, G, L)` float32 largest pooled score of each slot's token so far (with `keep_max`).
    """

    Options: ClassVar[type[PolicyOptions]] = SnapKVOptions
    needs = frozenset({"queries"})
    slot_state: ClassVar[Mapping[str, SlotState]] = {"best": SlotState()}
    row_state: ClassVar[tuple[str, ...]] = ("window",)
    best: torch.Tensor
    # one-shot: the prompt's last `window` queries and their positions (None until the first call)
    window: tuple[torch.Tensor, torch.Tensor] | None

    def __init__(self, cache: SlotMachine) -> None:
        super().__init__(cache)
        # asked once, outside any compiled step
        self.c_scores = cpu_scores.available(self.positions.device, self.shape.key_size)
        # the C pool's order of the last call it sorted (`cpu_scores.snapkv_pool`): a hint, not state
        self._order: torch.Tensor | None = None

    def kept_scores(self, weights: torch.Tensor, pos: torch.Tensor, best: torch.Tensor | None) -> torch.Tensor:
        """`_kept_scores` of weights and positions `(..., N)` (one layer's, or layers stacked): for float32 on the CPU,
        eager, in one C pass (`cpu_scores.snapkv_pool`, the same bits), which starts from the order its last call
        sorted."""
        in_c = self.c_scores and cpu_scores.CPU_KERNEL and weights.device.type == "cpu"
        in_c = in_c and weights.dtype == torch.float32 and (best is None or best.dtype == torch.float32)
        if not in_c or torch.compiler.is_compiling():
            return _kept_scores(self.options, weights, pos, best)
        order = self._order
        if order is None or order.shape != weights.shape:
            order = torch.arange(weights.shape[-1], dtype=torch.int32).expand(weights.shape).contiguous()
            self._order = order
        return cpu_scores.snapkv_pool(weights, pos, best, self.options.kernel, order, self.shape.key_size)

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` pooled window attention (its running maximum with `keep_max`)."""
        return candidates.once(self._scores)

    def _scores(self, candidates: Candidates) -> torch.Tensor:
        """`call_scores` of the candidates' keys (while the cache fills, the stored slots, lossless, then the
        call's new keys)."""
        keys = candidates.keys
        if keys is None:
            keys = torch.cat((self.cache.storage.read()[0], candidates.new_keys), dim=2)
        return self.call_scores(candidates, keys)

    def call_scores(self, candidates: Candidates, keys: torch.Tensor) -> torch.Tensor:
        """`(B, G, L + T)` this call's pooled window attention over `keys`, maxed with the past if asked."""
        o, pos = self.options, candidates.positions
        if self._in_c(candidates, keys):  # a decode step's query on the CPU
            weights = cpu_scores.snapkv_weights(candidates.queries.float(), keys, candidates.query_pos, pos)
        else:
            weights = window_attention(candidates.queries, keys, candidates.query_pos, pos, o.window)
        return self.kept_scores(weights, pos, self.best if o.keep_max else None)

    def _in_c(self, candidates: Candidates, keys: torch.Tensor) -> bool:
        """Whether a call's weights come from `cpu_scores.snapkv_weights`: one query, float32 keys on the CPU."""
        return candidates.queries.shape[2] == 1 and self.c_scores and cpu_scores.applies(keys)

    @classmethod
    def stacked_scores(cls, policies: Sequence[ScoreKVCache], records: Sequence[Candidates]) -> torch.Tensor:
        """The layers' decode-step scores `(n_layers, B, G, L + 1)`: per layer only its logits (one product with
        its keys), then the mask, softmax, pool and running maximum once over the stacked layers, row by row (so
        each layer's part is what `score` gives it alone); each part is kept in its record for `update_state`.
        float32 keys on the CPU: every layer's weights from the C pass in one call (`cpu_scores.snapkv_weights_layers`,
        the bits of `score`'s call per layer), then the pool and running maximum stacked."""
        if any(type(c) is not SnapKVKVCache for c in policies) or any(
            r.keys is None or r.num_new != 1 for r in records
        ):
            return super().stacked_scores(policies, records)
        o = policies[0].options
        pos = torch.stack([r.positions for r in records])
        if all(c._in_c(r, r.keys) for c, r in zip(policies, records, strict=True)):  # type: ignore[attr-defined]
            queries, keys = [r.queries for r in records], [r.keys for r in records]
            weights = cpu_scores.snapkv_weights_layers(queries, keys, records[0].query_pos, pos)  # type: ignore
            if weights is None:  # a call per layer
                each = zip(queries, keys, records, strict=True)
                weights = torch.stack(
                    [cpu_scores.snapkv_weights(q.float(), k, r.query_pos, r.positions) for q, k, r in each]
                )
        else:
            logits = torch.stack([_one_query_logits(r.queries, r.keys) for r in records])  # type: ignore[arg-type]
            weights = _one_query_weights(logits, records[0].query_pos, pos)
        best = torch.stack([c.best for c in policies]) if o.keep_max else None  # type: ignore[attr-defined]
        scores = policies[0].kept_scores(weights, pos, best)  # type: ignore[attr-defined]
        for record, part in zip(records, scores, strict=True):
            record.remember(SnapKVKVCache._scores, part)
        cls.check_stacked(policies, records, scores)
        return scores

    def oneshot_scores(self) -> torch.Tensor:
        """`(B, G, L)` pooled attention of the prompt's last `window` queries; the window's tokens `inf`."""
        if self.window is None:
            raise RuntimeError("SnapKVKVCache.compress() before any prompt token was seen")
        queries, query_pos = self.window
        pos = self.positions
        weights = window_attention(queries, self.cache.storage.read()[0], query_pos, pos, self.options.window)
        start = query_pos.masked_fill(query_pos < 0, torch.iinfo(torch.long).max).min(dim=1).values  # (B,)
        in_window = pos >= start[:, None, None]
        pooled = pool_by_position(weights.masked_fill(in_window | (pos < 0), 0.0), pos, self.options.kernel)
        return self.protect(pooled.masked_fill(in_window, float("inf")), pos)

    def update_state(self, placement: Placement, candidates: Candidates) -> StateUpdate | None:
        """One-shot before the compression: the window of newest queries; else the running maximum carried
        into the slots (while filling, the call is scored here)."""
        if self.before_compression():
            return {"window": update_window(self.window, candidates.queries, candidates.query_pos, self.options.window)}
        if self.options.keep_max:
            return {"best": placement.carry(candidates.once(self._scores)).masked_fill(self.positions < 0, 0.0)}
        return None
