"""Cache states of 16-bit models: snapshot -> restore and save -> load give back the very tensors (same
dtype, bitwise), so the continuation's logits are bitwise those of the run that never left; a state
taken in one dtype is refused by a model of another."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from half import HALF_DTYPES, dtype_id, half_pair
from helpers import evicts_alone

from litkv import GPT, CacheState, KVCacheConfig, restore, snapshot
from litkv.kvcache import get_kv_cache_class, known_policies

POLICIES = [n for n in known_policies() if get_kv_cache_class(n).__module__.startswith("litkv.") and evicts_alone(n)]
CASES = [(p, "float") for p in POLICIES] + [("h2o", "int8"), ("last-recent", "int4")]
B = 2


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (B, n), generator=torch.Generator().manual_seed(seed))


def _feed(model: GPT, tokens: torch.Tensor, start: int, chunks: list[int]) -> torch.Tensor:
    out, s = [], 0
    for n in chunks:
        out.append(model(tokens[:, s : s + n], torch.arange(start + s, start + s + n).expand(B, n)))
        s += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("policy", "storage"), CASES)
@torch.inference_mode()
def test_round_trip_is_bitwise_in_the_same_dtype(policy: str, storage: str, dtype: torch.dtype, tmp_path: Path) -> None:
    model, _ = half_pair(dtype, seed=7)
    cfg = KVCacheConfig(policy, cache_length=96 if policy == "dense" else 24, chunk_size=8, storage=storage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qh2o replaces float storage by int4, with a warning
        model.set_kv_caches(model.build_kv_caches(cfg, B))
    try:
        _feed(model, _tokens(35, 1), 0, [8, 8, 8, 8, 3])  # 35 tokens into 24 slots: evicting caches evicted
        state = snapshot(model, device="cpu")
        floats = [t for t in state_tensors(state) if t.is_floating_point()]
        assert floats and any(t.dtype == dtype for t in floats)
        cont = _tokens(11, 2)
        expected = _feed(model, cont, 35, [8, 1, 1, 1])
        assert expected.dtype == dtype
        _feed(model, _tokens(11, 3), 46, [8, 3])  # a detour
        restore(model, state)
        assert torch.equal(_feed(model, cont, 35, [8, 1, 1, 1]), expected)
        state.save(tmp_path / "s.safetensors")
        model.set_kv_caches(None)
        loaded = CacheState.load(tmp_path / "s.safetensors")
        for a, b in zip(state_tensors(state), state_tensors(loaded), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
        restore(model, loaded)
        assert torch.equal(_feed(model, cont, 35, [8, 1, 1, 1]), expected)
        other, _ = half_pair(torch.float32, seed=7)
        with pytest.raises(ValueError, match="dtype|fingerprint|model"):
            restore(other, loaded)
    finally:
        model.set_kv_caches(None)


def state_tensors(state: CacheState) -> list[torch.Tensor]:
    """Every tensor of `state`, in a fixed order."""
    return [t for layer in state.layers for _, t in sorted(layer.tensors.items())]
