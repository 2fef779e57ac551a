"""`snapkv` and `expected-attention` (continuous mode) against brute-force float64 versions of their rules,
against dense attention with room for every token, and batch == alone on left-padded batches (float and int4)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
import torch
from helpers import forward_depth, max_diff, rounding_bound

from litkv import GPT, KVCacheConfig, forward_chunked, generate
from litkv.inference.generate import pad_prompts
from litkv.kvcache import CacheShape, get_kv_cache_class
from litkv.kvcache.base import Candidates, KVCache
from litkv.kvcache.expected_attention import ExpectedAttentionKVCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.snapkv import SnapKVKVCache
from litkv.modeling.attention import attend, build_mask

B, N_HEAD, G, HS, L = 2, 8, 2, 16, 12
PER_KV = N_HEAD // G
PADS = 5  # row 1 is left-padded: its whole first chunk (prefill_length 5) is pads
SCALE = 1 / math.sqrt(HS)


class BruteForce:
    """A score policy's eviction, one (row, KV head) at a time, in float64 with Python containers.

    State per (row, head): `{sequence index: score}` of the tokens held. Subclasses give `scores`.
    """

    def __init__(self, config: KVCacheConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        self.config, self.opts, self.q, self.k, self.v, self.pos = config, config.policy_options, q, k, v, pos
        self.state: list[list[dict[int, float]]] = [[{} for _ in range(G)] for _ in range(B)]
        self.min_gap = math.inf  # smallest relative margin of an eviction decision (for messages)

    def scores(self, b: int, g: int, held: list[int], new: list[int], call_scores: bool) -> dict[int, float]:
        raise NotImplementedError

    def step(self, start: int, end: int) -> None:
        for b in range(B):
            new = [i for i in range(start, end) if self.pos[b, i] >= 0]
            for g in range(G):
                state = self.state[b][g]
                state.update({i: 0.0 for i in new})
                state.update(self.scores(b, g, sorted(state), new, len(state) > L))
                self.evict(b, state)

    def evict(self, b: int, state: dict[int, float]) -> None:
        excess = len(state) - L
        if excess <= 0:
            return
        by_pos = sorted(state, key=lambda j: int(self.pos[b, j]))
        recent = self.opts.recent_length(L)
        protected = set(by_pos[len(by_pos) - recent :] if recent else [])
        sinks = max(self.opts.sinks, getattr(self.opts, "n_sink", 0))  # expected-attention: n_sink too
        protected |= {j for j in state if self.pos[b, j] < sinks}
        others = sorted((j for j in state if j not in protected), key=lambda j: state[j])
        if len(others) > excess:
            last_out, first_in = state[others[excess - 1]], state[others[excess]]
            self.min_gap = min(self.min_gap, (first_in - last_out) / abs(first_in))
        for j in others[:excess]:
            del state[j]

    def kept(self, b: int, g: int) -> list[int]:
        return sorted(int(self.pos[b, j]) for j in self.state[b][g])


class BruteSnapKV(BruteForce):
    """Window queries (the call's last `window` non-pad ones), causal softmax per query and head,
    averaged over the window, summed over heads; average pool over neighbours by position; running max."""

    def scores(self, b: int, g: int, held: list[int], new: list[int], call_scores: bool) -> dict[int, float]:
        window = new[len(new) - self.opts.window :] if new else []
        attention = dict.fromkeys(held, 0.0)
        for i in window:
            seen = [j for j in held if self.pos[b, j] <= self.pos[b, i]]
            for h in range(g * PER_KV, (g + 1) * PER_KV):
                logits = torch.stack([self.q[b, h, i] @ self.k[b, g, j] for j in seen]) * SCALE
                for j, w in zip(seen, torch.softmax(logits, dim=0).tolist(), strict=True):
                    attention[j] += w / len(window)
        by_pos = sorted(held, key=lambda j: int(self.pos[b, j]))
        half, state = self.opts.kernel // 2, self.state[b][g]
        out = {}
        for r, j in enumerate(by_pos):
            pooled = sum(attention[by_pos[s]] for s in range(max(r - half, 0), min(r + half + 1, len(by_pos))))
            pooled /= self.opts.kernel
            out[j] = max(state[j], pooled) if self.opts.keep_max else pooled
        return out


ROPE_BASE, ROPE_N = 100.0, 12  # partial rotary: the last HS - ROPE_N dims are not rotated


def rope_table(needed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `(max(needed, 256), ROPE_N)` in the half-split layout (LitGPT's and Hugging Face's); like
    the model's table, it covers more positions than asked for (at least every position of the test)."""
    inv_freq = ROPE_BASE ** (-torch.arange(0, ROPE_N, 2, dtype=torch.float64) / ROPE_N)
    angles = torch.arange(max(needed, 256), dtype=torch.float64)[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.cos()), dim=1), torch.cat((angles.sin(), angles.sin()), dim=1)


def rope_table32(needed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_table` rounded to float32, as a float32 model's table is: the tables expected-attention's C passes
    read (a float64 table takes the PyTorch path)."""
    cos, sin = rope_table(needed)
    return cos.float(), sin.float()


@functools.cache  # a pure function of `p`; callers never write into the matrix
def rotation(p: int) -> torch.Tensor:
    """`(HS, HS)` float64 RoPE rotation at position `p`: pair `(i, i + ROPE_N/2)` turned by `p * base^(-2i/n)`."""
    r = torch.eye(HS, dtype=torch.float64)
    half = ROPE_N // 2
    for i in range(half):
        angle = p * ROPE_BASE ** (-2 * i / ROPE_N)
        c, s = math.cos(angle), math.sin(angle)
        r[i, i], r[i, i + half], r[i + half, i], r[i + half, i + half] = c, -s, s, c
    return r


@functools.cache  # the oracle asks for the same mean once per (row, group): 512 matrices each by default
def mean_rotation(first: int, count: int) -> torch.Tensor:
    """`(HS, HS)` mean of `rotation(p)` over the positions `first .. first + count - 1`."""
    return torch.stack([rotation(p) for p in range(first, first + count)]).mean(dim=0)


def rotated(q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Queries `(B, H, n, HS)` float64 turned by the rotation of their positions (pads: position 0)."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            out[b, :, i] = q[b, :, i] @ rotation(max(int(pos[b, i]), 0)).T
    return out


class BruteExpectedAttention(BruteForce):
    """Expected Attention from the paper's equations: weighted mean and centred covariance of the *pre-RoPE*
    queries at positions `>= n_sink` so far (weight `decay^(later ones)`, 1 without `n_stats`); the
    mean of the rotation matrices of the next `n_future_positions` positions `R`; softmax over the held
    tokens at positions `>= n_sink` of `(R mu).k / sqrt(d) + k^T R Sigma R^T k / (2 d)`, summed over the
    group's heads, `(score + epsilon) ||v||` with `use_vnorm`. `self.q` holds the pre-RoPE queries."""

    def __init__(self, config: KVCacheConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        super().__init__(config, q, k, v, pos)
        self.history: list[list[int]] = [[] for _ in range(B)]
        self.newest = [-1] * B

    def step(self, start: int, end: int) -> None:
        for b in range(B):
            self.history[b] += [i for i in range(start, end) if self.pos[b, i] >= self.opts.n_sink]
            self.newest[b] = max([self.newest[b]] + [int(p) for p in self.pos[b, start:end]])
        super().step(start, end)

    def moments(self, b: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        hist = self.history[b]
        if not hist:
            return torch.zeros(HS, dtype=torch.float64), torch.zeros(HS, HS, dtype=torch.float64)
        decay = 1.0 if self.opts.n_stats is None else 1 - 1 / self.opts.n_stats
        weights = [decay ** (len(hist) - 1 - r) for r in range(len(hist))]
        total = sum(weights)
        mu = sum(w * self.q[b, h, i] for w, i in zip(weights, hist, strict=True)) / total
        cov = sum(
            w * torch.outer(self.q[b, h, i] - mu, self.q[b, h, i] - mu) for w, i in zip(weights, hist, strict=True)
        )
        return mu, cov / total

    def scores(self, b: int, g: int, held: list[int], new: list[int], call_scores: bool) -> dict[int, float]:
        if not call_scores:  # the cache scores only the calls that evict
            return {}
        o = self.opts
        rot = mean_rotation(self.newest[b] + 1, o.n_future_positions)
        visible = [j for j in held if self.pos[b, j] >= o.n_sink]
        out = dict.fromkeys(held, 0.0)
        for h in range(g * PER_KV, (g + 1) * PER_KV):
            mu, cov = self.moments(b, h)
            mu, cov = rot @ mu, rot @ cov @ rot.T
            logits = []
            for j in visible:
                key = self.k[b, g, j]
                logits.append(mu @ key * SCALE + (key @ cov @ key * SCALE**2 / 2 if o.use_covariance else 0.0))
            for j, w in zip(visible, torch.softmax(torch.stack(logits), dim=0).tolist(), strict=True):
                out[j] += w
        if o.use_vnorm:
            out = {j: (s + o.epsilon * PER_KV) * float(self.v[b, g, j].norm()) for j, s in out.items()}
        return out


def _run_against_brute_force(policy: str, oracle_class: type[BruteForce], chunk: int, storage: str,
                             options: dict[str, object], seed: int, dtype: torch.dtype = torch.float32,
                             score_rtol: float | None = None) -> None:  # fmt: skip
    """Same chunked run through the cache (`dtype`) and the brute force (float64); kept positions equal and, with
    `score_rtol`, the scores of every evicting call within `score_rtol` of the brute force's (relative to the
    largest)."""
    n = 3 * L + 9
    config = KVCacheConfig(policy, cache_length=L, chunk_size=chunk, prefill_length=5, storage=storage,
                           quant_group_size=8, options=options)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, HS, generator=gen).to(dtype) for h in (N_HEAD, G, G))
    pos = torch.arange(n).expand(B, n).clone()
    pos[1] = torch.arange(n) - PADS
    pos[1, :PADS] = -1
    cache = SlotMachine(get_kv_cache_class(policy), config, CacheShape(B, G, L, HS, HS), None, dtype)
    seen_k, seen_v = cache.storage.as_stored(k, v)  # what queries and policy see (int4: rounded per token)
    oracle = oracle_class(config, q.double(), seen_k.double(), seen_v.double(), pos)
    if cache.needs_rope:  # the cache gets the queries after RoPE, the oracle keeps them before
        cache.policy.bind_rope(rope_table32 if dtype == torch.float32 else rope_table, ROPE_N)
        q = rotated(q.double(), pos).to(dtype)
    got, want = _record_scores(cache, oracle)
    evicting = 0
    for start, end in config.chunk_bounds(n):
        ps = pos[:, start:end]
        qs, ks, vs = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        keys, values, k_pos = cache.attend_inputs(ks, vs, ps, qs)
        _, w = attend(qs, keys, values, build_mask(ps, k_pos), SCALE, need_weights=cache.needs_attn_weights,
                      query_valid=ps >= 0)  # fmt: skip
        cache.evict_and_store(w)
        oracle.step(start, end)
        if score_rtol is not None and got:
            _check_scores(got.pop(), want, pos, score_rtol, PER_KV if policy == "expected-attention" else 1)
        want.clear()
        for b in range(B):
            for g in range(G):
                held = sorted(p for p in cache.positions[b, g].tolist() if p >= 0)
                where = f"chunk [{start}, {end}) row {b} head {g}, smallest decision margin {oracle.min_gap:.1e}"
                assert held == oracle.kept(b, g), where
        evicting += int(all(len(oracle.state[b][g]) == L for b in range(B) for g in range(G)))
    assert evicting >= n // (2 * chunk)  # the cache was full (and evicting) most of the time


def _record_scores(cache: KVCache, oracle: BruteForce) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
    """Hooks recording the cache's `score()` (scores `(B, G, L + T)` and positions of each evicting call) and
    the brute force's scores (`{(row, head): {sequence index: score}}` of the last step)."""
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    want: dict[tuple[int, int], dict[int, float]] = {}
    score, oracle_scores = cache.policy.score, oracle.scores

    def record(candidates: Candidates) -> torch.Tensor:
        out = score(candidates)
        got.append((out.double(), candidates.positions.clone()))
        return out

    def record_oracle(b: int, g: int, held: list[int], new: list[int], call_scores: bool) -> dict[int, float]:
        want[b, g] = out = oracle_scores(b, g, held, new, call_scores)
        return out

    cache.policy.score, oracle.scores = record, record_oracle  # type: ignore[method-assign]
    return got, want


def _check_scores(got: tuple[torch.Tensor, torch.Tensor], want: dict, pos: torch.Tensor, rtol: float,
                  per: int) -> None:  # fmt: skip
    """The cache's scores of a call (`got`) against the brute force's (`want`, `per` times the cache's)."""
    scores, positions = got
    for (b, g), expected in want.items():
        if not expected:  # the brute force scores only the rows that evict
            continue
        index = {int(pos[b, j]): j for j in expected}
        mine = [
            (float(s) * per, expected[index[int(p)]])
            for s, p in zip(scores[b, g], positions[b, g], strict=True)
            if p >= 0
        ]
        assert len(mine) == len(expected), f"row {b} head {g}: scored {len(mine)} tokens, expected {len(expected)}"
        top = max(abs(w) for _, w in mine)
        error = max(abs(m - w) for m, w in mine) / top
        assert error <= rtol, f"row {b} head {g}: scores off by {error:.1e} (relative to the largest, {top:.3g})"


@pytest.mark.parametrize(
    "chunk, storage, options",
    [
        (1, "float", {}),
        (7, "float", dict(window=3, kernel=5, sinks=2, recent=3)),
        (7, "float", dict(keep_max=False)),
        (1, "float", dict(kernel=1, keep_max=False, recent=2)),
        (7, "int4", dict(window=4, kernel=3, sinks=1, recent=0)),
    ],
)
def test_snapkv_matches_brute_force(chunk: int, storage: str, options: dict[str, object]) -> None:
    _run_against_brute_force("snapkv", BruteSnapKV, chunk, storage, options, seed=chunk + len(options))


@pytest.mark.parametrize(
    "chunk, storage, options",
    [
        (1, "float", {}),
        (7, "float", dict(n_stats=8, n_sink=2, recent=3, n_future_positions=5)),
        (7, "float", dict(n_stats=4, use_covariance=False, epsilon=0.05)),
        (1, "float", dict(n_stats=16, use_vnorm=False, n_sink=1, sinks=3, recent=0, n_future_positions=1)),
        (7, "int4", dict(n_sink=0)),
    ],
)
@pytest.mark.slow
def test_expected_attention_matches_brute_force(chunk: int, storage: str, options: dict[str, object]) -> None:
    _run_against_brute_force("expected-attention", BruteExpectedAttention, chunk, storage, options, seed=chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "policy, options",
    [
        ("snapkv", {}),
        ("snapkv", dict(kernel=3, sinks=2, recent=3)),
        ("expected-attention", {}),
        ("expected-attention", dict(n_stats=8, n_sink=2, recent=3, n_future_positions=5, epsilon=0.1)),
        ("expected-attention", dict(use_covariance=False)),
    ],
)
@pytest.mark.slow
def test_decode_step_scores_match_float64(policy: str, options: dict[str, object], dtype: torch.dtype) -> None:
    """Decode steps (one token per call, the cache full): the fast path's scores of every candidate are the
    brute force's float64 ones up to float32 rounding (snapkv's attention and expected-attention's products with
    float32 keys run in float32; expected-attention with float64 keys in float64), and the kept sets are equal."""
    oracle = BruteSnapKV if policy == "snapkv" else BruteExpectedAttention
    rtol = 1e-10 if dtype == torch.float64 and policy == "expected-attention" else 1e-5
    _run_against_brute_force(policy, oracle, 1, "float", options, seed=5, dtype=dtype, score_rtol=rtol)


def test_expected_attention_without_rope_is_a_clear_error() -> None:
    config = KVCacheConfig("expected-attention", cache_length=8)
    cache = SlotMachine(
        get_kv_cache_class("expected-attention"), config, CacheShape(1, G, 8, HS, HS), None, torch.float32
    )
    k = torch.randn(1, G, 2, HS)
    cache.attend_inputs(k, k, torch.arange(2)[None], torch.randn(1, N_HEAD, 2, HS))
    with pytest.raises(RuntimeError, match="needs the model's RoPE table"):
        cache.evict_and_store(None)


def test_policies_ask_for_queries_not_attention_weights() -> None:
    for cls in (SnapKVKVCache, ExpectedAttentionKVCache):
        assert cls.needs_queries and not cls.needs_attn_weights  # the layer keeps its fast attention path


@pytest.mark.parametrize("policy", ["snapkv", "expected-attention"])
@torch.inference_mode()
def test_with_room_for_every_token_equals_dense(policy: str, tiny_model: Callable[..., GPT]) -> None:
    model = tiny_model(4)
    idx = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = model(idx)
    for chunk in (1, 7):
        out = forward_chunked(model, idx, KVCacheConfig(policy, cache_length=40, chunk_size=chunk, prefill_length=6))
        assert max_diff(out, expected) <= rounding_bound(expected, forward_depth(model.config, 40 + chunk))


@pytest.fixture(scope="module")
def model64(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(8, torch.float64)


@pytest.mark.parametrize("storage", ["float", "int4"])
@pytest.mark.parametrize("policy", ["snapkv", "expected-attention"])
@torch.inference_mode()
def test_left_padded_batch_row_equals_alone(model64: GPT, policy: str, storage: str) -> None:
    """Prompts of 6, 19 and 33 tokens, 12 slots, token by token: each row's logits and new tokens
    (from `generate`) are those of its prompt alone, while the cache evicts."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (6, 19, 33)]
    config = KVCacheConfig(policy, cache_length=12, chunk_size=1, storage=storage, quant_group_size=8,
                           options=dict(n_sink=1) if policy == "expected-attention" else dict(sinks=1))  # fmt: skip
    idx, input_pos = pad_prompts(prompts, torch.device("cpu"))
    batched = forward_chunked(model64, idx, config, input_pos=input_pos)
    tokens = generate(model64, prompts, max_new_tokens=5, kv_cache=config)
    for row, prompt in enumerate(prompts):
        alone = forward_chunked(model64, prompt[None], config)[0]
        bound = rounding_bound(alone, forward_depth(model64.config, 13), torch.float64)
        assert max_diff(batched[row, -len(prompt) :], alone) <= bound, f"row {row}"
        assert tokens[row].tolist() == generate(model64, [prompt], 5, config)[0].tolist(), f"row {row}"


@pytest.mark.parametrize(
    "policy, options, error, match",
    [
        ("snapkv", dict(window=0), ValueError, "window must be >= 1, got 0"),
        ("snapkv", dict(kernel=4), ValueError, "kernel must be odd"),
        ("snapkv", dict(kernel=2.0), TypeError, "kernel must be an int"),
        ("snapkv", dict(keep_max="yes"), TypeError, "keep_max must be a bool"),
        ("snapkv", dict(recent=20), ValueError, "sinks \\+ recent must be <= cache_length"),
        ("expected-attention", dict(n_stats=0), ValueError, "n_stats must be >= 1, got 0"),
        ("expected-attention", dict(use_covariance="yes"), TypeError, "use_covariance must be a bool"),
        ("expected-attention", dict(n_future_positions=0), ValueError, "n_future_positions must be >= 1"),
        ("expected-attention", dict(epsilon=-1.0), ValueError, "epsilon must be >= 0.0"),
        (
            "expected-attention",
            dict(n_sink=10),
            ValueError,
            "max\\(sinks, n_sink\\) \\+ recent must be <= cache_length",
        ),
        ("expected-attention", dict(window=3), ValueError, "has no option 'window'"),
        ("snapkv", dict(mode="once"), ValueError, "mode must be one of"),
        ("snapkv", dict(mode="one-shot"), ValueError, "needs budget"),
        ("snapkv", dict(budget=8), ValueError, "budget is for mode='one-shot'"),
        ("snapkv", dict(mode="one-shot", budget=17), ValueError, "budget must be <= cache_length"),
        ("snapkv", dict(mode="one-shot", budget=4, recent=6), ValueError, "budget must be >= 6"),
        ("snapkv", dict(mode="one-shot", budget=8, recent=0), ValueError, "budget must be >= window"),
    ],
)
def test_bad_options_are_clear_errors(policy: str, options: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        KVCacheConfig(policy, cache_length=16, options=options)


@pytest.mark.parametrize("kernel", [1, 3, 7, 15])
def test_window_mean_is_the_average_pool_of_the_float64_loop(kernel: int) -> None:
    """snapkv's pool (`window_mean`: whole-tensor additions) against a float64 loop over each element's window
    (zero padding counted, as kvpress's `F.avg_pool1d`), within float32 rounding of the window's sum, and against
    `F.avg_pool1d` itself; rows of 1 to 40 elements, layers stacked in front."""
    from litkv.kvcache.snapkv import window_mean

    for n in (1, 2, 5, 40):
        x = torch.rand(3, 2, 4, n)
        got = window_mean(x, kernel)
        half, x64 = kernel // 2, x.double()
        oracle = torch.stack([x64[..., max(i - half, 0) : i + half + 1].sum(dim=-1) / kernel for i in range(n)], dim=-1)
        assert got.dtype == x.dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), oracle, rtol=0, atol=kernel * 2**-23)
        pooled = torch.nn.functional.avg_pool1d(x.flatten(0, -2)[:, None], kernel, stride=1, padding=half)
        torch.testing.assert_close(got, pooled.view_as(x), rtol=0, atol=kernel * 2**-23)
