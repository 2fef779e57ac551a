"""qh2o (Q-Hitter): quantisation-aware H2O scores, decided per row."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import litkv
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.h2o import H2OKVCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.qh2o import QuantizedH2OKVCache
from litkv.kvcache.quantized import QuantizedStorage
from litkv.kvcache.storage import CacheShape
from litkv.modeling.attention import attend, build_mask

HS = 8
OUTLIER = torch.tensor([8.0, 0.3, -0.2, 0.1, 0.7, -0.5, 0.2, 0.4])  # one int4 group: coarse steps


def _hand_made(outlier_token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Four tokens, one query head. Keys `c * 1` make attention fall off from token 0 to token 3 and are
    exactly representable; values are constant except the outlier vector of `outlier_token[b]`."""
    b = outlier_token.shape[0]
    c = torch.tensor([1.0, 0.5, 0.375, 0.0])
    keys = (c[:, None] * torch.ones(HS)).expand(b, 1, 4, HS).clone()
    values = torch.tensor([0.5, 0.25, 0.25, 0.0])[:, None].expand(4, HS).repeat(b, 1, 1, 1)
    for row, token in enumerate(outlier_token.tolist()):
        values[row, 0, token] = OUTLIER
    queries = torch.ones(b, 1, 4, HS)
    return queries, keys, values, torch.arange(4).expand(b, 4)


def _run(cls: type, config: KVCacheConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
    """Prefill tokens 0-2, decode token 3 (layer level); returns the cache."""
    b, g, n, hs = k.shape
    cache = SlotMachine(cls, config, CacheShape(b, g, config.cache_length, hs, hs), None, torch.float32)
    for start, end in ChunkPlan.of(config).bounds(n):
        ps = pos[:, start:end]
        keys, values, k_pos = cache.attend_inputs(k[:, :, start:end], v[:, :, start:end], ps)
        mask = build_mask(ps, k_pos)
        _, w = attend(q[:, :, start:end], keys, values, mask, 1 / math.sqrt(hs), need_weights=True, query_valid=ps >= 0)
        cache.evict_and_store(w)
    return cache


def _kept(cache: H2OKVCache) -> list[list[int]]:
    return [sorted(p for p in row[0].tolist() if p >= 0) for row in cache.positions]


def _config(weight: float = 0.5) -> KVCacheConfig:
    return KVCacheConfig(
        "qh2o", cache_length=3, chunk_size=1, storage="int4", quant_group_size=HS,
        options=dict(recent=1, quant_error_weight=weight),
    )  # fmt: skip


def test_token_with_large_quantisation_error_is_evicted_where_h2o_keeps_it() -> None:
    # row 0: the outlier is on token 1 (second heaviest hitter); row 1: on token 2 (lightest)
    q, k, v, pos = _hand_made(torch.tensor([1, 2]))
    h2o = _run(H2OKVCache, _config(), q, k, v, pos)
    qh2o = _run(QuantizedH2OKVCache, _config(), q, k, v, pos)
    scores = h2o.policy.slot_scores()
    assert float(scores[0, 0, 1]) > float(scores[0, 0, 2])  # by attention, token 1 beats token 2 ...
    assert _kept(h2o) == [[0, 1, 3], [0, 1, 3]]  # ... so plain H2O (same int4 storage) keeps it
    assert _kept(qh2o) == [[0, 2, 3], [0, 1, 3]]  # qh2o drops the badly quantised token, per row
    assert float(qh2o.policy.quant_errors.max()) < 1e-6  # what is left is exactly representable
    # the penalty is what decides: without it, qh2o is H2O and keeps the outlier with its error
    plain = _run(QuantizedH2OKVCache, _config(weight=0.0), q, k, v, pos)
    assert _kept(plain) == _kept(h2o)
    outlier_slot = plain.positions[0, 0].tolist().index(1)
    assert float(plain.policy.quant_errors[0, 0, outlier_slot]) > 0.01


def test_per_slot_errors_follow_tokens_through_evictions() -> None:
    """`quant_errors` of each slot equals the round-trip error of the token it holds (read back from storage)."""
    gen = torch.Generator().manual_seed(0)
    b, g, n, heads = 2, 2, 30, 4
    q = torch.randn(b, heads, n, HS, generator=gen)
    k = torch.randn(b, g, n, HS, generator=gen) * torch.linspace(0.1, 3, n)[:, None]
    v = torch.randn(b, g, n, HS, generator=gen)
    pos = torch.arange(n).expand(b, n).clone()
    pos[1, :4] = -1
    config = KVCacheConfig("qh2o", cache_length=6, chunk_size=2, storage="int4", quant_group_size=4)
    cache = _run(QuantizedH2OKVCache, config, q, k, v, pos)
    keys, values = cache.storage.read()
    for row in range(b):
        for head in range(g):
            for slot, p in enumerate(cache.positions[row, head].tolist()):
                kk, vv = k[row, head, p], v[row, head, p]  # position p is sequence index p
                expected = (keys[row, head, slot] - kk).square().mean() + (values[row, head, slot] - vv).square().mean()
                assert float(cache.policy.quant_errors[row, head, slot]) == pytest.approx(float(expected), rel=1e-5)


def test_zero_weight_decides_like_h2o_on_random_data() -> None:
    """With quant_error_weight=0 the normalised score ranks like the H2O score: same tokens kept."""
    gen = torch.Generator().manual_seed(1)
    b, g, n, heads = 2, 2, 40, 8
    q, k, v = (torch.randn(b, h, n, HS, generator=gen) for h in (heads, g, g))
    pos = torch.arange(n).expand(b, n)
    base = dict(cache_length=8, chunk_size=3, storage="int8", quant_group_size=HS)
    h2o = _run(H2OKVCache, KVCacheConfig("h2o", options=dict(normalize_scores=True), **base), q, k, v, pos)
    options = dict(normalize_scores=True, quant_error_weight=0.0)
    qh2o = _run(QuantizedH2OKVCache, KVCacheConfig("qh2o", options=options, **base), q, k, v, pos)
    assert torch.equal(h2o.positions.sort(dim=2).values, qh2o.positions.sort(dim=2).values)
    options = dict(normalize_scores=True, quant_error_weight=5.0)
    heavy = _run(QuantizedH2OKVCache, KVCacheConfig("qh2o", options=options, **base), q, k, v, pos)
    assert not torch.equal(h2o.positions.sort(dim=2).values, heavy.positions.sort(dim=2).values)


def test_float_storage_defaults_to_int4_with_a_warning() -> None:
    config = KVCacheConfig("qh2o", cache_length=8, chunk_size=2)
    with pytest.warns(UserWarning, match="int4"):
        cache = SlotMachine(QuantizedH2OKVCache, config, CacheShape(1, 2, 8, 16, 16), None, torch.float32)
    assert isinstance(cache.storage, QuantizedStorage) and cache.storage.bits == 4
    assert cache.config.storage == "int4" and config.storage == "float"  # the caller's config is untouched


def test_qh2o_bytes_at_most_0_3_of_h2o() -> None:
    shape = CacheShape(1, 3, 512, 64, 64)
    for dtype in (torch.float32, torch.bfloat16):
        h2o = SlotMachine(H2OKVCache, KVCacheConfig("h2o", cache_length=512), shape, None, dtype)
        qh2o = SlotMachine(
            QuantizedH2OKVCache,
            KVCacheConfig("qh2o", cache_length=512, storage="int4", quant_group_size=64),
            shape,
            None,
            dtype,
        )
        assert qh2o.nbytes() <= 0.3 * h2o.nbytes()


def test_qh2o_generates(tiny_model: Callable[..., litkv.GPT]) -> None:
    torch.manual_seed(0)
    model = tiny_model(
        0, config=litkv.Config(n_layer=2, n_head=8, n_query_groups=2, n_embd=64, block_size=128, vocab_size=96)
    )
    prompts = [torch.randint(0, 96, (25,)), torch.randint(0, 96, (9,))]
    config = KVCacheConfig("qh2o", cache_length=8, chunk_size=4, storage="int8", options=dict(sinks=1))
    out = litkv.generate(model, prompts, 6, config)
    assert [len(o) for o in out] == [6, 6]
