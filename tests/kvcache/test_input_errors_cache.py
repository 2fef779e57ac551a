"""Cache-level cases of the hostile-input probe: quantised storage independent of chunking and
padding when nothing is evicted, and a custom policy's drop indices checked with clear errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import max_diff, random_tokens

from litkv import GPT, KVCacheConfig, forward_chunked, generate
from litkv.inference.generate import pad_prompts
from litkv.kvcache.base import Candidates, KVCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.quantized import dequantize, quantize
from litkv.kvcache.storage import CacheShape

T = 40


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(seed=4)


def _idx(batch: int = 2, length: int = T) -> torch.Tensor:
    return random_tokens(batch, length, seed=9)


# Largest logit difference between chunkings, relative to the largest logit. Before `as_stored`, a
# token was attended in full precision by its own chunk and quantised by later ones: int4 differed by
# 0.09-0.12 and int8 by 0.006-0.008 of the largest logit (this model, these chunkings). Now only a
# code that flips at a rounding boundary (keys computed with another summation order differ in their
# last float32 bit) makes a difference: at most 4e-4 seen.
BOUND = {"int4": 2e-3, "int8": 1e-3}


@pytest.mark.parametrize("policy", ["last-recent", "h2o", "qh2o"])
@pytest.mark.parametrize("storage", ["int4", "int8"])
@torch.inference_mode()
def test_quantized_storage_does_not_depend_on_chunking(model: GPT, policy: str, storage: str) -> None:
    """With room for every token, chunks of 1, 7 and 16 give the logits and greedy tokens of one call."""
    idx = _idx()
    logits = {}
    for chunk in (1, 7, 16, T):
        cfg = KVCacheConfig(
            policy=policy, cache_length=64, chunk_size=chunk, prefill_length=chunk, storage=storage, quant_group_size=8
        )
        logits[chunk] = forward_chunked(model, idx, cfg)
    scale = logits[T].abs().max()
    for chunk in (1, 7, 16):
        assert max_diff(logits[chunk], logits[T]) <= BOUND[storage] * scale, chunk
        assert torch.equal(logits[chunk].argmax(-1), logits[T].argmax(-1)), chunk


@pytest.mark.parametrize("policy", ["h2o", "qh2o"])
@torch.inference_mode()
def test_int4_left_padded_row_equals_alone(model: GPT, policy: str) -> None:
    """Left padding shifts where a row's chunks start; with room for every token, it changes nothing."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (5, 23, 37)]
    cfg = KVCacheConfig(policy=policy, cache_length=64, chunk_size=16, storage="int4", quant_group_size=8)
    idx, pos = pad_prompts(prompts, torch.device("cpu"))
    batch_logits = forward_chunked(model, idx, cfg, pos)
    for row, prompt in enumerate(prompts):
        alone = forward_chunked(model, prompt[None], cfg)[0]
        assert max_diff(batch_logits[row, -len(prompt) :], alone) <= BOUND["int4"] * alone.abs().max(), row
    batch = generate(model, prompts, max_new_tokens=12, kv_cache=cfg)
    for prompt, tokens in zip(prompts, batch, strict=True):
        assert torch.equal(generate(model, [prompt], max_new_tokens=12, kv_cache=cfg)[0], tokens)


def test_as_stored_is_what_a_read_returns() -> None:
    from litkv.kvcache.quantized import QuantizedStorage

    shape = CacheShape(1, 2, 4, 8, 8)
    storage = QuantizedStorage(shape, None, torch.float32, bits=4, group_size=4)
    keys, values = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    seen_keys, seen_values = storage.as_stored(keys, values)
    storage.write_range(0, keys, values)
    read_keys, read_values = storage.read()
    assert torch.equal(seen_keys, read_keys) and torch.equal(seen_values, read_values)
    assert torch.equal(seen_keys, dequantize(quantize(keys, 4, 4, torch.float16), 4, 4, torch.float32))
    assert not torch.equal(seen_keys, keys)  # int4 does round
    # gradients pass straight through the rounding
    keys.requires_grad_(True)
    storage.as_stored(keys, values)[0].sum().backward()
    assert torch.equal(keys.grad, torch.ones_like(keys))


# -- a custom policy's drop indices ---------------------------------------------------------------


class _FixedDrops(KVCache):
    """Returns whatever `make` builds from (B, G, T); a stand-in for a buggy research policy."""

    make = staticmethod(lambda b, g, t, length: torch.zeros(b, g, t, dtype=torch.long))

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        b, g, total = candidates.positions.shape
        return self.make(b, g, total - self.cache_length, self.cache_length)


def _run(make, chunk: int) -> None:  # noqa: ANN001
    cls = type("BuggyPolicy", (_FixedDrops,), {"make": staticmethod(make)})
    cfg = KVCacheConfig(policy="dense", cache_length=8, chunk_size=chunk)
    cache = SlotMachine(cls, cfg, CacheShape(2, 1, 8, 4, 4), None, torch.float32)
    pos = torch.arange(12).expand(2, 12)
    for start in range(0, 12, chunk):
        keys = torch.randn(2, 1, chunk, 4)
        cache.attend_inputs(keys, keys.clone(), pos[:, start : start + chunk])
        cache.evict_and_store(None)


@pytest.mark.parametrize(
    ("make", "chunk", "error", "match"),
    [
        # duplicates would evict slot 0 twice, i.e. silently keep a candidate the policy did not choose
        (lambda b, g, t, n: torch.zeros(b, g, t, dtype=torch.long), 4, ValueError, r"BuggyPolicy.*distinct"),
        # at decode, index L + 1 does not exist: the new token would be silently discarded
        (lambda b, g, t, n: torch.full((b, g, t), n + 1), 1, ValueError, r"BuggyPolicy.*\[0, 9\)"),
        (lambda b, g, t, n: torch.full((b, g, t), -1), 1, ValueError, r"BuggyPolicy.*got \[-1\]"),
        (lambda b, g, t, n: torch.arange(t).expand(b, g, t).float(), 4, TypeError, r"BuggyPolicy.*int64.*float32"),
        (lambda b, g, t, n: torch.arange(t + 1).expand(b, g, t + 1), 4, ValueError, r"BuggyPolicy.*shape \(2, 1, 4\)"),
        (lambda b, g, t, n: [0] * t, 1, TypeError, r"BuggyPolicy.*int64.*list"),
    ],
    ids=["duplicates", "out-of-range-decode", "negative", "float", "wrong-shape", "not-a-tensor"],
)
def test_custom_policy_drop_indices_are_checked(make, chunk: int, error: type, match: str) -> None:  # noqa: ANN001
    with pytest.raises(error, match=match):
        _run(make, chunk)


def test_valid_custom_drops_pass() -> None:
    # drop the oldest T slots: distinct and in range, so no error
    _run(lambda b, g, t, n: torch.arange(t).expand(b, g, t), 4)
    _run(lambda b, g, t, n: torch.arange(t).expand(b, g, t), 1)
