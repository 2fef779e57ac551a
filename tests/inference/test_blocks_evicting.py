"""Spliced blocks in every policy and storage format (policies discovered: `known_policies()`), and the
policy state of spliced tokens: that of zero queries (uniform attention over what each may attend)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import pytest
import torch
from helpers import evicts_alone, random_tokens

from litkv import GPT, KVCacheConfig
from litkv.inference.blocks import Segment, prefill_segments, rope_delta, rotate_keys, splice
from litkv.inference.generate import generate
from litkv.kvcache import get_kv_cache_class, known_policies
from litkv.kvcache.config import ChunkPlan
from litkv.kvcache.storage import FloatStorage
from litkv.kvcache.storage_kinds import known_storages
from litkv.states.block_store import BlockStore

POLICIES = [n for n in known_policies() if get_kv_cache_class(n).__module__.startswith("litkv.") and evicts_alone(n)]
LENGTHS = [(6, False), (20, True), (15, True), (5, False)]  # 46 tokens through 24 slots
TOTAL = sum(n for n, _ in LENGTHS)


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(31, gates=True)


def _config(policy: str, storage: str) -> KVCacheConfig:
    fields = {f.name for f in dataclasses.fields(get_kv_cache_class(policy).Options)}
    options = {"sinks": 2} if "sinks" in fields else {}
    cfg = KVCacheConfig(policy, cache_length=24, chunk_size=8, storage=storage, quant_group_size=8, options=options)
    limit = get_kv_cache_class(policy).max_tokens(cfg)
    if limit is not None and limit < TOTAL + 8:  # a lossless cache gets room for everything
        cfg = dataclasses.replace(cfg, cache_length=TOTAL + 8)
    return cfg


@torch.inference_mode()
@pytest.mark.parametrize("storage", sorted(known_storages()))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("recompute", [0.0, 0.3])
def test_every_policy_and_storage_takes_spliced_blocks(model: GPT, policy: str, storage: str, recompute: float) -> None:
    segments = [Segment(random_tokens(1, n, seed=40 + i)[0], b) for i, (n, b) in enumerate(LENGTHS)]
    cfg = _config(policy, storage)
    store = BlockStore(1 << 24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a policy may replace the storage (qh2o: int4)
        with model.kv_caches_attached(cfg, 1):
            prefill_segments(model, segments, cfg, store, recompute)
            assert int(model.last_pos) == TOTAL - 1
            block = store.get(model, segments[1].ids, ChunkPlan.of(cfg))
            for layer, cache in enumerate(model.kv_caches):
                positions = cache.positions[0]
                for head in positions:
                    held = [p for p in head.tolist() if p >= 0]
                    assert len(held) == len(set(held)) <= cfg.cache_length and all(0 <= p < TOTAL for p in held)
                if type(cache.storage) is not FloatStorage:
                    continue
                cos, sin = rope_delta(model, 6, layer)
                expected = rotate_keys(block.keys[layer], cos, sin, model.config.rope_n_elem)
                in_block = (positions >= 6) & (positions < 26)
                if recompute == 0.0 and bool(in_block.any()):  # a kept spliced key is the rotated block key
                    g, s = in_block.nonzero(as_tuple=True)
                    stored = cache.storage.keys[0, g, s]
                    assert torch.equal(stored, expected[0, g, positions[g, s] - 6])
        (tokens,) = generate(model, [segments], 4, cfg, block_store=store, recompute=recompute)
    assert tokens.shape == (4,)


@torch.inference_mode()
def test_h2o_state_of_spliced_tokens_is_that_of_uniform_attention(model: GPT) -> None:
    cfg = KVCacheConfig("h2o", cache_length=64, chunk_size=16)
    context, ids = random_tokens(1, 4, seed=50)[0], random_tokens(1, 10, seed=51)[0]
    q_per_kv = model.config.n_head // model.config.n_query_groups
    with model.kv_caches_attached(cfg, 1):
        prefill_segments(model, [Segment(context)], cfg)
        before = [cache.policy.attn_sums[0, :, :4].clone() for cache in model.kv_caches]
        block = BlockStore(0).get(model, ids, ChunkPlan.of(cfg))
        splice(model, block, 4, torch.ones(10, dtype=torch.bool), 16)
        share = torch.tensor([q_per_kv / (4 + i + 1) for i in range(10)], dtype=torch.float64)
        for cache, old in zip(model.kv_caches, before, strict=True):
            assert torch.equal(cache.positions[0, 0, :14], torch.arange(14))
            got_prior = cache.policy.attn_sums[0, :, :4].double() - old.double()
            assert torch.allclose(got_prior, share.sum().expand(got_prior.shape), atol=1e-5)
            expected = torch.stack([share[j:].sum() for j in range(10)])
            assert torch.allclose(cache.policy.attn_sums[0, :, 4:14].double(), expected.expand(2, 10), atol=1e-5)
