"""`kvzip` (litkv/kvcache/kvzip.py, litkv/inference/kvzip_reconstruction.py) against a float64 brute-force
reconstruction pass: each row alone, the whole context + the repeat call through the plain model forward
(no cache), every attention weight of the scored subset written out per (layer, head, query)."""

from __future__ import annotations

import math

import pytest
import torch
from kvzip_reference import brute_scores

from litkv.inference.generate import generate, pad_prompts
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_compress, kvzip_score
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.modeling.model import GPT
from litkv.modeling.runner import run_chunks

REPEAT = RepeatPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10, 11), overlap=3)
PREFIX = 3
N_SINK = 2
CHUNK = 7
LENGTHS = (23, 17)


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(12, 128, (n,), generator=gen) for n in LENGTHS]


def _config(plus: bool, layerwise: bool = False, budget: int = 6) -> KVCacheConfig:
    options = {"mode": "one-shot", "budget": budget, "n_sink": N_SINK, "chunk_size": CHUNK}
    options.update(kvzip_plus=plus, layerwise=layerwise)
    return KVCacheConfig("kvzip", cache_length=max(LENGTHS) + 4, chunk_size=5, options=options)


def _prefill(model: GPT, prompts: list[torch.Tensor], cfg: KVCacheConfig) -> None:
    idx, pos = pad_prompts(prompts, torch.device("cpu"))
    run_chunks(model, idx, pos, ChunkPlan.of(cfg), lm_head=False, last_only=True)


def _brute_scores(model: GPT, ctx: list[int], plus: bool) -> torch.Tensor:
    return brute_scores(model, ctx, plus, REPEAT, PREFIX, N_SINK, CHUNK)


def _cache_scores(model: GPT, row: int, n: int) -> torch.Tensor:
    """`(n_layer, G, n)` the caches' scores of row `row` by position."""
    out = []
    for cache in model.caches:
        pos = cache.positions[row]  # (G, L)
        per = torch.full((pos.shape[0], n), float("nan"), dtype=torch.float64)
        for g in range(pos.shape[0]):
            held = pos[g] >= 0
            per[g, pos[g][held]] = cache.policy.kvzip_scores[row, g][held].double()
        out.append(per)
    return torch.stack(out)


@pytest.mark.parametrize("plus", [False, True], ids=["kvzip", "kvzip_plus"])
def test_scores_equal_brute_force_reconstruction(tiny_model, plus: bool) -> None:
    model = tiny_model(5, torch.float64)
    prompts = _prompts()
    cfg = _config(plus)
    with torch.inference_mode(), model.kv_caches_attached(cfg, len(prompts)):
        _prefill(model, prompts, cfg)
        last = model.caches.last_pos.clone()
        kvzip_score(model, prompts, REPEAT, prefix_length=PREFIX)
        assert torch.equal(model.caches.last_pos, last)
        got = [_cache_scores(model, r, len(p)) for r, p in enumerate(prompts)]
    for r, p in enumerate(prompts):
        expected = _brute_scores(model, p.tolist(), plus)
        # the scores are float32 (computed in float64 here): compare to float32 rounding
        torch.testing.assert_close(got[r], expected, rtol=1e-6, atol=1e-9)
        assert (expected[..., PREFIX:] > 0).all()  # every context position was scored


def _kept(model: GPT, row: int) -> list[list[set[int]]]:
    return [[set(p[p >= 0].tolist()) for p in cache.positions[row]] for cache in model.caches]


@pytest.mark.parametrize("layerwise", [False, True], ids=["across_layers", "layerwise"])
def test_kept_sets_equal_brute_force_selection(tiny_model, layerwise: bool) -> None:
    model = tiny_model(6, torch.float64)
    prompts = _prompts()
    budget = 6
    cfg = _config(False, layerwise, budget)
    with torch.inference_mode(), model.kv_caches_attached(cfg, len(prompts)):
        _prefill(model, prompts, cfg)
        kvzip_compress(model, prompts, REPEAT, prefix_length=PREFIX)
        kept = [_kept(model, r) for r in range(len(prompts))]
        assert all(c.one_shot.compressed for c in model.caches)
    c = model.config
    for r, p in enumerate(prompts):
        scores = _brute_scores(model, p.tolist(), False)  # (n_layer, G, n)
        scores[..., :N_SINK] = math.inf  # kvpress 0.5.5: the sinks are kept first
        n = len(p)
        entries = [
            (float(scores[layer, g, i]), layer, g, i)
            for layer in range(c.n_layer)
            for g in range(c.n_query_groups)
            for i in range(n)
        ]
        expected: list[list[set[int]]] = [[set() for _ in range(c.n_query_groups)] for _ in range(c.n_layer)]
        if layerwise:
            for layer in range(c.n_layer):
                mine = sorted((e for e in entries if e[1] == layer), reverse=True)[: budget * c.n_query_groups]
                for _, layer_, g, i in mine:
                    expected[layer_][g].add(i)
        else:
            for _, layer_, g, i in sorted(entries, reverse=True)[: budget * c.n_query_groups * c.n_layer]:
                expected[layer_][g].add(i)
        assert kept[r] == expected
        total = sum(len(s) for layer in kept[r] for s in layer)
        assert total == budget * c.n_query_groups * c.n_layer


def test_decode_after_compression_attends_the_kept_pairs_only(tiny_model) -> None:
    """After `kvzip_compress`, decoding continues through the compacted caches: the next logits equal a
    dense forward in which every evicted pair is masked out (float64, per layer and head)."""
    model = tiny_model(7, torch.float64)
    prompts = _prompts()[:1]
    cfg = _config(False, budget=5)
    with torch.inference_mode(), model.kv_caches_attached(cfg, 1):
        _prefill(model, prompts, cfg)
        kvzip_compress(model, prompts, REPEAT, prefix_length=PREFIX)
        kept = _kept(model, 0)
        n = len(prompts[0])
        token = torch.tensor([[17]])
        logits = model(token, torch.tensor([[n]]))[0, -1]
    # reference: the whole sequence at once, each layer's keys outside its kept set masked for the last query
    seq = torch.cat([prompts[0], token[0]])[None]
    masks = {}
    for layer, heads in enumerate(kept):
        allowed = torch.zeros(len(heads), n + 1, dtype=torch.bool)
        for g, held in enumerate(heads):
            allowed[g, sorted(held)] = True
        allowed[:, n] = True
        masks[layer] = allowed
    ref = _masked_last_logits(model, seq, masks)
    torch.testing.assert_close(logits, ref, rtol=1e-9, atol=1e-9)


def _masked_last_logits(model: GPT, seq: torch.Tensor, masks: dict[int, torch.Tensor]) -> torch.Tensor:
    """Logits of the last token when its query attends only the allowed keys `(G, T)` of each layer
    (earlier tokens attend causally, as in the prefill)."""
    c = model.config
    t = seq.shape[1]
    q_per = c.n_head // c.n_query_groups
    cos, sin = model.rope(torch.arange(t)[None])
    x = model.transformer.wte(seq)
    for layer, block in enumerate(model.transformer.h):
        xn = block.norm_1(x)
        q, k, v = block.attn._qkv(xn, cos, sin)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        heads = []
        for h in range(c.n_head):
            g = h // q_per
            allowed = causal.clone()
            allowed[-1] = masks[layer][g]
            logits = (q[0, h] @ k[0, g].T) / math.sqrt(c.head_size)
            w = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
            heads.append(w @ v[0, g])
        y = torch.stack(heads, dim=1).reshape(1, t, -1)
        x = x + block.attn.proj(y)
        x = x + block.mlp(block.norm_2(x))
    return model.logits(model.transformer.ln_f(x))[0, -1]


def test_generate_without_the_reconstruction_prompt_is_a_clear_error(tiny_model) -> None:
    model = tiny_model(5)
    with pytest.raises(ValueError, match=r"kvzip needs its reconstruction prompt: generate\(\.\.\., kvzip_repeat="):
        generate(model, _prompts(), 2, _config(False))


def test_continuous_mode_is_refused_and_one_shot_is_the_default() -> None:
    """kvzip without a reconstruction pass would keep the newest tokens under KVzip's name: refused."""
    with pytest.raises(ValueError, match=r"^kvzip has no mode='continuous': .* use mode='one-shot'"):
        KVCacheConfig("kvzip", cache_length=8, options={"mode": "continuous"})
    options = KVCacheConfig("kvzip", cache_length=8).policy_options
    assert options.mode == "one-shot" and options.budget is None  # the cache keeps cache_length
    with pytest.raises(ValueError, match="budget must be <= cache_length"):
        KVCacheConfig("kvzip", cache_length=8, options={"budget": 9})


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_compress_and_decode_outside_inference_mode(tiny_model, mode: str) -> None:
    """`kvzip_compress` and the decode after it work whether the caller runs under `torch.no_grad()` or
    `torch.inference_mode()`, with the same kept pairs and logits (the reconstruction's scores live in the
    caches, so they must be tensors the caller's mode can write in place)."""
    prompts = _prompts()
    cfg = _config(True, budget=5)
    results = []
    for context in (torch.inference_mode, torch.no_grad if mode == "no_grad" else torch.inference_mode):
        model = tiny_model(7, torch.float64)
        with context(), model.kv_caches_attached(cfg, len(prompts)):
            _prefill(model, prompts, cfg)
            kvzip_compress(model, prompts, REPEAT, prefix_length=PREFIX)
            n = max(LENGTHS)
            logits = model(torch.tensor([[17], [18]]), torch.tensor([[n], [n]]))
            results.append(([_kept(model, r) for r in range(len(prompts))], logits.clone()))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
