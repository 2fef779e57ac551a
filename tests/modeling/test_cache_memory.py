"""Memory checked before allocation (issue 61 item 6): caches whose bytes exceed what the machine holds are
refused naming `cache_length` and the size, before anything is allocated; the estimate is a lower bound of
what the caches really take (their tensors' bytes), so a cache that fits is never refused. The same for the
other buffer a user's number sizes: `generate`'s RoPE table for `max_new_tokens` (an evicting cache runs
to any position)."""

from __future__ import annotations

import pytest
import torch
from helpers import random_tokens, tiny_gpt

import litkv.modeling.memory as memory
from litkv import GPT, KVCacheConfig, generate


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_gpt(5, config="SmolLM2-135M")


def test_a_trillion_slots_is_refused_naming_cache_length(model: GPT) -> None:
    """Before: a traceback asking the allocator for hundreds of TB, never naming cache_length."""
    kv = KVCacheConfig("h2o", cache_length=10**12, chunk_size=8)
    with pytest.raises(ValueError, match=r"cache_length=1000000000000 .* KV caches would take [\d.]+ [TP]iB") as err:
        generate(model, [random_tokens(1, 5, seed=1)[0]], 2, kv)
    assert "\n" not in str(err.value) and "physical memory" in str(err.value)


@pytest.mark.parametrize("storage", ["float", "int8", "int4"])
def test_estimate_is_a_lower_bound_of_the_real_caches(model: GPT, storage: str) -> None:
    kv = KVCacheConfig("h2o", cache_length=64, chunk_size=8, storage=storage, quant_group_size=16)
    caches = model.build_kv_caches(kv, 3)
    real = sum(cache.nbytes() for cache in caches)
    c = model.config
    estimate = memory.cache_bytes([64] * c.n_layer, [storage] * c.n_layer, 3, c.n_query_groups, c.head_size, 4)
    assert 0.5 * real <= estimate <= real


def test_the_limit_is_the_machines(model: GPT, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the machine's memory set just below / at what the caches need: refused / built."""
    c = model.config
    needed = memory.cache_bytes([64] * c.n_layer, ["float"] * c.n_layer, 2, c.n_query_groups, c.head_size, 4)
    kv = KVCacheConfig("h2o", cache_length=64, chunk_size=8)
    monkeypatch.setattr(memory, "machine_bytes", lambda device: needed - 1)
    with pytest.raises(ValueError, match="cache_length=64 with batch 2"):
        model.build_kv_caches(kv, 2)
    monkeypatch.setattr(memory, "machine_bytes", lambda device: needed)
    assert len(model.build_kv_caches(kv, 2)) == c.n_layer


def test_machine_bytes_is_the_physical_memory() -> None:
    """Against /proc/meminfo's MemTotal where there is one (Linux)."""
    try:
        line = next(ln for ln in open("/proc/meminfo") if ln.startswith("MemTotal:"))  # noqa: SIM115
    except OSError:
        pytest.skip("no /proc/meminfo")
    total = int(line.split()[1]) * 1024
    assert abs(memory.machine_bytes(torch.device("cpu")) - total) < 0.05 * total  # type: ignore[operator]


def test_a_trillion_new_tokens_is_refused_naming_max_new_tokens(model: GPT) -> None:
    """Before: the allocator's traceback for an 8 TB RoPE table (an h2o cache accepts any number of steps)."""
    kv = KVCacheConfig("h2o", cache_length=16, chunk_size=8)
    with pytest.raises(ValueError, match=r"max_new_tokens: the RoPE table .* would take [\d.]+ TiB") as err:
        generate(model, [random_tokens(1, 5, seed=1)[0]], 10**12, kv)
    assert "\n" not in str(err.value) and "physical memory" in str(err.value)


def test_the_rope_estimate_is_the_table_built(model: GPT) -> None:
    cos, sin = model._rope_table(5000)
    assert model.rope_table_bytes(5000) == cos.nbytes + sin.nbytes
