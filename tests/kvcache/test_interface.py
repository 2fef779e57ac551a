"""The policy interface: options by policy, one place for chunking, caches attached by one context manager."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from litkv import GPT, KVCacheConfig, forward_chunked
from litkv.__main__ import normalize_argv
from litkv.kvcache import known_policies
from litkv.kvcache.config import ChunkPlan
from litkv.kvcache.h2o import H2OOptions


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(seed=1)


def test_options_are_the_policys_own() -> None:
    cfg = KVCacheConfig("h2o", cache_length=16, options={"recent": 4, "normalize_scores": True})
    assert cfg.policy_options == H2OOptions(sinks=0, recent=4, normalize_scores=True)
    assert KVCacheConfig("h2o", cache_length=16).policy_options.recent_length(16) == 8  # h2o's default: half
    assert KVCacheConfig("tova", cache_length=16).policy_options.recent_length(16) == 0
    with pytest.raises(ValueError, match=r"policy 'last-recent' has no option 'recent'; its options: sinks"):
        KVCacheConfig("last-recent", cache_length=16, options={"recent": 4})
    with pytest.raises(ValueError, match=r"policy 'dense' has no option 'sinks'; its options: none"):
        KVCacheConfig("dense", options={"sinks": 1})
    with pytest.raises(TypeError, match=r"normalize_scores must be a bool, got str 'yes'"):
        KVCacheConfig("h2o", cache_length=16, options={"normalize_scores": "yes"})
    with pytest.raises(ValueError, match=r"sinks \+ recent must be <= cache_length, got sinks=10, recent=8"):
        KVCacheConfig("h2o", cache_length=16, options={"sinks": 10})
    with pytest.raises(TypeError, match=r"quant_error_weight must be a finite number, got float nan"):
        KVCacheConfig("qh2o", cache_length=16, storage="int4", options={"quant_error_weight": float("nan")})


def test_every_builtin_is_registered_by_its_decorator() -> None:
    for name in ("dense", "last-recent", "h2o", "qh2o", "tova", "knorm", "keydiff"):
        cls = KVCacheConfig(name, cache_length=8).policy_class
        assert name in known_policies() and cls.__module__.startswith("litkv.kvcache.")


def test_policy_option_on_the_command_line() -> None:
    argv = normalize_argv(["generate", "--kv_cache", "h2o", "--kv_cache.recent", "4", "--kv-cache.cache-length=8"])
    assert argv == [
        "generate",
        "--kv_cache.policy",
        "h2o",
        "--kv_cache.options.recent",
        "4",
        "--kv_cache.cache_length=8",
    ]


def test_per_layer_configs_must_chunk_alike(model: GPT) -> None:
    same = [KVCacheConfig("h2o", cache_length=16, chunk_size=4), KVCacheConfig("dense", cache_length=40, chunk_size=4)]
    assert ChunkPlan.of(same).bounds(10) == [(0, 4), (4, 8), (8, 10)]
    differ = [same[0], KVCacheConfig("dense", cache_length=40, chunk_size=8)]
    with pytest.raises(ValueError, match=r"layer 0 has prefill_length=4, chunk_size=4; layer 1 has .*chunk_size=8"):
        forward_chunked(model, torch.zeros(1, 10, dtype=torch.long), differ)
    assert model.kv_caches == [None, None]


def test_caches_are_detached_however_the_block_ends(model: GPT) -> None:
    cfg = KVCacheConfig("h2o", cache_length=8, chunk_size=4)
    with pytest.raises(RuntimeError, match="boom"), model.kv_caches_attached(cfg, batch_size=2) as caches:
        assert model.kv_caches == list(caches) and model.caches is caches and len(caches) == 2
        raise RuntimeError("boom")
    assert model.kv_caches == [None, None]
    with pytest.raises(ValueError, match="batch_size is needed"), model.kv_caches_attached(cfg):
        pass
