"""One-shot mode of every kvpress-comparable policy against a float64 reference written from its paper's
equations, on a tiny random GQA model: the same kept set per layer, row and KV head.

The reference reads the model's pre-RoPE queries, keys and values from the `qkv` projection (a forward
hook on a dense run), applies RoPE itself (rotation matrices from the config), and ranks the prompt's
tokens with plain loops and Python sets; litkv prefills the same prompt in chunks with
`mode="one-shot"` and compresses (`compress_all`, or `KVCaches.end_prefill` as `generate` calls it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from litkv import GPT, KVCacheConfig, generate
from litkv.kvcache.one_shot import compress_all

N, CHUNK, ROWS = 48, 7, 2
Kept = list[list[list[set[int]]]]  # [layer][row][KV head] -> kept positions


class Layer:
    """One layer's float64 tensors for one row: pre-RoPE queries `qp` `(H, N, D)`, post-RoPE queries `q`,
    keys `k` `(G, N, D)`, values `v`, causal softmax weights `a` `(H, N, N)`."""

    def __init__(self, qp: torch.Tensor, kp: torch.Tensor, v: torch.Tensor, rot: torch.Tensor) -> None:
        self.qp, self.v = qp, v
        self.q = torch.einsum("nde,hne->hnd", rot, qp)
        self.k = torch.einsum("nde,gne->gnd", rot, kp)
        self.h, self.g, self.d = qp.shape[0], kp.shape[0], qp.shape[2]
        logits = torch.einsum("hid,hjd->hij", self.q, self.k.repeat_interleave(self.h // self.g, 0)) / self.d**0.5
        causal = torch.ones(N, N, dtype=torch.bool).tril()
        self.a = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)

    def heads(self, g: int) -> range:
        return range(g * self.h // self.g, (g + 1) * self.h // self.g)


def rotation(p: int, n_elem: int, d: int, base: float) -> torch.Tensor:
    """`(d, d)` RoPE rotation at position `p`: pairs `(i, i + n_elem/2)` turned by `p base^(-2i/n_elem)`."""
    r = torch.eye(d, dtype=torch.float64)
    half = n_elem // 2
    for i in range(half):
        c, s = math.cos(p * base ** (-2 * i / n_elem)), math.sin(p * base ** (-2 * i / n_elem))
        r[i, i], r[i, i + half], r[i + half, i], r[i + half, i + half] = c, -s, s, c
    return r


def top(scores: dict[int, float], count: int, always: set[int]) -> set[int]:
    """`always` plus the `count - len(always)` best-scored others."""
    others = sorted((j for j in scores if j not in always), key=lambda j: -scores[j])
    return always | set(others[: count - len(always)])


# -- references, one (layer, row, KV head) at a time -----------------------------------------------


def ref_knorm(x: Layer, g: int, budget: int, o: dict) -> set[int]:
    return top({j: -float(x.k[g, j].norm()) for j in range(N)}, budget, set())


def ref_keydiff(x: Layer, g: int, budget: int, o: dict) -> set[int]:
    anchor = sum(x.k[g, j] / x.k[g, j].norm() for j in range(N)) / N
    cos = {j: float(x.k[g, j] @ anchor / (x.k[g, j].norm() * anchor.norm())) for j in range(N)}
    return top({j: -c for j, c in cos.items()}, budget, set())


def ref_last_recent(x: Layer, g: int, budget: int, o: dict) -> set[int]:
    return set(range(o["sinks"])) | set(range(N - (budget - o["sinks"]), N))


def ref_tova(x: Layer, g: int, budget: int, o: dict) -> set[int]:
    """The last query's attention, summed over all the layer's heads; its own token kept."""
    return top({j: float(x.a[:, N - 1, j].sum()) for j in range(N)}, budget, {N - 1})


def ref_h2o(x: Layer, g: int, budget: int, o: dict) -> set[int]:
    """Attention received from all queries, divided by the number of queries that see the token."""
    return top({j: float(x.a[list(x.heads(g)), :, j].sum()) / (N - j) for j in range(N)}, budget, set())


def ref_snapkv(x: Layer, g: int, budget: int, o: dict) -> set[int]:
    """Mean attention of the last `window` queries, summed over the group; average pool (zero padding) over
    the tokens before the window; the window kept."""
    w, half = o["window"], o["kernel"] // 2
    prefix = N - w
    att = [float(x.a[list(x.heads(g)), N - w :, j].sum()) / w for j in range(prefix)]
    pooled = {
        j: sum(att[i] for i in range(j - half, j + half + 1) if 0 <= i < prefix) / o["kernel"] for j in range(prefix)
    }
    return top(pooled, budget, set(range(prefix, N)))


def ea_scores(x: Layer, g: int, o: dict, n_elem: int, base: float) -> dict[int, float]:
    """Mean and covariance of the pre-RoPE queries at positions >= n_sink; averaged rotation of positions
    N..N+F-1; softmax over tokens >= n_sink of `(R mu).k / sqrt(d) + k^T R S R^T k / (2d)`, summed over the
    group, times `||v||`; the sinks score `inf`."""
    s, f, d = o["n_sink"], o["n_future_positions"], x.d
    rot = sum(rotation(N + i, n_elem, d, base) for i in range(f)) / f
    scores = dict.fromkeys(range(s, N), 0.0)
    for h in x.heads(g):
        qs = x.qp[h, s:]
        mu = qs.mean(dim=0)
        cov = (qs - mu).T @ (qs - mu) / qs.shape[0]
        mu, cov = rot @ mu, rot @ cov @ rot.T
        logits = torch.stack([mu @ x.k[g, j] / d**0.5 + x.k[g, j] @ cov @ x.k[g, j] / (2 * d) for j in range(s, N)])
        for j, p in zip(range(s, N), torch.softmax(logits, dim=0).tolist(), strict=True):
            scores[j] += p
    return {j: math.inf for j in range(s)} | {j: sc * float(x.v[g, j].norm()) for j, sc in scores.items()}


def ref_expected_attention(x: Layer, g: int, budget: int, o: dict, n_elem: int = 0, base: float = 0.0) -> set[int]:
    return top(ea_scores(x, g, o, n_elem, base), budget, set())


def ref_adakv(per_head: list[dict[int, float]], budget: int, alpha: float) -> list[set[int]]:
    """AdaKV: each head's `max(1, int(budget alpha))` best first, then the best of all heads' other tokens up
    to `budget x heads` in total."""
    safe = max(1, int(budget * alpha))
    chosen = [set(sorted(sc, key=lambda j: -sc[j])[:safe]) for sc in per_head]
    rest = sorted(((sc[j], h, j) for h, sc in enumerate(per_head) for j in sc if j not in chosen[h]), reverse=True)
    for _, h, j in rest[: budget * len(per_head) - sum(map(len, chosen))]:
        chosen[h].add(j)
    return chosen


CASES: dict[str, tuple[dict, Callable[..., set[int]]]] = {
    "knorm": ({}, ref_knorm),
    "keydiff": ({"recent": 0}, ref_keydiff),
    "last-recent": ({"sinks": 4}, ref_last_recent),
    "tova": ({"heads": "all"}, ref_tova),
    "h2o": ({"recent": 0, "normalize_scores": True}, ref_h2o),
    "snapkv": ({"recent": 0, "window": 8, "kernel": 5}, ref_snapkv),
    "expected-attention": ({"recent": 0, "n_sink": 4, "n_future_positions": 16}, ref_expected_attention),
}


# -- the runs --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[1.0, 0.5], ids=["full-rope", "half-rope"])
def model(request: pytest.FixtureRequest, tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(11, torch.float64, overrides={"rotary_percentage": request.param})


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 128, (ROWS, N), generator=torch.Generator().manual_seed(5))


@torch.inference_mode()
def layers_of(model: GPT, idx: torch.Tensor) -> list[list[Layer]]:
    """`[layer][row]` reference tensors from a dense run (pre-RoPE q/k/v read at each `qkv` projection)."""
    c = model.config
    outputs: list[torch.Tensor] = []
    hooks = [b.attn.qkv.register_forward_hook(lambda m, i, out: outputs.append(out)) for b in model.transformer.h]
    try:
        model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    rot = torch.stack([rotation(p, c.rope_n_elem, c.head_size, c.rope_base) for p in range(N)])
    layers = []
    for out in outputs:
        q, k, v = out.double().split((c.n_head * c.head_size, *[c.n_query_groups * c.head_size] * 2), dim=-1)
        shape = (ROWS, N, -1, c.head_size)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        layers.append([Layer(q[b], k[b], v[b], rot) for b in range(ROWS)])
    return layers


@torch.inference_mode()
def litkv_kept(model: GPT, idx: torch.Tensor, policy: str, options: dict, budget: int, decode: bool) -> Kept:
    """Chunked one-shot prefill, then `compress_all` (or `KVCaches.end_prefill` and one decode step)."""
    cfg = KVCacheConfig(
        policy, cache_length=N + 4, chunk_size=CHUNK, options={**options, "mode": "one-shot", "budget": budget}
    )
    with model.kv_caches_attached(cfg, batch_size=ROWS) as caches:
        pos = torch.arange(N).expand(ROWS, N)
        for start in range(0, N, CHUNK):
            model(idx[:, start : start + CHUNK], input_pos=pos[:, start : start + CHUNK])
        if decode:
            caches.end_prefill()
            model(idx[:, :1], input_pos=torch.full((ROWS, 1), N))
        else:
            compress_all(caches)
        return [[[{p for p in head.tolist() if 0 <= p < N} for head in row] for row in c.positions] for c in caches]


@pytest.mark.parametrize("budget", [12, 24])
@pytest.mark.parametrize("policy", list(CASES))
def test_one_shot_keeps_the_reference_set(model: GPT, prompt: torch.Tensor, policy: str, budget: int) -> None:
    options, reference = CASES[policy]
    c = model.config
    extra = {"n_elem": c.rope_n_elem, "base": float(c.rope_base)} if policy == "expected-attention" else {}
    expected = [
        [[reference(x, g, budget, options, **extra) for g in range(c.n_query_groups)] for x in per_row]
        for per_row in layers_of(model, prompt)
    ]
    got = litkv_kept(model, prompt, policy, options, budget, decode=budget == 12)
    for layer, (want_l, got_l) in enumerate(zip(expected, got, strict=True)):
        for row, (want_r, got_r) in enumerate(zip(want_l, got_l, strict=True)):
            for g, (want, have) in enumerate(zip(want_r, got_r, strict=True)):
                assert have == want, (
                    f"layer {layer} row {row} head {g}: only litkv {have - want}, only ref {want - have}"
                )


@pytest.mark.parametrize("budget", [6, 20])
def test_adakv_expected_attention_keeps_the_reference_set(model: GPT, prompt: torch.Tensor, budget: int) -> None:
    """AdaKV allocation over Expected Attention's scores (alpha 0.2): the reference's ragged kept sets."""
    options = {**CASES["expected-attention"][0], "alpha_safeguard": 0.2}
    c = model.config
    layers = layers_of(model, prompt)
    got = litkv_kept(model, prompt, "litkv.kvcache.adakv:AdaKVExpectedAttention", options, budget, decode=False)
    sizes = set()
    for layer, per_row in enumerate(layers):
        for row, x in enumerate(per_row):
            scores = [ea_scores(x, g, options, c.rope_n_elem, float(c.rope_base)) for g in range(c.n_query_groups)]
            want = ref_adakv(scores, budget, 0.2)
            assert got[layer][row] == want, f"layer {layer} row {row}"
            sizes |= {len(k) for k in want}
    assert len(sizes) > 1  # the heads did get different budgets


def test_adakv_needs_one_shot() -> None:
    with pytest.raises(ValueError, match="mode must be 'one-shot'"):
        KVCacheConfig("litkv.kvcache.adakv:AdaKVKNorm", cache_length=16, options={"mode": "continuous"})
    with pytest.raises(ValueError, match="mode='one-shot' needs budget"):  # one-shot by default
        KVCacheConfig("litkv.kvcache.adakv:AdaKVKNorm", cache_length=16)
    with pytest.raises(ValueError, match="alpha_safeguard must be in"):
        options = dict(mode="one-shot", budget=4, alpha_safeguard=1.5)
        KVCacheConfig("litkv.kvcache.adakv:AdaKVKNorm", cache_length=16, options=options)


# -- one-shot mechanics ----------------------------------------------------------------------------


def _prefill(model: GPT, idx: torch.Tensor, cfg: KVCacheConfig) -> list:
    caches = model.build_kv_caches(cfg, batch_size=idx.shape[0])
    model.set_kv_caches(caches)
    pos = torch.arange(idx.shape[1]).expand(idx.shape[0], -1)
    for start in range(0, idx.shape[1], CHUNK):
        model(idx[:, start : start + CHUNK], input_pos=pos[:, start : start + CHUNK])
    return caches


@pytest.mark.parametrize("storage", ["float", "int4"])
@torch.inference_mode()
def test_one_shot_decodes_without_eviction_until_full(model: GPT, prompt: torch.Tensor, storage: str) -> None:
    """After the compression to 12 of 48 tokens, 4 decode steps fill the free slots (nothing evicted); once
    the 16 slots are full, the policy evicts as in continuous mode."""
    options = {"mode": "one-shot", "budget": 12}
    cfg = KVCacheConfig("knorm", cache_length=N, chunk_size=CHUNK, storage=storage, quant_group_size=8, options=options)
    try:
        caches = _prefill(model, prompt, cfg)
        assert all(not c.one_shot.compressed and c.num_filled == N for c in caches)
        compress_all(caches)
        kept = [c.positions.clone() for c in caches]
        assert all(c.one_shot.compressed and int((c.positions >= 0).sum(dim=2).min()) == 12 for c in caches)
        for step in range(N - 12):
            model(prompt[:, :1], input_pos=torch.full((ROWS, 1), N + step))
        for c, before in zip(caches, kept, strict=True):
            held = c.positions
            assert bool((held[..., :12] == before[..., :12]).all())  # the compressed prompt stays in place
            new = held[..., 12:].sort(dim=2).values  # int4 storage places them in any free slot
            assert new.tolist() == torch.arange(N, 2 * N - 12).expand_as(new).tolist()
        model(prompt[:, :1], input_pos=torch.full((ROWS, 1), 2 * N - 12))
        assert all(int((c.positions >= 0).sum(dim=2).min()) == N for c in caches)  # full: evicting
    finally:
        model.set_kv_caches(None)


@torch.inference_mode()
def test_one_shot_prompt_must_fit(model: GPT, prompt: torch.Tensor) -> None:
    cfg = KVCacheConfig("h2o", cache_length=N - 8, chunk_size=CHUNK, options={"mode": "one-shot", "budget": 8})
    try:
        with pytest.raises(ValueError, match="keeps the whole prompt until it is compressed"):
            _prefill(model, prompt, cfg)
    finally:
        model.set_kv_caches(None)


@torch.inference_mode()
def test_compress_is_for_one_shot_only_and_state_keeps_the_flag(model: GPT, prompt: torch.Tensor) -> None:
    try:
        continuous = _prefill(model, prompt, KVCacheConfig("knorm", cache_length=N, chunk_size=CHUNK))
        assert all(c.one_shot is None for c in continuous)  # nothing to compress
        cfg = KVCacheConfig("snapkv", cache_length=N, chunk_size=CHUNK, options={"mode": "one-shot", "budget": 16})
        cache = _prefill(model, prompt, cfg)[0]
        before = {k: v.clone() for k, v in cache.state_tensors().items()}
        cache.one_shot.compress()
        after = {k: v.clone() for k, v in cache.state_tensors().items()}
        cache.load_state_tensors(before, N)
        assert not cache.one_shot.compressed and cache.positions.tolist() == before["positions"].tolist()
        cache.load_state_tensors(after, 16)
        assert cache.one_shot.compressed and cache.positions.tolist() == after["positions"].tolist()
    finally:
        model.set_kv_caches(None)


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv", "expected-attention", "last-recent"])
@torch.inference_mode()
def test_one_shot_left_padded_batch_equals_each_prompt_alone(model: GPT, policy: str) -> None:
    """Prompts of 13, 30 and 41 tokens, left-padded, compressed to 10 at the first decode step of `generate`:
    each row's greedy tokens are those of its prompt alone."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (13, 30, 41)]
    options = {"sinks": 2} if policy == "last-recent" else {"sinks": 1, "recent": 2}
    options |= {"window": 4} if policy == "snapkv" else {}
    cfg = KVCacheConfig(policy, cache_length=N, chunk_size=CHUNK, options={**options, "mode": "one-shot", "budget": 10})
    batched = generate(model, prompts, max_new_tokens=6, kv_cache=cfg)
    for row, prompt in enumerate(prompts):
        assert batched[row].tolist() == generate(model, [prompt], 6, cfg)[0].tolist(), f"row {row}"
