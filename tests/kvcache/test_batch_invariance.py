"""A row's result is a function of that row alone: for every registered policy and storage format, a
prompt in a ragged (left-padded) batch gives the greedy tokens and the cache contents (which token
positions each (layer, KV head) holds) of the same prompt run alone, at chunk sizes 1, 7, 64 and the
default, with eviction happening (prompts up to 2.2x the cache). Also: the prefix store warm ==
cold ragged batch == alone.

Batch invariance is structural: each row is cut and evicted as it would be alone (`litkv.modeling.runner`),
and equal scores are broken by position (`drop_lowest`). Rounding is not: CPU and GPU matmul kernels
round a row differently with the batch's shape (on this CPU, M=1, M in {2, 3} and M >= 4 give three
different results), so in float32 two candidates whose scores are equal up to rounding (KNorm: one
token id at two positions has keys of one norm, RoPE rotates without scaling) can be ordered
differently in a batch. The model therefore runs in float64, where policies compare float32 scores
and rounding noise stays far below float32's grid: tokens and cache contents must be identical.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from helpers import evicts_alone

from litkv import GPT, KVCacheConfig, PrefixCache, generate
from litkv.kvcache import get_kv_cache_class, known_policies
from litkv.kvcache.storage_kinds import known_storages

POLICIES = [n for n in known_policies() if get_kv_cache_class(n).__module__.startswith("litkv.") and evicts_alone(n)]
STORAGES = tuple(known_storages())  # every registered format, built-ins included
CACHE = 40  # default chunk: min(256, 40) = 40
LENGTHS = (22, 55, 88)  # the two longer ones evict during the prefill (the longest: 2.2x the cache)
NEW = 10
CHUNKS = (1, 7, None)  # one-token (staged) calls; chunks leaving free slots, then evicting; the default (40)


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(5, torch.float64, gates=True)


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(0, 128, (n,), generator=gen) for n in LENGTHS]


def _config(policy: str, storage: str, chunk: int | None) -> KVCacheConfig:
    length = max(LENGTHS) + NEW if policy == "dense" else CACHE
    return KVCacheConfig(policy, cache_length=length, chunk_size=chunk, storage=storage, quant_group_size=8)


def _held(model: GPT, row: int) -> list[list[list[int]]]:
    """Per layer and KV head, the sorted token positions row `row` holds."""
    return [[sorted(p for p in head.tolist() if p >= 0) for head in c.positions[row]] for c in model.kv_caches]


def _run(model: GPT, prompts: list[torch.Tensor], cfg: KVCacheConfig) -> tuple[list[list[int]], list]:
    """Greedy tokens per prompt and the positions each row's caches hold at the end."""
    held = []

    def keep_caches(_: torch.Tensor) -> None:
        held[:] = [_held(model, r) for r in range(len(prompts))]

    out = generate(model, prompts, NEW, cfg, on_tokens=keep_caches)
    return [t.tolist() for t in out], held


@pytest.mark.slow
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk{c or 'default'}")
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("policy", POLICIES)
@torch.inference_mode()
def test_row_in_ragged_batch_equals_row_alone(
    model: GPT, prompts: list[torch.Tensor], policy: str, storage: str, chunk: int | None
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qh2o replaces float storage by int4, with a warning
        cfg = _config(policy, storage, chunk)
        tokens, held = _run(model, prompts, cfg)
        for row, prompt in enumerate(prompts):
            alone_tokens, alone_held = _run(model, [prompt], cfg)
            assert tokens[row] == alone_tokens[0], f"row {row} (length {prompt.numel()}): tokens differ"
            assert held[row] == alone_held[0], f"row {row} (length {prompt.numel()}): cache contents differ"


@pytest.mark.parametrize("policy", ["h2o", "keydiff", "last-recent"])
@torch.inference_mode()
def test_prefix_store_warm_equals_cold_batch_equals_alone(model: GPT, prompts: list[torch.Tensor], policy: str) -> None:
    cfg = _config(policy, "float", 16)
    cold, _ = _run(model, prompts, cfg)
    alone = [_run(model, [p], cfg)[0][0] for p in prompts]
    store = PrefixCache(max_bytes=1 << 28)
    first = [t.tolist() for t in generate(model, prompts, NEW, cfg, prefix_cache=store)]
    warm = [t.tolist() for t in generate(model, prompts, NEW, cfg, prefix_cache=store)]
    assert store.hits >= len(prompts)
    assert cold == alone == first == warm


@pytest.mark.parametrize("policy", ["h2o", "keydiff", "snapkv", "expected-attention", "last-recent", "learned"])
@torch.inference_mode()
def test_one_shot_compresses_at_the_end_of_the_prompt_whatever_the_chunking(
    model: GPT, prompts: list[torch.Tensor], policy: str
) -> None:
    """One-shot mode keeps the whole prompt and compresses it when generate ends the prefill
    (`KVCaches.end_prefill`), not at the first one-token call: chunk 1 (every prefill call is one token)
    gives the tokens and kept sets of chunk 64 and of the default, alone and in a ragged batch."""
    options = {"mode": "one-shot", "budget": 16}  # below every prompt's length
    if policy == "snapkv":
        options["window"] = 8
    results = []
    for chunk in (1, 64, None):
        cfg = KVCacheConfig(policy, cache_length=max(LENGTHS) + NEW, chunk_size=chunk, options=options)
        results.append(_run(model, prompts, cfg))
        alone = [_run(model, [p], cfg) for p in prompts]
        assert results[-1][0] == [a[0][0] for a in alone] and results[-1][1] == [a[1][0] for a in alone]
    assert results[0] == results[1] == results[2]
    held = results[0][1][2]  # the longest prompt: its prompt tokens were cut to the budget
    assert all(sum(p < max(LENGTHS) for p in head) == 16 for layer in held for head in layer)
