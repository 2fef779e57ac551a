"""Attention-weight sums of the eager path against a float64 reference written with plain loops.

litkv computes in float32; tolerances come from `rounding_bound` (float32 ulps times the square root
of the accumulation depth): relative per entry for the weights, whose errors scale with each weight,
and relative to the largest magnitude for the outputs and totals.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import max_diff, rounding_bound

import litkv.modeling.attention as attention
from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.dense import DenseKVCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.storage import CacheShape
from litkv.modeling.attention import attend, build_mask

B, N_HEAD, G, HS = 3, 8, 2, 16


def _weights_rtol(keys: int, queries: int) -> float:
    """Relative bound on a sum of softmax weights: q.k over HS, the softmax over `keys`, the sum over
    `queries` (query, head) pairs; each weight's error is relative to the weight itself."""
    return rounding_bound(torch.ones(()), HS + keys + queries)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, one query and one head at a time: outputs `(B, H, T, hs)` and weight sums `(B, G, S)`."""
    b, h, t, _ = q.shape
    g, s = k.shape[1], k.shape[2]
    y = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    sums = torch.zeros(b, g, s, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            gi = hi // (h // g)
            for ti in range(t):
                qp = int(q_pos[bi, ti])
                if qp < 0:
                    continue
                keys = [si for si in range(s) if 0 <= int(k_pos[bi, gi, si]) <= qp]
                logits = torch.stack([q[bi, hi, ti].double() @ k[bi, gi, si].double() * scale for si in keys])
                w = torch.softmax(logits, dim=0)
                for wi, si in zip(w, keys, strict=True):
                    sums[bi, gi, si] += wi
                    y[bi, hi, ti] += wi * v[bi, gi, si].double()
    return y, sums


def _cache_call(seed: int, storage: str = "float") -> tuple[torch.Tensor, ...]:
    """A second call into a partly filled cache, rows with padding (row 2 is all padding in call 2).

    With float storage the keys are the filled prefix (pads of call 1 included, position -1); with
    int8 storage they are all 24 slots, most of them empty, then the new tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    config = KVCacheConfig("dense", cache_length=24, chunk_size=8, storage=storage)
    cache = SlotMachine(DenseKVCache, config, CacheShape(B, G, 24, HS, HS), None, torch.float32)
    first = torch.tensor([[0, 1, 2, 3, 4, 5], [-1, -1, -1, 0, 1, 2], [-1, -1, -1, -1, -1, 0]])
    second = torch.tensor([[6, 7, 8, 9, 10], [3, 4, 5, 6, 7], [-1, -1, -1, -1, -1]])
    for pos in (first, second):
        t = pos.shape[1]
        k = torch.randn(B, G, t, HS, generator=gen)
        v = torch.randn(B, G, t, HS, generator=gen)
        keys, values, k_pos = cache.attend_inputs(k, v, pos)
        if pos is first:
            cache.evict_and_store(None)
    q = torch.randn(B, N_HEAD, second.shape[1], HS, generator=gen) * 2
    return q, keys, values, second, k_pos


@pytest.mark.parametrize("storage", ["float", "int8"])
@pytest.mark.parametrize("block_elements", [None, 50])
def test_weight_sums_match_float64_reference(
    monkeypatch: pytest.MonkeyPatch, block_elements: int | None, storage: str
) -> None:
    if block_elements is not None:  # force several query blocks
        monkeypatch.setattr(attention, "WEIGHTS_BLOCK_ELEMENTS", block_elements)
    q, keys, values, q_pos, k_pos = _cache_call(0, storage)
    if storage == "int8":
        assert keys.shape[2] == 24 + 5 and bool((k_pos[:, :, 6:24] == -1).all())  # partly filled
    assert bool((k_pos[1, :, :3] == -1).all())  # pads of the first call
    scale = 1 / math.sqrt(HS)
    y, sums = attend(q, keys, values, build_mask(q_pos, k_pos), scale, need_weights=True, query_valid=q_pos >= 0)
    y_ref, sums_ref = reference(q, keys, values, q_pos, k_pos, scale)
    assert sums.dtype == torch.float32 and sums.shape == (B, G, keys.shape[2])
    queries = q.shape[2] * (N_HEAD // G)
    torch.testing.assert_close(sums.double(), sums_ref, rtol=_weights_rtol(keys.shape[2], queries), atol=0)
    # every valid query gives weight 1 per head: the sums are not trivially zero
    valid = (q_pos >= 0).sum(dim=1).double() * (N_HEAD // G)
    total = sums.double().sum(dim=2)
    assert max_diff(total, valid[:, None].expand(B, G)) <= rounding_bound(valid, HS + 2 * keys.shape[2] + queries)
    assert bool((sums[k_pos < 0] == 0).all())
    assert bool((sums[2] == 0).all())  # an all-padding row contributes nothing
    y_ref = y_ref.transpose(1, 2).reshape(B, q.shape[2], -1)
    ok = q_pos >= 0
    # q.k over HS, softmax and probs @ v over the keys
    assert max_diff(y[ok], y_ref[ok]) <= rounding_bound(y_ref[ok], HS + 2 * keys.shape[2])


def test_weights_with_softcap_and_window() -> None:
    """Soft-capping and a sliding window change the reference accordingly (checked on the unmasked rows)."""
    q, keys, values, q_pos, k_pos = _cache_call(1)
    scale, cap = 1 / math.sqrt(HS), 2.0
    mask = build_mask(q_pos, k_pos, window=4)
    _, sums = attend(q, keys, values, mask, scale, softcap=cap, need_weights=True, query_valid=q_pos >= 0)
    expected = torch.zeros_like(sums, dtype=torch.float64)
    for bi in range(B):
        for hi in range(N_HEAD):
            gi = hi // (N_HEAD // G)
            for ti in range(q.shape[2]):
                if q_pos[bi, ti] < 0:
                    continue
                logits = (q[bi, hi, ti].double() @ keys[bi, gi].double().T) * scale
                logits = torch.tanh(logits / cap) * cap
                logits = logits.masked_fill(~mask[bi, gi, ti], float("-inf"))
                expected[bi, gi] += torch.softmax(logits, dim=0)
    rtol = _weights_rtol(keys.shape[2] + 1, q.shape[2] * (N_HEAD // G))  # + 1: the tanh
    torch.testing.assert_close(sums.double(), expected, rtol=rtol, atol=0)


def test_4096_chunk_is_computed_blockwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4,096-query chunk never holds the full T x S x heads weights: the softmax sees bounded blocks."""
    t, g, heads, hs = 4096, 1, 2, 2
    largest = []
    softmax = torch.softmax

    def spy(x: torch.Tensor, dim: int) -> torch.Tensor:
        largest.append(x.numel())
        return softmax(x, dim=dim)

    monkeypatch.setattr(torch, "softmax", spy)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, t, hs, generator=gen)
    k = torch.randn(1, g, t, hs, generator=gen)
    pos = torch.arange(t)[None]
    _, sums = attend(q, k, k, build_mask(pos, pos[:, None]), 1.0, need_weights=True)
    assert max(largest) <= attention.WEIGHTS_BLOCK_ELEMENTS < heads * t * t
    assert len(largest) >= 2
    torch.testing.assert_close(sums.sum(), torch.tensor(float(heads * t)), rtol=1e-5, atol=0)
    # causal: the last key is seen by the last query only, with weight < 1 per head
    assert 0 < float(sums[0, 0, -1]) < heads


def test_fast_path_pays_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without need_weights (and no soft-capping) the eager path is not used."""

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("eager path used")

    monkeypatch.setattr(attention, "_scores_pass", fail)
    q, keys, values, q_pos, k_pos = _cache_call(2)
    y, w = attend(q, keys, values, build_mask(q_pos, k_pos), 0.25)
    assert w is None and y.shape == (B, q.shape[2], N_HEAD * HS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_query_weights_equal_the_blockwise_pass_and_the_oracle(dtype: torch.dtype) -> None:
    """A decode step's weights on the CPU's PyTorch path (`_one_query_pass`; float32 steps take the C pass where it
    builds, `test_float_decode_kernel.py`): bitwise the blockwise pass's output and sums (so eager, compiled and
    batched steps stay as exact as before) and, in float32, the float64 oracle's; keys a view
    of larger slots, a mask by positions (empty slots, a pad query), no mask, and `CAUSAL` (every key seen)."""
    gen = torch.Generator().manual_seed(5)
    s = 37
    q = torch.randn(B, N_HEAD, 1, HS, generator=gen).to(dtype)
    k = torch.randn(B, G, s + 4, HS, generator=gen).to(dtype)[:, :, :s]
    v = torch.randn(B, G, s + 4, HS, generator=gen).to(dtype)[:, :, :s]
    k_pos = torch.randint(-1, 60, (B, G, s), generator=gen)
    q_pos = torch.tensor([[60], [60], [-1]])
    valid = q_pos >= 0
    every = torch.zeros(B, G, s, dtype=torch.long)
    for mask, positions in ((build_mask(q_pos, k_pos), k_pos), (None, every), (attention.CAUSAL, every)):
        y, sums = attention._attend_torch(q, k, v, mask, 0.25, None, True, valid)  # the PyTorch path
        qg = q.view(B, G, N_HEAD // G, 1, HS)
        ref_y, ref_sums = attention._scores_pass(qg, k, v, mask, 0.25, None, True, valid)
        assert torch.equal(y, ref_y.view(B, N_HEAD, 1, HS).transpose(1, 2).reshape(B, 1, N_HEAD * HS))
        assert torch.equal(sums, ref_sums)
        if dtype == torch.float32:
            oracle_y, oracle_sums = reference(
                q, k, v, q_pos if mask is not None else q_pos.clamp(min=0), positions, 0.25
            )
            oracle_sums = torch.where(valid[:, :, None], oracle_sums, 0.0)
            assert max_diff(sums, oracle_sums) <= _weights_rtol(s, N_HEAD // G)
            rows = valid[:, 0]  # the pad query's output is not defined by the oracle
            scale = oracle_y[rows].abs().max()
            assert max_diff(y[rows], oracle_y[rows].transpose(1, 2).reshape(-1, 1, N_HEAD * HS)) <= 10 * rounding_bound(
                scale, s
            )
