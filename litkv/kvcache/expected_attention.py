"""`expected-attention`: Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache
Compression by Estimating Attention from Future Queries Distribution"; kvpress `ExpectedAttentionPress`).

Per (row, query head) the policy keeps statistics of the queries *before RoPE* (the call's post-RoPE
queries are rotated back with the model's RoPE table at their own positions): the mean `mu` and
covariance `Sigma` of the queries at positions `>= n_sink`, all of them uniformly (`n_stats=None`,
as kvpress) or exponentially weighted over about `n_stats` recent ones. Future queries are modelled as
`R q` with `q ~ N(mu, Sigma)` and `R` the average RoPE rotation of the next `n_future_positions`
absolute positions (from the position after the newest token). The expected unnormalised attention of
key `k` is `exp(k.R mu / sqrt(d) + k^T R Sigma R^T k / (2 d))` (the covariance term with
`use_covariance`); it is normalised over the candidates outside the `n_sink` first tokens (a softmax),
averaged over the KV group's query heads and, with `use_vnorm`, turned into `(score + epsilon) ||v||`.
The lowest are evicted; the `n_sink` first tokens and the `recent` newest are never evicted.

The RoPE table comes from the model: the class sets `needs_rope`, so `GPT.set_kv_caches` calls `bind_rope`.
The scale is `1/sqrt(head_size)` (the model's own may differ, e.g. Gemma's). No attention weights are
needed: the layer keeps the fast attention path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from litkv.kvcache.base import Candidates, Placement
from litkv.kvcache.options import PolicyOptions, ScoreOptions, check_bool, check_float, check_int, check_mode
from litkv.kvcache.registry import register_kv_cache
from litkv.kvcache.score import ScoreKVCache
from litkv.kvcache.storage import CacheShape
from litkv.rope import BoundRope, RopeTable

if TYPE_CHECKING:
    from litkv.config import KVCacheConfig

__all__ = ["ExpectedAttentionKVCache", "ExpectedAttentionOptions", "average_rotation", "rotate_half"]

Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class ExpectedAttentionOptions(ScoreOptions):
    """Options named as in kvpress: `n_future_positions` (512), `n_sink` (4: the first tokens, never evicted,
    left out of the query statistics and of the softmax), `use_covariance` (true), `use_vnorm` (true),
    `epsilon` (0.0); and `n_stats` (None: all the queries seen, uniformly; an int: exponential decay
    `1 - 1/n_stats` per query), `sinks` (0; the first `max(sinks, n_sink)` tokens are kept), `recent` (half)."""

    default_recent_fraction: ClassVar[float] = 0.5

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    n_stats: int | None = None

    def protected_sinks(self) -> int:
        """Tokens never evicted at the start: `max(sinks, n_sink)`."""
        return max(self.sinks, self.n_sink)

    def check(self, cache_length: int) -> None:
        check_int("sinks", self.sinks, minimum=0)
        check_int("n_sink", self.n_sink, minimum=0)
        if self.recent is not None:
            check_int("recent", self.recent, minimum=0)
        recent = self.recent_length(cache_length)
        if self.protected_sinks() + recent > cache_length:
            raise ValueError(
                f"max(sinks, n_sink) + recent must be <= cache_length, got sinks={self.sinks}, n_sink={self.n_sink}, "
                f"recent={recent}, cache_length={cache_length}"
            )
        check_mode(self.mode, self.budget, cache_length, self.protected_sinks() + recent)
        check_int("n_future_positions", self.n_future_positions, minimum=1)
        check_bool("use_covariance", self.use_covariance)
        check_bool("use_vnorm", self.use_vnorm)
        check_float("epsilon", self.epsilon, minimum=0.0)
        if self.n_stats is not None:
            check_int("n_stats", self.n_stats, minimum=1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`(-x2, x1)` for `x = (x1, x2)` halves of the last dimension (RoPE's half-split layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def average_rotation(cos: torch.Tensor, sin: torch.Tensor, size: int) -> torch.Tensor:
    """`(..., size, size)` mean RoPE rotation matrix from the mean `cos`, `sin` `(..., n)` over the future
    positions (rotation is linear in them); dims `n..size` are not rotated."""
    n, half = cos.shape[-1], cos.shape[-1] // 2
    eye = torch.eye(size, dtype=cos.dtype, device=cos.device)
    perm = torch.zeros(size, size, dtype=cos.dtype, device=cos.device)
    perm[half:n, :half] = torch.eye(half, dtype=cos.dtype, device=cos.device)
    perm[:half, half:n] = -torch.eye(half, dtype=cos.dtype, device=cos.device)
    pad = cos.new_ones(*cos.shape[:-1], size - n)
    c = torch.cat((cos, pad), dim=-1)
    s = torch.cat((sin, torch.zeros_like(pad)), dim=-1)
    return c[..., :, None] * eye + s[..., :, None] * perm


@register_kv_cache("expected-attention")
class ExpectedAttentionKVCache(ScoreKVCache):
    """Keeps the tokens with the largest expected attention from future queries times their value norm.

    Attributes:
        stats: float64 weighted sums of the pre-RoPE queries per (row, query head): weights `(B, H)`,
            queries `(B, H, D)`, outer products `(B, H, D, D)` (`(B, H, 0, 0)` without `use_covariance`).
    """

    Options: ClassVar[type[PolicyOptions]] = ExpectedAttentionOptions
    needs_queries: ClassVar[bool] = True
    needs_rope: ClassVar[bool] = True
    row_state: ClassVar[tuple[str, ...]] = ("stats",)

    def __init__(
        self, config: KVCacheConfig, shape: CacheShape, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        super().__init__(config, shape, device, dtype)
        self.sinks = self.options.protected_sinks()
        self.stats: Stats | None = None  # set at the first call
        self._rope: BoundRope | None = None
        self._future: tuple[torch.Tensor, torch.Tensor] = (torch.ones(0), torch.zeros(0))  # set by bind_rope

    def bind_rope(self, table: RopeTable, n_elem: int, column: int | None = None) -> None:
        """The model's RoPE: `table(n)` gives its cos and sin tables `(N, n_elem[, k])`, `N >= n` and covering
        every position of the calls the model runs (`GPT._rope_table`; `column` picks the last dim when the
        model has per-layer tables). Also precomputes the mean
        cos and sin of the offsets `1..n_future_positions` (the average rotation is built from them)."""
        self._rope = BoundRope(table, n_elem, column)
        future = torch.arange(1, self.options.n_future_positions + 1)
        cos, sin = self._cos_sin(future, needed=self.options.n_future_positions + 1)
        self._future = (cos.mean(dim=0), sin.mean(dim=0))

    def _cos_sin(self, positions: torch.Tensor, needed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `(*positions.shape, n_elem)` float64 at `positions` (`-1` read as 0). No host read: the
        model's table covers the positions of the call it runs (`needed` more may be asked for)."""
        if self._rope is None:
            raise RuntimeError(
                "ExpectedAttentionKVCache needs the model's RoPE table: attach the caches with GPT.set_kv_caches "
                "(or call cache.bind_rope(table, n_elem))"
            )
        cos, sin = self._rope.at(positions, needed)
        return cos.double(), sin.double()

    def future_rotation(self, newest: torch.Tensor, size: int) -> torch.Tensor:
        """`(B, size, size)` mean RoPE rotation of the positions `newest + 1 .. newest + n_future_positions`
        per row (`newest` `(B,)`): with angles linear in the position, `cos((p + k) t)` averaged over `k` is
        `cos(p t) mean_k cos(k t) - sin(p t) mean_k sin(k t)` (and `sin` alike)."""
        cos_p, sin_p = self._cos_sin(newest)  # (B, n)
        cos_k, sin_k = self._future
        cos = cos_p * cos_k - sin_p * sin_k
        sin = sin_p * cos_k + cos_p * sin_k
        return average_rotation(cos, sin, size)

    def pre_rope(self, queries: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """`(B, H, T, D)` float64 queries rotated back to position 0 (the rotated dims only)."""
        q = queries.detach().double()
        cos, sin = self._cos_sin(query_pos)  # (B, T, n)
        n = cos.shape[-1]
        rot = q[..., :n] * cos[:, None] - rotate_half(q[..., :n]) * sin[:, None]
        return torch.cat((rot, q[..., n:]), dim=-1)

    def updated_stats(self, queries: torch.Tensor, query_pos: torch.Tensor) -> Stats:
        """The statistics after the non-pad queries at positions `>= n_sink` of a call, the newest weighing most."""
        o = self.options
        q = self.pre_rope(queries, query_pos)
        valid = query_pos >= o.n_sink  # (B, T)
        decay = 1.0 if o.n_stats is None else 1.0 - 1.0 / o.n_stats
        later = valid.flip(1).cumsum(1).flip(1) - valid.long()  # counted queries after each one
        w = torch.where(valid, decay ** later.double(), 0.0)[:, None, :].expand(q.shape[:3])  # (B, H, T)
        # without covariance an empty tensor: row state is a tuple of tensors
        empty = q.new_zeros(*q.shape[:2], 0, 0)
        outer = torch.einsum("bht,bhtd,bhte->bhde", w, q, q) if o.use_covariance else empty
        new = (w.sum(dim=2), torch.einsum("bht,bhtd->bhd", w, q), outer)
        if self.stats is None:
            return new
        shrink = decay ** valid.sum(dim=1).double()  # (B,) weight left to the older queries
        merged = (x + shrink.view(-1, *[1] * (x.dim() - 1)) * old for x, old in zip(new, self.stats, strict=True))
        return tuple(merged)  # type: ignore[return-value]

    def expected(self, stats: Stats, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """`(B, G, N)` scores of keys/values `(B, G, N, D)` at `pos` `(B, G, N)` under `stats`."""
        o = self.options
        s0, s1, s2 = stats
        k = keys.detach().double()
        b, g, n, d = k.shape
        total = s0.clamp(min=1e-300)  # (B, H)
        mean = s1 / total[..., None]
        rot = self.future_rotation(pos.flatten(1).max(dim=1).values, d)[:, None]  # (B, 1, D, D)
        mu = (rot @ mean[..., None])[..., 0]  # (B, H, D)
        logits = torch.einsum("bgqd,bgnd->bgqn", mu.view(b, g, -1, d), k) / d**0.5
        if o.use_covariance:
            cov = s2 / total[..., None, None] - mean[..., :, None] * mean[..., None, :]
            cov = rot @ cov @ rot.transpose(-1, -2)
            quad = torch.einsum("bgnd,bgqde,bgne->bgqn", k, cov.view(b, g, -1, d, d), k)
            logits = logits + quad / (2 * d)
        hidden = (pos < o.n_sink)[:, :, None]  # sinks (kept anyway), empty slots and pads
        expected = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1).nan_to_num(0.0).mean(dim=2)
        if o.use_vnorm:
            expected = (expected + o.epsilon) * values.detach().double().norm(dim=-1)
        return expected

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` expected attention of each candidate (times `||v||` with `use_vnorm`)."""
        stats = candidates.scratch["ea.stats"] = self.updated_stats(candidates.queries, candidates.query_pos)
        return self.expected(stats, candidates.keys, candidates.values, candidates.positions)

    def oneshot_scores(self) -> torch.Tensor:
        """`(B, G, L)` expected attention of the slots under the prompt's statistics; sinks and recent `inf`."""
        if self.stats is None:
            raise RuntimeError("ExpectedAttentionKVCache.compress() before any prompt token was seen")
        keys, values = self.storage.read()
        return self.protect(self.expected(self.stats, keys, values, self.positions).float(), self.positions)

    def after_write(self, placement: Placement, candidates: Candidates) -> None:
        """Keep the statistics with this call's queries (also while the cache fills)."""
        stats = candidates.scratch.get("ea.stats")  # set by score(); not while the cache fills
        self.stats = self.updated_stats(candidates.queries, candidates.query_pos) if stats is None else stats
