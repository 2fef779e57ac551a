"""`litkv.kvcache.quant_attention`: attention over int8/int4 codes equals dequantising then `attention.attend`.

Tolerances (as in the module docstring): 1e-10 in float64; `atol=1e-5, rtol=1e-4` in float32.
"""

from __future__ import annotations

import pytest
import torch

import litkv.kvcache.quant_attention as qa
import litkv.kvcache.quant_int as quant_int
from litkv import KVCacheConfig
from litkv.kvcache.base import CacheShape
from litkv.kvcache.kernels import cpu_decode
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.quantized import QuantizedSlots, quantize
from litkv.kvcache.registry import get_kv_cache_class
from litkv.modeling.attention import attend, build_mask

TOLERANCE = {torch.float64: {"atol": 1e-10, "rtol": 1e-10}, torch.float32: {"atol": 1e-5, "rtol": 1e-4}}


def _slots(b: int, g: int, s: int, d: int, bits: int, group: int, dtype: torch.dtype) -> QuantizedSlots:
    """Random keys and values of `s` slots, quantised as `QuantizedStorage` stores them."""
    x = (torch.randn(b, g, s, 2, d, dtype=dtype) * 1.5 + torch.randn(b, g, 1, 2, 1, dtype=dtype)).to(dtype)
    x[0, 0, 1] = 0.25  # a constant vector: scale 0
    codes, scales, offsets = quantize(x, bits, min(group, d), torch.float16)
    return QuantizedSlots(codes, scales, offsets, bits, min(group, d), dtype)


def _case(
    bits: int, group: int, dtype: torch.dtype, n_head: int = 6, g: int = 2, t: int = 3, s: int = 17, d: int = 32
) -> tuple[torch.Tensor, QuantizedSlots, torch.Tensor, torch.Tensor]:
    """Queries, slots, a mask with empty slots and a pad query, and which queries count."""
    torch.manual_seed(bits * 1000 + group + t)
    slots = _slots(2, g, s, d, bits, group, dtype)
    q = torch.randn(2, n_head, t, d, dtype=dtype)
    k_pos = torch.randint(0, 40, (2, g, s))
    k_pos[:, :, :3] = -1  # empty slots
    k_pos[1, -1, 5:9] = -1
    q_pos = torch.arange(40, 40 + t).repeat(2, 1)
    q_pos[1, 0] = -1  # a pad query
    return q, slots, build_mask(q_pos, k_pos), q_pos >= 0


def _reference(
    q: torch.Tensor, slots: QuantizedSlots, mask: torch.Tensor, need: bool, valid: torch.Tensor, softcap=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dequantise every slot, then the ordinary attention."""
    keys, values = slots.unpack()
    return attend(q, keys, values, mask, 0.3, softcap, need, valid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("group", [64, 32, 16, 8])
@pytest.mark.parametrize("bits", [8, 4])
def test_codes_attention_equals_dequantised_attention(
    bits: int, group: int, need_weights: bool, dtype: torch.dtype
) -> None:
    q, slots, mask, valid = _case(bits, group, dtype)
    y, weights = attend(q, slots, slots, mask, 0.3, None, need_weights, valid)
    y_ref, weights_ref = _reference(q, slots, mask, need_weights, valid)
    assert y.dtype == dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, **TOLERANCE[dtype])
    if need_weights:
        torch.testing.assert_close(weights, weights_ref, **TOLERANCE[torch.float32])
    else:
        assert weights is None


@pytest.mark.parametrize(("n_head", "g"), [(4, 4), (6, 3), (8, 1)])
@pytest.mark.parametrize("bits", [8, 4])
def test_grouped_queries_and_one_step(bits: int, n_head: int, g: int) -> None:
    """Multi-head, grouped and multi-query layouts; a decode step (`T = 1`) with a mask shared by heads."""
    q, slots, _, _ = _case(bits, 16, torch.float64, n_head=n_head, g=g, t=1)
    k_pos = torch.arange(17).expand(2, 1, 17).clone()
    k_pos[0, 0, :4] = -1
    mask = build_mask(torch.tensor([[20], [21]]), k_pos)  # (B, 1, 1, S)
    for need in (False, True):
        got = attend(q, slots, slots, mask, 0.3, None, need)
        ref = _reference(q, slots, mask, need, torch.ones(2, 1, dtype=torch.bool))
        torch.testing.assert_close(got[0], ref[0], **TOLERANCE[torch.float64])
        if need:
            torch.testing.assert_close(got[1], ref[1])


def test_blocks_of_queries_and_softcap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several blocks of queries (a small block budget) and soft-capping give the one-block result."""
    q, slots, mask, valid = _case(4, 16, torch.float64, t=5)
    monkeypatch.setattr(qa, "BLOCK_ELEMENTS", 2 * 2 * 3 * 17)  # one query per block
    got = attend(q, slots, slots, mask, 0.3, 5.0, True, valid)
    ref = _reference(q, slots, mask, True, valid, softcap=5.0)
    torch.testing.assert_close(got[0], ref[0], **TOLERANCE[torch.float64])
    torch.testing.assert_close(got[1], ref[1])


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_step_without_a_mask_sees_every_slot(bits: int, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step with no mask (every slot holds a token: `attend`'s `None`) gives the bits of an all-True mask,
    through the C kernel and through the PyTorch path; a multi-query call has no such shortcut."""
    monkeypatch.setattr(cpu_decode, "CPU_KERNEL", kernel)
    q, slots, _, valid = _case(bits, 16, torch.float32, t=1)
    every = torch.ones(2, 1, 1, 17, dtype=torch.bool)
    for need in (False, True):
        got, want = (
            attend(q, slots, slots, None, 0.3, None, need, valid),
            attend(q, slots, slots, every, 0.3, None, need, valid),
        )
        assert torch.equal(got[0], want[0]) and (not need or torch.equal(got[1], want[1]))
    y, _ = qa.quant_attend(q, slots, None, 0.3)
    assert torch.equal(y, attend(q, slots, slots, every, 0.3)[0])
    with pytest.raises(ValueError, match="mask may be None only for one query per head, got T=3"):
        qa.quant_attend(_case(bits, 16, torch.float32)[0], slots, None, 0.3)


@pytest.mark.parametrize("part", ["scales", "offsets"])
@pytest.mark.parametrize("kind", [0, 1])  # key, value
def test_a_wrong_scale_or_offset_is_seen(part: str, kind: int) -> None:
    """The comparison can fail: one slot's key (or value) scale or offset changed changes the result."""
    q, slots, mask, valid = _case(4, 16, torch.float32, t=1)
    mask = torch.ones_like(mask)
    y_ref, _ = _reference(q, slots, mask, True, valid)
    tensors = {"scales": slots.scales.clone(), "offsets": slots.offsets.clone()}
    tensors[part][:, :, 7, kind] = tensors[part][:, :, 7, kind] * 1.5 + 0.5
    wrong = QuantizedSlots(
        slots.codes, tensors["scales"], tensors["offsets"], slots.bits, slots.group_size, slots.dtype
    )
    y, _ = attend(q, wrong, wrong, mask, 0.3, None, True, valid)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(y, y_ref, **TOLERANCE[torch.float32])


def test_under_compile_equals_eager() -> None:
    """`litkv::quant_attend` is one opaque op in a compiled graph: no graph break, eager's numbers."""
    q, slots, mask, valid = _case(4, 16, torch.float32, t=1)

    def run(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        packed = QuantizedSlots(codes, scales, offsets, 4, 16, torch.float32)
        y, w = attend(q, packed, packed, mask, 0.3, None, True, valid)
        return y.sum() + w.sum()

    torch._dynamo.reset()
    compiled = torch.compile(run, backend="eager", fullgraph=True)
    args = (q, slots.codes, slots.scales, slots.offsets)
    assert torch.equal(compiled(*args), run(*args))


def test_shapes_are_checked() -> None:
    q, slots, mask, _ = _case(8, 16, torch.float32)
    with pytest.raises(ValueError, match=r"q must be \(B=2, a multiple of G=2, T, D=32\), got \(2, 5, 3, 32\)"):
        attend(q[:, :5], slots, slots, mask, 0.3)
    with pytest.raises(ValueError, match="mask must be"):
        attend(q, slots, slots, mask[..., :-1], 0.3)
    with pytest.raises(ValueError, match="v must be k"):
        attend(q, slots, slots.unpack()[1], mask, 0.3)


@pytest.mark.parametrize("policy", ["h2o", "knorm"])
def test_a_staged_step_hands_over_codes_and_unpacks_only_on_demand(policy: str) -> None:
    """A quantised cache's decode step returns its packed slots; `Candidates.keys` are the dequantised
    slots plus the staged token (h2o never reads them, knorm does)."""
    torch.manual_seed(0)
    cfg = KVCacheConfig(policy, cache_length=8, storage="int4", quant_group_size=8)
    cache = SlotMachine(get_kv_cache_class(policy), cfg, CacheShape(1, 2, 8, 16, 16), None, torch.float32)
    for pos in range(10):
        keys, values = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
        seen_keys, seen_values, k_pos = cache.attend_inputs(keys, values, torch.tensor([[pos]]))
        assert isinstance(seen_keys, QuantizedSlots) and seen_values is seen_keys
        assert seen_keys.shape == (1, 2, 9, 16) and k_pos.shape == (1, 2, 9)
        expected = cache.storage.read_staged(1)
        record = cache._call.candidates
        assert torch.equal(record.keys, expected[0]) and torch.equal(record.values, expected[1])
        cache.evict_and_store(torch.rand(1, 2, 9) if cache.needs_attn_weights else None)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("bits", [8, 4])
def test_integer_products_equal_dequantised_attention(
    monkeypatch: pytest.MonkeyPatch, bits: int, group: int, need_weights: bool
) -> None:
    """The CPU integer path of a decode step without the C kernel (`quant_int`, taken from `MIN_SLOTS` slots:
    here from 1), one and several groups per head, empty slots and a pad row, within float32's tolerance of
    dequantise-then-attend; a call of several queries keeps the float path."""
    monkeypatch.setattr(quant_int, "MIN_SLOTS", 1)
    monkeypatch.setattr(cpu_decode, "CPU_KERNEL", False)
    q, slots, mask, valid = _case(bits, group, torch.float32, t=1)
    assert quant_int.integer_path(slots.codes, bits, torch.float32, 1)
    assert not quant_int.integer_path(slots.codes, bits, torch.float32, 3)
    calls = []
    int_scores = quant_int.int_scores
    monkeypatch.setattr(qa, "int_scores", lambda *args: calls.append(1) or int_scores(*args))
    y, weights = attend(q, slots, slots, mask, 0.3, None, need_weights, valid)
    assert calls == [1]
    y_ref, weights_ref = _reference(q, slots, mask, need_weights, valid)
    torch.testing.assert_close(y, y_ref, **TOLERANCE[torch.float32])
    if need_weights:
        torch.testing.assert_close(weights, weights_ref, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("bits", [8, 4])
def test_integer_products_at_the_threshold_and_over_int32_blocks(monkeypatch: pytest.MonkeyPatch, bits: int) -> None:
    """At `MIN_SLOTS` slots as shipped, and with sums cut into blocks of 8 slots (int32 overflow guard)."""
    monkeypatch.setattr(cpu_decode, "CPU_KERNEL", False)
    q, slots, mask, valid = _case(bits, 32, torch.float32, t=1, s=quant_int.MIN_SLOTS + 3)
    assert quant_int.integer_path(slots.codes, bits, torch.float32, 1)
    assert not quant_int.integer_path(slots.codes, bits, torch.float64, 1)  # float64 keeps the exact float path
    for block in (quant_int.SLOT_BLOCK, 8):
        monkeypatch.setattr(quant_int, "SLOT_BLOCK", block)
        y, weights = attend(q, slots, slots, mask, 0.3, None, True, valid)
        y_ref, weights_ref = _reference(q, slots, mask, True, valid)
        torch.testing.assert_close(y, y_ref, **TOLERANCE[torch.float32])
        torch.testing.assert_close(weights, weights_ref, **TOLERANCE[torch.float32])
