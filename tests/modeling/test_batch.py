"""Batch invariance: prompts of lengths 5, 17 and 40 in one (left-padded) batch give the same logits
and the same generated tokens as each prompt alone, with dense and last-recent caches.

The models run in float64 (`float64_model`), so that batched and alone differ by float64 rounding
only and the logits are compared with `rounding_bound`; gemma2's soft-capped attention computes its
scores in float32 (litkv/modeling/attention.py) and is bounded by float32's rounding."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import forward_depth, max_diff, rounding_bound

from litkv import GPT, KVCacheConfig, Sampling, forward_chunked, generate
from litkv.inference.generate import pad_prompts

LENGTHS = (5, 17, 40)
FLOAT32_SCORES = {"gemma2"}  # soft-capping: litkv's eager attention, float32 scores
CACHES = {
    "dense": KVCacheConfig(policy="dense", cache_length=64, chunk_size=4, prefill_length=4),
    # Evicts during the prefill of the 40-token prompt; the shorter ones fit.
    "last-recent": KVCacheConfig(policy="last-recent", cache_length=24, chunk_size=8, prefill_length=8),
    # Token by token: every prompt longer than the cache evicts, chunk boundaries play no role.
    "last-recent-sinks": KVCacheConfig(
        policy="last-recent", cache_length=12, chunk_size=1, prefill_length=1, options=dict(sinks=2)
    ),
}


@pytest.fixture(scope="module", params=["gemma2", "smollm2"])
def model(request: pytest.FixtureRequest, tiny_model: Callable[..., GPT]) -> GPT:
    model = tiny_model(11, torch.float64, arch=request.param)
    model.rounding_dtype = torch.float32 if request.param in FLOAT32_SCORES else torch.float64
    return model


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=gen) for n in LENGTHS]


def test_pad_prompts_left_pads() -> None:
    idx, pos = pad_prompts([torch.tensor([7, 8]), torch.tensor([4, 5, 6])], torch.device("cpu"))
    assert pos.tolist() == [[-1, 0, 1], [0, 1, 2]]
    assert idx[0, 1:].tolist() == [7, 8] and idx[1].tolist() == [4, 5, 6]


@pytest.mark.parametrize("cache", sorted(CACHES))
@torch.inference_mode()
def test_batch_logits_equal_alone(model: GPT, prompts: list[torch.Tensor], cache: str) -> None:
    kv_cache = CACHES[cache]
    idx, input_pos = pad_prompts(prompts, torch.device("cpu"))
    batched = forward_chunked(model, idx, kv_cache, input_pos=input_pos)
    depth = forward_depth(model.config, max(LENGTHS) + kv_cache.cache_length)
    for row, prompt in enumerate(prompts):
        alone = forward_chunked(model, prompt[None], kv_cache)[0]
        assert alone.dtype == torch.float64
        assert max_diff(batched[row, -len(prompt) :], alone) <= rounding_bound(alone, depth, model.rounding_dtype)
        full = model(prompt[None])[0]
        if cache == "dense":
            assert max_diff(alone, full) <= rounding_bound(full, depth, model.rounding_dtype)
        elif len(prompt) > kv_cache.cache_length:
            assert max_diff(alone, full) > 1e-3  # the cache did evict: the check above has teeth


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_batch_tokens_equal_alone(model: GPT, prompts: list[torch.Tensor], cache: str) -> None:
    kv_cache = CACHES[cache]
    batched = generate(model, prompts, max_new_tokens=8, kv_cache=kv_cache)
    assert len(batched) == len(prompts)
    for prompt, tokens in zip(prompts, batched, strict=True):
        alone = generate(model, [prompt], max_new_tokens=8, kv_cache=kv_cache)[0]
        assert tokens.tolist() == alone.tolist()
        assert len(alone) == 8


def test_rows_stop_independently(model: GPT, prompts: list[torch.Tensor]) -> None:
    kv_cache = CACHES["dense"]
    alone = [generate(model, [p], max_new_tokens=8, kv_cache=kv_cache)[0].tolist() for p in prompts]
    stop = alone[0][2]
    batched = generate(model, prompts, max_new_tokens=8, kv_cache=kv_cache, sampling=Sampling(stop_tokens=(stop,)))
    for expected, tokens in zip(alone, batched, strict=True):
        cut = expected.index(stop) + 1 if stop in expected else len(expected)
        assert tokens.tolist() == expected[:cut]
    assert len(batched[0]) <= 3
