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

Cost of a call: the statistics are updated with the call's queries only (float64, `O(H D^2)`); `R` is
applied to the keys (`R^T k`, elementwise) instead of building `D x D` matrices, and the covariance term is
one symmetric quadratic form per candidate and query head (`quadratic_forms`), run in the keys' precision
(float32 at least; float64 keys stay float64). That term is `O(N D^2)` per head and step by nature: `R`
moves with the newest position, so it cannot be carried per slot. On the CPU, float32 keys, values and RoPE
tables and a head size a multiple of 16 take C passes instead (`cpu_scores.expected_scores`: `R` applied to the
statistics, not the keys, and the whole score in one pass per layer; `cpu_scores.expected_stats`: a decode step's
statistics).

The RoPE table comes from the model: the class sets `needs_rope`, so `GPT.set_kv_caches` calls `bind_rope`.
The scale is `1/sqrt(head_size)` (the model's own may differ, e.g. Gemma's). No attention weights are
needed: the layer keeps the fast attention path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from litkv.core.rope import BoundRope, RopeTable
from litkv.kvcache.base import Candidates, Placement
from litkv.kvcache.kernels import cpu_scores
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.options import PolicyOptions, ScoreOptions, check_bool, check_float, check_int, check_mode
from litkv.kvcache.policy import StateUpdate
from litkv.kvcache.registry import register_kv_cache
from litkv.kvcache.score import ScoreKVCache

__all__ = ["ExpectedAttentionKVCache", "ExpectedAttentionOptions", "quadratic_forms", "rotate", "rotate_half"]

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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`R x` (`R^T x` with `inverse`) along the last dim of `x` `(..., D)` for the RoPE-shaped matrix `R` of
    `cos`, `sin` (`(..., n)`, broadcast to `x`; halves equal, as RoPE tables): `R x = cos x + sin rotate_half(x)`
    on the first `n` dims (a rotation when `cos^2 + sin^2 = 1`, else a mean of rotations); dims `n..D` are left
    as they are. `rotate_half(x)` is `x` rolled by `n/2` with its first half negated, so the sign is taken as
    given on the sines: `sin_signed` is `sin` with its first half negated."""
    n, half = cos.shape[-1], cos.shape[-1] // 2
    head = x[..., :n]
    turned = (head * cos).addcmul_(head.roll(half, dims=-1), sin_signed, value=-1 if inverse else 1)
    return turned if n == x.shape[-1] else torch.cat((turned, x[..., n:]), dim=-1)


def quadratic_forms(keys_t: torch.Tensor, matrices: torch.Tensor, blocks: int = 2) -> torch.Tensor:
    """`k^T C k` of every key under every matrix of its KV group: keys_t `(B, G, D, N)` (the keys transposed),
    matrices `(B, G, P, D, D)` symmetric -> `(B, G, P, N)`.

    Only the upper triangle is multiplied, by block rows (`blocks` of them; off-diagonal blocks doubled): block
    row `[lo, hi)` is one matrix product over the dims `lo..D`, so the products cost `(blocks + 1) / (2 blocks)`
    of the full `C k` (a quarter less with 2 blocks; smaller blocks multiply less efficiently)."""
    b, g, per, d, _ = matrices.shape
    out: torch.Tensor | None = None
    for i in range(blocks):
        lo, hi = d * i // blocks, d * (i + 1) // blocks
        rows = matrices[..., lo:hi, lo:hi]
        if hi < d:
            rows = torch.cat((rows, 2 * matrices[..., lo:hi, hi:]), dim=-1)
        products = rows.reshape(b, g, per * (hi - lo), d - lo) @ keys_t[:, :, lo:]  # (B, G, P (hi - lo), N)
        part = (
            products.view(b, g, per, hi - lo, -1).mul_(keys_t[:, :, None, lo:hi]).sum(dim=3)
        )  # in place: no new buffer
        out = part if out is None else out + part
    if out is None:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    return out


@register_kv_cache("expected-attention")
class ExpectedAttentionKVCache(ScoreKVCache):
    """Keeps the tokens with the largest expected attention from future queries times their value norm.

    Attributes:
        stats: float64 weighted sums of the pre-RoPE queries per (row, query head): weights `(B, H)`,
            queries `(B, H, D)`, outer products `(B, H, D, D)` (`(B, H, 0, 0)` without `use_covariance`).
    """

    Options: ClassVar[type[PolicyOptions]] = ExpectedAttentionOptions
    needs = frozenset({"queries", "rope"})
    row_state: ClassVar[tuple[str, ...]] = ("stats",)
    row_state_zero_is_unset: ClassVar[bool] = True  # sums: zeros plus a call's terms are the call's terms
    stats: Stats | None  # `None` until the first call
    _rope: BoundRope | None = None  # set by bind_rope, with the two below (read only once it is set)
    _future: tuple[torch.Tensor, torch.Tensor]  # mean cos and sin of the future offsets
    _sign: torch.Tensor  # (n_elem,) -1 on the first half

    def __init__(self, cache: SlotMachine) -> None:
        super().__init__(cache)
        size = self.shape.key_size  # the C pass takes heads of a multiple of 16 numbers; asked once, outside compiling
        self.c_scores = size % 16 == 0 and cpu_scores.available(self.positions.device, size)

    def bind_rope(self, table: RopeTable, n_elem: int, column: int | None = None) -> None:
        """The model's RoPE: `table(n)` gives its cos and sin tables `(N, n_elem[, k])`, `N >= n` and covering
        every position of the calls the model runs (`GPT._rope_table`; `column` picks the last dim when the
        model has per-layer tables). Also precomputes the mean cos and sin of the offsets `1..n_future_positions`
        (the average rotation is built from them)."""
        self._rope = BoundRope(table, n_elem, column)
        self._sign = torch.ones(n_elem, dtype=torch.float64, device=table(1)[0].device)
        self._sign[: n_elem // 2] = -1.0
        future = torch.arange(1, self.options.n_future_positions + 1)
        cos, sin = self._cos_sin(future, needed=self.options.n_future_positions + 1)
        self._future = (cos.mean(dim=0), sin.mean(dim=0))

    def _cos_sin(self, positions: torch.Tensor, needed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `(*positions.shape, n_elem)` float64 at `positions` (`-1` read as 0), the sines with their first
        half negated (as `rotate` takes them). No host read: the model's table covers the positions of the call it
        runs (`needed` more may be asked for)."""
        cos, sin = self._bound().at(positions, needed)
        return cos.double(), sin.double() * self._sign

    def _bound(self) -> BoundRope:
        """The model's RoPE (`bind_rope`); a clear error where it was never bound."""
        if self._rope is None:
            raise RuntimeError(
                "ExpectedAttentionKVCache needs the model's RoPE table: attach the caches with GPT.set_kv_caches "
                "(or call cache.bind_rope(table, n_elem))"
            )
        return self._rope

    def _c_tables(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The model's RoPE tables where a call on `x` (keys or queries) takes the C passes (`cpu_scores`: float32
        on the CPU, no autograd, float32 tables), else None."""
        if not (self.c_scores and cpu_scores.applies(x)):
            return None
        tables = self._bound().tables()
        return tables if tables[0].dtype == torch.float32 else None

    def future_cos_sin(self, newest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `(B, n_elem)` float64 of the mean RoPE rotation `R` of the positions `newest + 1 .. newest +
        n_future_positions` per row (`newest` `(B,)`): with angles linear in the position, `cos((p + k) t)`
        averaged over `k` is `cos(p t) mean_k cos(k t) - sin(p t) mean_k sin(k t)` (and `sin` alike; the sines
        with their first half negated, as `_cos_sin` gives them: the signs cancel in the products of two)."""
        cos_p, sin_p = self._cos_sin(newest)  # (B, n)
        cos_k, sin_k = self._future
        return cos_p * cos_k - sin_p * sin_k, sin_p * cos_k + cos_p * sin_k

    def pre_rope(self, queries: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """`(B, H, T, D)` float64 queries rotated back to position 0 (the rotated dims only)."""
        cos, sin = self._cos_sin(query_pos)  # (B, T, n)
        return rotate(queries.detach().double(), cos[:, None], sin[:, None], inverse=True)

    def updated_stats(self, queries: torch.Tensor, query_pos: torch.Tensor) -> Stats:
        """The statistics after the non-pad queries at positions `>= n_sink` of a call, the newest weighing most."""
        o = self.options
        tables = self._c_tables(queries) if self.stats is not None and queries.shape[2] == 1 else None
        if tables is not None:  # a decode step: one C pass
            decay = 1.0 if o.n_stats is None else 1.0 - 1.0 / o.n_stats
            return cpu_scores.expected_stats(queries, query_pos, tables, self.stats, o.n_sink, decay)
        q = self.pre_rope(queries, query_pos)
        valid = query_pos >= o.n_sink  # (B, T)
        if o.n_stats is None:
            w, shrink = valid.double(), None
        else:
            decay = 1.0 - 1.0 / o.n_stats
            later = valid.flip(1).cumsum(1).flip(1) - valid.long()  # counted queries after each one
            w = torch.where(valid, decay ** later.double(), 0.0)  # (B, T)
            shrink = decay ** valid.sum(dim=1).double()  # (B,) weight left to the older queries
        weighted = q * w[:, None, :, None]  # (B, H, T, D)
        if self.stats is None:
            outer = weighted.transpose(-1, -2) @ q if o.use_covariance else q.new_zeros(*q.shape[:2], 0, 0)
            # without covariance an empty tensor: row state is a tuple of tensors
            return w.sum(dim=1, keepdim=True).expand(q.shape[:2]).contiguous(), weighted.sum(dim=2), outer
        s0, s1, s2 = self.stats if shrink is None else (x * shrink.view(-1, *[1] * (x.dim() - 1)) for x in self.stats)
        if o.use_covariance:
            s2 = (
                (s2 + weighted.transpose(-1, -2) @ q)
                if q.shape[2] > 1
                else torch.addcmul(s2, weighted[..., 0, :, None], q)
            )
        return s0 + w.sum(dim=1, keepdim=True), s1 + weighted.sum(dim=2), s2

    def moments(self, stats: Stats, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float64 mean `mu` `(B, H, D)` and `scale` times the covariance `Sigma` `(B, H, D, D)` (`None` without
        `use_covariance`) of the queries so far, from `stats`."""
        s0, s1, s2 = stats
        total = s0.clamp(min=1e-300)[..., None]  # (B, H, 1)
        mean = s1 / total
        if not self.options.use_covariance:
            return mean, None
        cov = (s2 * (scale / total[..., None])).addcmul_(mean[..., :, None], mean[..., None, :], value=-scale)
        return mean, cov

    def future_keys(self, keys: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        """`(B, G, D, N)` keys `(B, G, N, D)` seen from the future queries, transposed: `R^T k` with `R` the mean
        rotation after `newest` `(B,)` (so that `(R q).k = q.(R^T k)`), in the keys' precision (float32 at least)."""
        dtype = torch.promote_types(keys.dtype, torch.float32)
        cos, sin = (x.to(dtype)[:, None, None] for x in self.future_cos_sin(newest))  # (B, 1, 1, n)
        return rotate(keys.detach().to(dtype), cos, sin, inverse=True).transpose(-1, -2).contiguous()

    def expected(self, stats: Stats, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """`(B, G, N)` scores of keys/values `(B, G, N, D)` at `pos` `(B, G, N)` under `stats`.

        The statistics are float64; the products with the keys run in the keys' precision (float32 at least),
        with the future rotation on the keys (`future_keys`) and the covariance term as one symmetric quadratic
        form per key and query head (`quadratic_forms`). float32 keys and values on the CPU take one C pass
        instead (`cpu_scores.expected_scores`: the rotation on the statistics, the rest there too)."""
        o = self.options
        b, g, n, d = keys.shape
        tables = self._c_tables(keys) if cpu_scores.applies(values) else None
        if tables is not None:
            return cpu_scores.expected_scores(keys, values, pos, stats, tables, self._future, o.n_sink, o.use_vnorm,
                                              o.epsilon)  # fmt: skip
        keys_t = self.future_keys(keys, pos.flatten(1).max(dim=1).values)  # (B, G, D, N)
        mean, cov = self.moments(stats, 1 / (2 * d))
        per = mean.shape[1] // g
        logits = (mean / d**0.5).to(keys_t.dtype).view(b, g, per, d) @ keys_t  # (B, G, P, N)
        if cov is not None:
            logits = logits + quadratic_forms(keys_t, cov.to(keys_t.dtype).view(b, g, per, d, d))
        hidden = (pos < o.n_sink)[:, :, None]  # sinks (kept anyway), empty slots and pads
        expected = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1).nan_to_num(0.0).mean(dim=2)
        if not o.use_vnorm:
            return expected
        norms = values.detach().to(keys_t.dtype).norm(dim=-1)
        return (expected + o.epsilon) * norms if o.epsilon else expected * norms

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` expected attention of each candidate (times `||v||` with `use_vnorm`), once per call."""
        return candidates.once(self._score)

    def _score(self, candidates: Candidates) -> torch.Tensor:
        stats = candidates.once(self.call_stats)
        return self.expected(stats, candidates.keys, candidates.values, candidates.positions)

    def attended(self, candidates: Candidates) -> None:
        """The call's scores now, while its keys and values are in the CPU's caches (`score` reads them back)."""
        candidates.once(self._score)

    def call_stats(self, candidates: Candidates) -> Stats:
        """The statistics after this call's queries (`updated_stats`), once per call."""
        return self.updated_stats(candidates.queries, candidates.query_pos)

    def oneshot_scores(self) -> torch.Tensor:
        """`(B, G, L)` expected attention of the slots under the prompt's statistics; sinks and recent `inf`."""
        if self.stats is None:
            raise RuntimeError("ExpectedAttentionKVCache.compress() before any prompt token was seen")
        keys, values = self.cache.storage.read()
        return self.protect(self.expected(self.stats, keys, values, self.positions).float(), self.positions)

    def update_state(self, placement: Placement, candidates: Candidates) -> StateUpdate:
        """Keep the statistics with this call's queries (also while the cache fills)."""
        return {"stats": candidates.once(self.call_stats)}
