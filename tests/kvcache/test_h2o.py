"""H2O against an independent brute-force float64 implementation of the rule, and against dense."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from helpers import forward_depth, max_diff, rounding_bound

import litkv
from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.h2o import H2OKVCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.storage import CacheShape
from litkv.modeling.attention import attend, build_mask

B, N_HEAD, G, HS, L = 2, 8, 2, 16, 12
PADS = 5  # row 1 is left-padded


class BruteForceH2O:
    """The H2O rule, one (row, KV head) and one query at a time, in float64 with Python containers.

    State per (row, head): `{sequence index: [accumulated attention, query count]}`.
    """

    def __init__(self, config: KVCacheConfig, pos: torch.Tensor, scale: float) -> None:
        self.config, self.pos, self.scale = config, pos, scale
        self.state = [[{} for _ in range(G)] for _ in range(B)]
        self.min_gap = math.inf  # smallest relative margin of an eviction decision (for messages)

    def score(self, entry: list[float]) -> float:
        return entry[0] / max(entry[1], 1.0) if self.config.policy_options.normalize_scores else entry[0]

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Attend and evict for chunk `[start, end)`; returns the outputs `(B, H, end - start, hs)`."""
        y = torch.zeros(B, N_HEAD, end - start, HS, dtype=torch.float64)
        for b in range(B):
            for g in range(G):
                state = self.state[b][g]
                new = [i for i in range(start, end) if self.pos[b, i] >= 0]
                state.update({i: [0.0, 0.0] for i in new})
                for i in new:
                    seen = [j for j in sorted(state) if self.pos[b, j] <= self.pos[b, i]]
                    for h in range(g * (N_HEAD // G), (g + 1) * (N_HEAD // G)):
                        logits = torch.stack([q[b, h, i] @ k[b, g, j] for j in seen]) * self.scale
                        weights = torch.softmax(logits, dim=0)
                        y[b, h, i - start] = weights @ v[b, g, seen]
                        for j, w in zip(seen, weights.tolist(), strict=True):
                            state[j][0] += w
                    for j in seen:
                        state[j][1] += 1.0
                self.evict(b, state)
        return y

    def evict(self, b: int, state: dict[int, list[float]]) -> None:
        excess = len(state) - self.config.cache_length
        if excess <= 0:
            return
        by_pos = sorted(state, key=lambda j: int(self.pos[b, j]))
        recent = self.config.policy_options.recent_length(self.config.cache_length)
        protected = set(by_pos[len(by_pos) - recent :] if recent else [])
        protected |= {j for j in state if self.pos[b, j] < self.config.policy_options.sinks}
        others = sorted((j for j in state if j not in protected), key=lambda j: self.score(state[j]))
        if len(others) > excess:  # relative gap between the last evicted and the first kept score
            last_out, first_in = self.score(state[others[excess - 1]]), self.score(state[others[excess]])
            self.min_gap = min(self.min_gap, (first_in - last_out) / first_in)
        for j in others[:excess]:
            del state[j]

    def kept(self, b: int, g: int) -> dict[int, float]:
        """`{token position: score}` of the tokens in the cache."""
        return {int(self.pos[b, j]): self.score(e) for j, e in self.state[b][g].items()}


def _random_run(config: KVCacheConfig, seed: int, n: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N_HEAD, n, HS, generator=gen, dtype=torch.float64)
    k = torch.randn(B, G, n, HS, generator=gen, dtype=torch.float64)
    v = torch.randn(B, G, n, HS, generator=gen, dtype=torch.float64)
    pos = torch.arange(n).expand(B, n).clone()
    pos[1] = torch.arange(n) - PADS
    pos[1, :PADS] = -1
    return q, k, v, pos


@pytest.mark.parametrize(
    "chunk_size, normalize, sinks, recent",
    [(1, False, 0, None), (7, False, 0, None), (1, True, 2, 3), (7, True, 2, 3), (7, False, 1, 0)],
)
def test_h2o_matches_brute_force(chunk_size: int, normalize: bool, sinks: int, recent: int | None) -> None:
    n = 3 * L + 9
    config = KVCacheConfig(
        "h2o", cache_length=L, chunk_size=chunk_size, prefill_length=5,
        options=dict(sinks=sinks, recent=recent, normalize_scores=normalize),
    )  # fmt: skip
    q, k, v, pos = _random_run(config, seed=chunk_size + 10 * sinks, n=n)
    scale = 1 / math.sqrt(HS)
    cache = SlotMachine(H2OKVCache, config, CacheShape(B, G, L, HS, HS), None, torch.float32)
    oracle = BruteForceH2O(config, pos, scale)
    evicting_steps = 0
    for start, end in config.chunk_bounds(n):
        ps = pos[:, start:end]
        qs, ks, vs = (x[:, :, start:end].float() for x in (q, k, v))
        keys, values, k_pos = cache.attend_inputs(ks, vs, ps)
        y, weights = attend(qs, keys, values, build_mask(ps, k_pos), scale, need_weights=True, query_valid=ps >= 0)
        cache.evict_and_store(weights)
        y_ref = oracle.step(q, k, v, start, end).transpose(1, 2).reshape(B, end - start, -1)
        valid = ps >= 0
        # float32 attention over at most L + chunk keys (q.k over HS, softmax and probs @ v over the keys)
        assert max_diff(y[valid], y_ref[valid]) <= rounding_bound(y_ref[valid], HS + 2 * (L + chunk_size))
        scores = cache.policy.slot_scores()
        for b in range(B):
            for g in range(G):
                expected = oracle.kept(b, g)
                held = {int(p): float(s) for p, s in zip(cache.positions[b, g], scores[b, g], strict=True) if p >= 0}
                where = f"chunk [{start}, {end}) row {b} head {g}, smallest decision margin {oracle.min_gap:.1e}"
                assert sorted(held) == sorted(expected), where
                for p, s in expected.items():
                    assert held[p] == pytest.approx(s, rel=1e-4), f"score of token {p}"
        evicting_steps += int(sum(len(oracle.state[b][g]) for b in range(B) for g in range(G)) == B * G * L)
    assert evicting_steps >= n // (2 * chunk_size)  # the cache was full (and evicting) most of the time


def test_h2o_with_room_for_everything_equals_dense(tiny_model: Callable[..., litkv.GPT]) -> None:
    torch.manual_seed(0)
    model = tiny_model(
        0, config=litkv.Config(n_layer=2, n_head=8, n_query_groups=2, n_embd=64, block_size=128, vocab_size=96)
    )
    idx = torch.randint(0, 96, (2, 40))
    expected = model(idx)
    for chunk_size in (1, 7):
        config = KVCacheConfig("h2o", cache_length=40, chunk_size=chunk_size, prefill_length=6)
        out = litkv.forward_chunked(model, idx, config)
        assert max_diff(out, expected) <= rounding_bound(expected, forward_depth(model.config, 40 + chunk_size))


def test_h2o_scores_accumulate_over_prefill_chunks() -> None:
    """After the prefill every slot holds the sum, over the chunks' queries and heads, of its weights."""
    config = KVCacheConfig("h2o", cache_length=L, chunk_size=4, prefill_length=4)
    q, k, v, pos = _random_run(config, seed=3, n=L)
    cache = SlotMachine(H2OKVCache, config, CacheShape(B, G, L, HS, HS), None, torch.float32)
    for start, end in config.chunk_bounds(L):
        ps = pos[:, start:end]
        keys, values, k_pos = cache.attend_inputs(k[:, :, start:end].float(), v[:, :, start:end].float(), ps)
        _, w = attend(q[:, :, start:end].float(), keys, values, build_mask(ps, k_pos), 0.25, need_weights=True,
                      query_valid=ps >= 0)  # fmt: skip
        cache.evict_and_store(w)
    # total attention handed out = number of valid (query, head) pairs; each row keeps all of it
    per_row = (pos >= 0).sum(dim=1).double() * (N_HEAD // G)
    # float32 sums: softmax over at most L keys, accumulated over the L queries' heads
    depth = HS + 2 * L + L * (N_HEAD // G)
    assert max_diff(cache.policy.slot_scores().sum(dim=2), per_row[:, None].expand(B, G)) <= rounding_bound(
        per_row, depth
    )


def test_h2o_generates_with_eviction(tiny_model: Callable[..., litkv.GPT]) -> None:
    """End to end: a cache much shorter than the sequence keeps the sink and the recent window."""
    torch.manual_seed(1)
    model = tiny_model(
        0, config=litkv.Config(n_layer=2, n_head=8, n_query_groups=2, n_embd=64, block_size=128, vocab_size=96)
    )
    prompts = [torch.randint(0, 96, (30,)), torch.randint(0, 96, (21,))]
    caches = []
    config = KVCacheConfig("h2o", cache_length=8, chunk_size=3, options=dict(sinks=1))
    out = litkv.generate(model, prompts, 10, config, on_tokens=lambda _: caches.append(model.kv_caches))
    assert [len(o) for o in out] == [10, 10]
    last_fed = torch.tensor([30 + 9 - 1, 21 + 9 - 1])  # the 10th new token is never fed back
    for cache in caches[-1]:
        assert bool((cache.positions >= 0).all())  # full, no pads stored
        assert bool((cache.positions.min(dim=2).values == 0).all())  # the sink token stays
        for b in range(2):
            for g in range(2):
                held = set(cache.positions[b, g].tolist())
                assert set(range(int(last_fed[b]) - 3, int(last_fed[b]) + 1)) <= held  # recent = 8 // 2
