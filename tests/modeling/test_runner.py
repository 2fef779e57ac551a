"""Chunked equals one-shot: `forward_chunked` through a dense cache equals the plain `model(idx)`.

Both sides run in float64 (`float64_model`; the caches take the model's dtype), so that the two summation orders
differ by float64 rounding only: `rounding_bound(..., torch.float64)` is about 1e-13 of the logits'
magnitude, far tighter than any float32 tolerance and independent of the CPU's vector width.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import forward_depth, max_diff, random_tokens, rounding_bound

from litkv import GPT, KVCacheConfig, forward_chunked
from litkv.kvcache.config import ChunkPlan

T = 40
# Soft-capping runs litkv's eager attention, whose scores are float32 even in a float64 model
# (litkv/modeling/attention.py, `_attend_eager`): those models are bounded by float32's rounding.
FLOAT32_SCORES = {"gemma2"}


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "pythia", "smollm2"])
def model(request: pytest.FixtureRequest, tiny_model: Callable[..., GPT]) -> GPT:
    model = tiny_model(5, torch.float64, arch=request.param)
    model.rounding_dtype = torch.float32 if request.param in FLOAT32_SCORES else torch.float64
    return model


def _bound(model: GPT, expected: torch.Tensor, keys: int) -> float:
    """Rounding bound for logits of `model` whose attention sums over at most `keys` keys."""
    return rounding_bound(expected, forward_depth(model.config, keys), model.rounding_dtype)


def _idx(batch: int = 2, length: int = T) -> torch.Tensor:
    return random_tokens(batch, length, seed=7)


@pytest.mark.parametrize("chunk", [1, 3, 17, T])
@pytest.mark.parametrize("cache_length", [T, 64])
@torch.inference_mode()
def test_chunked_equals_one_shot(model: GPT, chunk: int, cache_length: int) -> None:
    idx = _idx()
    kv_cache = KVCacheConfig(policy="dense", cache_length=cache_length, chunk_size=chunk, prefill_length=chunk)
    expected = model(idx)
    chunked = forward_chunked(model, idx, kv_cache)
    assert chunked.dtype == expected.dtype == torch.float64
    assert max_diff(chunked, expected) <= _bound(model, expected, cache_length + chunk)
    assert model.kv_caches == [None] * model.config.n_layer  # caches detached afterwards


@torch.inference_mode()
def test_prefill_then_chunks(model: GPT) -> None:
    """A long first chunk followed by shorter ones (and a last partial chunk)."""
    idx = _idx()
    kv_cache = KVCacheConfig(policy="dense", cache_length=T, chunk_size=6, prefill_length=13)
    assert ChunkPlan.of(kv_cache).bounds(T)[:2] == [(0, 13), (13, 19)]
    expected = model(idx)
    assert max_diff(forward_chunked(model, idx, kv_cache), expected) <= _bound(model, expected, T + 13)


def test_chunked_gradients_equal_one_shot(tiny_model: Callable[..., GPT]) -> None:
    """`forward_chunked` is differentiable with plain autograd, with the one-shot gradients."""
    model = tiny_model(2, torch.float64)
    idx = _idx(length=20)
    target = torch.randn(2, 20, 128, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kv_cache = KVCacheConfig(policy="dense", cache_length=20, chunk_size=3, prefill_length=3)
    grads = []
    for run in (lambda: model(idx), lambda: forward_chunked(model, idx, kv_cache)):
        model.zero_grad()
        (run() * target).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert grad.abs().max() > 0, name
        # the backward pass retraces the forward: twice its depth
        depth = 2 * forward_depth(model.config, 20 + 3)
        assert max_diff(grads[1][name], grad) <= rounding_bound(grad, depth, torch.float64), name
