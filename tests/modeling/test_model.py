"""Model features: block hooks, skipping the LM head, per-layer caches, and the policy registry.

litkv runs in float32; comparisons with the float64 oracle (and between two float32 computations that
sum in different orders) are bounded by `rounding_bound`, relative to the compared values' magnitude.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import (
    MaskFn,
    band_mask,
    causal_mask,
    forward_depth,
    max_diff,
    random_tokens,
    reference_forward,
    rounding_bound,
)

from litkv import GPT, KVCache, KVCacheConfig, forward_chunked, register_kv_cache
from litkv.kvcache import Candidates, DenseKVCache, LastRecentKVCache, known_policies
from litkv.kvcache import registry as registry_module
from litkv.kvcache.config import ChunkPlan

T = 24


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(8, overrides={"n_layer": 3})


def _idx(batch: int = 2, length: int = T) -> torch.Tensor:
    return random_tokens(batch, length, seed=9)


def _bound(model: GPT, expected: torch.Tensor) -> float:
    """Float32 rounding bound for a forward of `model` over `T` tokens whose result is `expected`."""
    return rounding_bound(expected, forward_depth(model.config, T))


# -- block hook --------------------------------------------------------------------------------


@torch.inference_mode()
def test_block_hook_observes_block_inputs(model: GPT) -> None:
    idx = _idx()
    seen: list[tuple[int, torch.Tensor]] = []
    model(idx, block_hook=lambda i, x: seen.append((i, x.clone())))
    assert [i for i, _ in seen] == [0, 1, 2]
    assert torch.equal(seen[0][1], model.transformer.wte(idx))
    expected = reference_forward(model, idx).block_inputs
    for (_, x), ref in zip(seen, expected, strict=True):
        assert max_diff(x, ref) <= _bound(model, ref)


@torch.inference_mode()
def test_block_hook_returning_its_input_changes_nothing(model: GPT) -> None:
    idx = _idx()
    plain = model(idx)
    assert torch.equal(model(idx, block_hook=lambda i, x: x), plain)
    assert torch.equal(model(idx, block_hook=lambda i, x: None), plain)


@pytest.mark.parametrize("layer", [0, 2])
@torch.inference_mode()
def test_block_hook_replaces_block_input(model: GPT, layer: int) -> None:
    idx = _idx()

    def zero(i: int, x: torch.Tensor) -> torch.Tensor | None:
        return torch.zeros_like(x) if i == layer else None

    ours = model(idx, block_hook=zero)
    expected = reference_forward(model, idx, hook=zero).logits
    assert max_diff(ours, expected) <= _bound(model, expected)
    assert max_diff(ours, model(idx)) > 1e-2
    if layer == 0:  # bias-free RMSNorm blocks map an all-zero stream to zero: logits are exactly 0
        assert not ours.any()


@torch.inference_mode()
def test_block_hook_through_the_cache(model: GPT) -> None:
    """With caches the hook runs per chunk, sees that chunk's inputs only, and can replace them."""
    idx = _idx()
    seen_lengths: list[int] = []

    def halve(i: int, x: torch.Tensor) -> torch.Tensor | None:
        return x * 0.5 if i == 1 else None

    def halve_and_record(i: int, x: torch.Tensor) -> torch.Tensor | None:
        seen_lengths.append(x.shape[1])
        return halve(i, x)

    kv_cache = KVCacheConfig(policy="dense", cache_length=T, chunk_size=5, prefill_length=5)
    bounds = ChunkPlan.of(kv_cache).bounds(T)
    model.set_kv_caches(model.build_kv_caches(kv_cache, batch_size=2))
    try:
        chunks = [model(idx[:, s:e], torch.arange(s, e).expand(2, -1), block_hook=halve_and_record) for s, e in bounds]
    finally:
        model.set_kv_caches(None)
    assert seen_lengths == [e - s for s, e in bounds for _ in range(model.config.n_layer)]
    expected = reference_forward(model, idx, hook=halve).logits
    assert max_diff(torch.cat(chunks, dim=1), expected) <= _bound(model, expected)


# -- skipping the LM head ----------------------------------------------------------------------


@torch.inference_mode()
def test_lm_head_false_returns_final_hidden_states(model: GPT) -> None:
    idx = _idx()
    hidden = model(idx, lm_head=False)
    assert hidden.shape == (2, T, model.config.n_embd)
    expected = reference_forward(model, idx).hidden
    assert max_diff(hidden, expected) <= _bound(model, expected)
    logits = model(idx)
    assert torch.equal(model.logits(hidden), logits)
    # one matrix product over n_embd from the same hidden states
    assert max_diff(model.lm_head(hidden), logits) <= rounding_bound(logits, model.config.n_embd)


@torch.inference_mode()
def test_lm_head_false_with_final_softcapping(tiny_model: Callable[..., GPT]) -> None:
    model = tiny_model(1, config="gemma-2-2b", overrides={"final_logit_softcapping": 3.0})
    idx = _idx()
    hidden = model(idx, lm_head=False)
    logits = model(idx)
    assert logits.abs().max() <= 3.0
    # one matrix product over n_embd, then tanh, from the same hidden states
    capped = torch.tanh(model.lm_head(hidden) / 3.0) * 3.0
    assert max_diff(capped, logits) <= rounding_bound(logits, model.config.n_embd + 1)
    assert torch.equal(model.logits(hidden), logits)


@torch.inference_mode()
def test_lm_head_false_through_the_cache(model: GPT) -> None:
    idx = _idx()
    model.set_kv_caches(model.build_kv_caches(KVCacheConfig(policy="dense", cache_length=T, chunk_size=T), 2))
    try:
        hidden = model(idx, torch.arange(T).expand(2, -1), lm_head=False)
    finally:
        model.set_kv_caches(None)
    expected = model(idx, lm_head=False)
    assert max_diff(hidden, expected) <= _bound(model, expected)


# -- different caches per layer ----------------------------------------------------------------


@torch.inference_mode()
def test_each_layer_its_own_cache(model: GPT) -> None:
    idx = _idx()
    configs = [
        KVCacheConfig(policy="dense", cache_length=T, chunk_size=1, prefill_length=1),
        KVCacheConfig(policy="last-recent", cache_length=5, chunk_size=1, prefill_length=1),
        KVCacheConfig(policy="last-recent", cache_length=9, chunk_size=1, prefill_length=1, options=dict(sinks=2)),
    ]
    caches = model.build_kv_caches(configs, batch_size=2)
    assert [type(c.policy) for c in caches] == [DenseKVCache, LastRecentKVCache, LastRecentKVCache]
    assert [c.cache_length for c in caches] == [T, 5, 9]
    expected = reference_forward(model, idx, [causal_mask, band_mask(5), band_mask(9, sinks=2)]).logits
    assert max_diff(forward_chunked(model, idx, configs), expected) <= _bound(model, expected)


# -- registry ----------------------------------------------------------------------------------


class KeepFirstKVCache(KVCache):
    """Test policy: keeps the first `cache_length` tokens, drops every later one (after it attended)."""

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        positions, t = candidates.positions, candidates.num_new
        score = positions.masked_fill(positions < 0, torch.iinfo(torch.long).max)
        return torch.topk(score, t, dim=2).indices


def _keep_first_mask(cache_length: int) -> MaskFn:
    return lambda q, k: (k == q) | ((k < cache_length) & (k <= q))


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations in a test are undone afterwards."""
    monkeypatch.setattr(registry_module, "_REGISTRY", registry_module._REGISTRY.copy())


@torch.inference_mode()
def test_register_and_create_by_name(model: GPT, registry: None) -> None:
    assert "test-keep-first" not in known_policies()
    assert register_kv_cache("test-keep-first")(KeepFirstKVCache) is KeepFirstKVCache
    assert "test-keep-first" in known_policies()
    kv_cache = KVCacheConfig(policy="test-keep-first", cache_length=6, chunk_size=1, prefill_length=1)
    assert all(type(c.policy) is KeepFirstKVCache for c in model.build_kv_caches(kv_cache, 2))
    idx = _idx()
    expected = reference_forward(model, idx, _keep_first_mask(6)).logits
    assert max_diff(forward_chunked(model, idx, kv_cache), expected) <= _bound(model, expected)


@torch.inference_mode()
def test_create_by_module_path(model: GPT) -> None:
    idx = _idx()
    path = f"{KeepFirstKVCache.__module__}:KeepFirstKVCache"
    kv_cache = KVCacheConfig(policy=path, cache_length=6, chunk_size=1, prefill_length=1)
    expected = reference_forward(model, idx, _keep_first_mask(6)).logits
    assert max_diff(forward_chunked(model, idx, kv_cache), expected) <= _bound(model, expected)
    by_path = KVCacheConfig(policy="litkv.kvcache.last_recent:LastRecentKVCache", cache_length=6, chunk_size=3)
    by_name = KVCacheConfig(policy="last-recent", cache_length=6, chunk_size=3)
    assert torch.equal(forward_chunked(model, idx, by_path), forward_chunked(model, idx, by_name))


def test_register_rejects_bad_input(registry: None) -> None:
    with pytest.raises(ValueError, match=r"without ':', got 'a:b'"):
        register_kv_cache("a:b")
    with pytest.raises(TypeError, match=r"expects a KVCache subclass, got <class 'int'>"):
        register_kv_cache("int-cache")(int)  # type: ignore[arg-type]
