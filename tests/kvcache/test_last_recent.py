"""`last-recent` against brute-force oracles: an independent float64 forward with an explicit mask.

Token by token, a query at position `q` sees the `cache_length` tokens before it plus itself: the band
`q - k <= cache_length`. With `sinks`, the first `sinks` tokens are always visible and the band shrinks
to `cache_length - sinks`. With longer chunks, a query sees its chunk so far plus what the cache held
when the chunk began.

litkv runs in float32 against the float64 oracle: differences are bounded by `rounding_bound`
(float32 ulps, relative to the logits' magnitude).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import (
    band_mask,
    causal_mask,
    chunked_last_recent_mask,
    forward_depth,
    max_diff,
    reference_forward,
    rounding_bound,
)

from litkv import GPT, KVCacheConfig, forward_chunked, generate

T = 30


@pytest.fixture(scope="module", params=["pythia", "smollm2"])
def model(request: pytest.FixtureRequest, tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(21, arch=request.param)


def _idx(batch: int = 2, length: int = T) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(4))


def _bound(model: GPT, expected: torch.Tensor, keys: int = T) -> float:
    """Float32 rounding bound for logits whose queries attend over at most `keys` keys."""
    return rounding_bound(expected, forward_depth(model.config, keys))


@pytest.mark.parametrize("cache_length,sinks", [(4, 0), (9, 0), (4, 1), (9, 3)])
@torch.inference_mode()
def test_token_by_token_equals_band_mask(model: GPT, cache_length: int, sinks: int) -> None:
    idx = _idx()
    kv_cache = KVCacheConfig(
        policy="last-recent", cache_length=cache_length, chunk_size=1, prefill_length=1, options=dict(sinks=sinks)
    )
    expected = reference_forward(model, idx, band_mask(cache_length, sinks)).logits
    ours = forward_chunked(model, idx, kv_cache)
    assert max_diff(ours, expected) <= _bound(model, expected)
    assert max_diff(ours, reference_forward(model, idx, causal_mask).logits) > 1e-2  # eviction mattered


@pytest.mark.parametrize("prefill,chunk,sinks", [(5, 3, 0), (8, 8, 2), (3, 5, 1)])
@torch.inference_mode()
def test_chunks_equal_oracle(model: GPT, prefill: int, chunk: int, sinks: int) -> None:
    idx = _idx()
    cache_length = 8
    kv_cache = KVCacheConfig(
        policy="last-recent",
        cache_length=cache_length,
        chunk_size=chunk,
        prefill_length=prefill,
        options=dict(sinks=sinks),
    )
    starts = [start for start, _ in kv_cache.chunk_bounds(T)]
    expected = reference_forward(model, idx, chunked_last_recent_mask(cache_length, sinks, starts)).logits
    assert max_diff(forward_chunked(model, idx, kv_cache), expected) <= _bound(model, expected)


@torch.inference_mode()
def test_equals_dense_while_it_fits(model: GPT) -> None:
    idx = _idx()
    kv_cache = KVCacheConfig(
        policy="last-recent", cache_length=T, chunk_size=7, prefill_length=7, options=dict(sinks=2)
    )
    expected = model(idx)
    assert max_diff(forward_chunked(model, idx, kv_cache), expected) <= _bound(model, expected)


@pytest.mark.parametrize("sinks", [0, 2])
@torch.inference_mode()
def test_slots_hold_sinks_and_most_recent(model: GPT, sinks: int) -> None:
    cache_length, t = 6, 17
    kv_cache = KVCacheConfig(policy="last-recent", cache_length=cache_length, chunk_size=3, options=dict(sinks=sinks))
    idx = _idx(length=t)
    model.set_kv_caches(model.build_kv_caches(kv_cache, batch_size=2))
    try:
        for start, end in kv_cache.chunk_bounds(t):
            model(idx[:, start:end], torch.arange(start, end).expand(2, -1))
        caches = model.kv_caches
    finally:
        model.set_kv_caches(None)
    expected = list(range(sinks)) + list(range(t - (cache_length - sinks), t))
    for cache in caches:
        held = cache.positions.sort(dim=-1).values
        assert held.tolist() == [[expected] * model.config.n_query_groups] * 2


@torch.inference_mode()
def test_generate_equals_greedy_oracle(model: GPT) -> None:
    """Greedy decoding through a last-recent cache equals argmax of the oracle, one token at a time."""
    cache_length, sinks, new = 6, 1, 6
    kv_cache = KVCacheConfig(
        policy="last-recent", cache_length=cache_length, chunk_size=4, prefill_length=4, options=dict(sinks=sinks)
    )
    prompt = _idx(batch=1, length=10)
    tokens = generate(model, [prompt[0]], max_new_tokens=new, kv_cache=kv_cache)[0]
    seq = prompt
    starts = [start for start, _ in kv_cache.chunk_bounds(prompt.shape[1])]
    for _ in range(new):
        logits = reference_forward(model, seq, chunked_last_recent_mask(cache_length, sinks, starts)).logits
        top2 = logits[0, -1].topk(2).values
        # no near-tie: float32 rounding cannot change the argmax on any CPU
        assert top2[0] - top2[1] > 2 * _bound(model, logits, seq.shape[1])
        seq = torch.cat((seq, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        starts.append(seq.shape[1] - 1)  # each decode step is a chunk of one token
    assert tokens.tolist() == seq[0, prompt.shape[1] :].tolist()
