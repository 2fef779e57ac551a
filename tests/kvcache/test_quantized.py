"""Quantised storage: round-trip error bounds, packing, bytes held, and greedy decoding with int8."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from litkv import GPT, KVCacheConfig, generate
from litkv.kvcache.dense import DenseKVCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.quantized import QuantizedStorage, dequantize, quantize
from litkv.kvcache.storage import CacheShape, FloatStorage


def _awkward_values(seed: int, d: int = 64) -> torch.Tensor:
    """`(6, 5, d)`: spreads from 1e-3 to 1e2, offsets up to 300, a constant group and an outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, d, generator=gen, dtype=torch.float64)
    x = x * torch.logspace(-3, 2, 6, dtype=torch.float64)[:, None, None]
    x = x + torch.tensor([0.0, 3.0, -7.5, 300.0, -0.1, 1e-3], dtype=torch.float64)[:, None, None]
    x[0, 0] = 0.25  # constant vector
    x[1, 1, 3] = 40.0  # outlier
    return x.float()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [8, 32, 64])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_round_trip_error_bound(bits: int, group: int, scale_dtype: torch.dtype) -> None:
    """Per group, in float64: |x - x~| <= scale / 2, and scale exceeds range / (2^bits - 1) only by the
    16-bit rounding of the scale and of the offset (the group minimum, rounded down)."""
    x = _awkward_values(bits + group).double()
    codes, scale, offset = quantize(x.float(), bits, group, scale_dtype)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 64 * bits // 8
    assert scale.dtype == offset.dtype == scale_dtype and scale.shape[-1] == 64 // group
    restored = dequantize((codes, scale, offset), bits, group, torch.float32).double()
    groups, err = x.unflatten(-1, (-1, group)), (x - restored).abs().unflatten(-1, (-1, group))
    lo, hi = groups.amin(-1), groups.amax(-1)
    s, o = scale.double(), offset.double()
    levels = 2**bits - 1
    eps = 2.0**-8 if scale_dtype == torch.bfloat16 else 2.0**-11  # relative 16-bit rounding
    tiny = 2.0**-133 if scale_dtype == torch.bfloat16 else 2.0**-24  # subnormal spacing
    assert bool((o <= lo).all()) and bool((lo - o <= 2 * eps * lo.abs() + tiny).all())
    bound_scale = (hi - o) / levels * (1 + 2 * eps)
    assert bool((s <= bound_scale + tiny).all())
    assert bool((err.amax(-1) <= s / 2 * (1 + 1e-5) + 1e-6 * groups.abs().amax(-1)).all())
    # the bound is tight enough to mean something: typical errors use most of the half step
    assert float((err.amax(-1) / (s / 2).clamp(min=1e-30))[s > 0].median()) > 0.5
    assert float(err[0, 0].max()) <= 0.25 * eps  # constant vector: (almost) exact


def test_int4_packs_two_codes_per_byte_first_half_in_low_nibbles() -> None:
    x = torch.arange(16, dtype=torch.float32).repeat(2)[None]  # one group of 32: codes 0..15 twice
    codes, scale, offset = quantize(x, 4, 32, torch.float16)
    assert float(scale) == 1.0 and float(offset) == 0.0
    assert codes.shape == (1, 16)
    expected = [i | ((15 - i) << 4) for i in range(16)]
    x[0, 16:] = x[0, 16:].flip(0)  # second half 15..0: byte i holds codes i and 15 - i
    codes, scale, offset = quantize(x, 4, 32, torch.float16)
    assert codes[0].tolist() == expected
    torch.testing.assert_close(dequantize((codes, scale, offset), 4, 32, torch.float32), x)


def test_storage_reads_what_was_written() -> None:
    """Scatter and range writes land in the right slots; untouched slots stay empty (zero)."""
    shape = CacheShape(2, 3, 10, 16, 16)
    for bits in (8, 4):
        store, ref = QuantizedStorage(shape, None, torch.float32, bits, 8), FloatStorage(shape, None, torch.float32)
        gen = torch.Generator().manual_seed(bits)
        k, v = torch.randn(2, 3, 4, 16, generator=gen), torch.randn(2, 3, 4, 16, generator=gen)
        for s in (store, ref):
            s.write_range(2, k, v)
        dest = torch.tensor([7, 0, 9, 3]).expand(2, 3, 4)
        valid = torch.tensor([True, True, False, True]).expand(2, 3, 4)
        k2, v2 = torch.randn(2, 3, 4, 16, generator=gen), torch.randn(2, 3, 4, 16, generator=gen)
        for s in (store, ref):
            s.write(dest, k2, v2, valid)
        (keys, values), (rk, rv) = store.read(), ref.read()
        tol = 6.0 / (2**bits - 1) / 2 * 1.01  # normal values span < 6 per group of 8
        assert (keys - rk).abs().max() <= tol and (values - rv).abs().max() <= tol
        written = torch.zeros(10, dtype=torch.bool)
        written[[0, 2, 3, 4, 5, 7]] = True
        assert bool((keys[:, :, ~written] == 0).all()) and bool((keys[:, :, written].abs().sum(-1) > 0).all())
        prefix_k, prefix_v = store.read_prefix(6)
        torch.testing.assert_close(prefix_k, keys[:, :, :6])
        torch.testing.assert_close(prefix_v, values[:, :, :6])


def test_token_errors_are_the_round_trip_errors_of_stored_tokens() -> None:
    shape = CacheShape(1, 2, 5, 32, 32)
    store = QuantizedStorage(shape, None, torch.float32, 4, 16)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 5, 32, generator=gen) * 3, torch.randn(1, 2, 5, 32, generator=gen)
    store.write_range(0, k, v)
    keys, values = store.read()
    expected = (keys.double() - k.double()).square().mean(-1) + (values.double() - v.double()).square().mean(-1)
    torch.testing.assert_close(store.token_errors(k, v).double(), expected, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_bytes_at_head_size_64(model_dtype: torch.dtype) -> None:
    """Everything counted (codes, scales, offsets); targets: int8 <= 0.55x, int4 <= 0.30x of bfloat16."""
    shape = CacheShape(2, 3, 100, 64, 64)
    bf16 = FloatStorage(shape, None, torch.bfloat16).nbytes()
    assert bf16 == 2 * 3 * 100 * 2 * 64 * 2
    slots = 2 * 3 * 100 * 2  # keys and values
    for bits, target in ((8, 0.55), (4, 0.30)):
        for group in (64, 32):
            store = QuantizedStorage(shape, None, model_dtype, bits, group)
            per_vector = 64 * bits // 8 + 2 * 2 * (64 // group)  # codes + 16-bit scale and offset per group
            assert store.nbytes() == slots * per_vector
            if group == 64:
                assert store.nbytes() / bf16 <= target, (bits, store.nbytes() / bf16)
    config = KVCacheConfig("dense", cache_length=100, chunk_size=10, storage="int4", quant_group_size=64)
    cache = SlotMachine(DenseKVCache, config, shape, None, model_dtype)
    assert cache.nbytes() / bf16 == pytest.approx(0.28125)


def test_bad_group_sizes() -> None:
    with pytest.raises(ValueError, match="one size"):
        QuantizedStorage(CacheShape(1, 1, 4, 64, 32), None, torch.float32, 8, 32)
    with pytest.raises(ValueError, match="multiple of 24"):
        QuantizedStorage(CacheShape(1, 1, 4, 64, 64), None, torch.float32, 8, 24)
    with pytest.raises(ValueError, match="even"):
        QuantizedStorage(CacheShape(1, 1, 4, 7, 7), None, torch.float32, 4, 7)
    with pytest.raises(ValueError, match="bits"):
        QuantizedStorage(CacheShape(1, 1, 4, 8, 8), None, torch.float32, 2, 8)
    store = QuantizedStorage(CacheShape(1, 1, 4, 16, 16), None, torch.float32, 8, 64)  # one group per vector
    assert store.group == 16


def test_dense_int8_greedy_tokens_equal_float(tiny_model: Callable[..., GPT]) -> None:
    model = tiny_model(0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (20,), generator=gen), torch.randint(0, 128, (13,), generator=gen)]
    float_cfg = KVCacheConfig("dense", cache_length=64, chunk_size=4)
    int8_cfg = KVCacheConfig("dense", cache_length=64, chunk_size=4, storage="int8")
    expected = generate(model, prompts, 32, float_cfg)
    storages = []
    got = generate(model, prompts, 32, int8_cfg, on_tokens=lambda _: storages.append(model.kv_caches[0].storage))
    assert isinstance(storages[0], QuantizedStorage) and storages[0].bits == 8  # int8 slots were really used
    for e, g in zip(expected, got, strict=True):
        assert len(set(e.tolist())) >= 8  # not a degenerate repetition
        assert g.tolist() == e.tolist()


def test_bfloat16_round_trip() -> None:
    x = _awkward_values(1).to(torch.bfloat16)
    shape = CacheShape(6, 1, 5, 64, 64)
    store = QuantizedStorage(shape, None, torch.bfloat16, 8, 32)
    assert store.scale_dtype == torch.bfloat16
    store.write_range(0, x[:, None], x[:, None])
    keys, _ = store.read()
    assert keys.dtype == torch.bfloat16
    span = x.float().unflatten(-1, (-1, 32))
    step = (span.amax(-1) - span.amin(-1)) / 255
    err = (keys[:, 0].float() - x.float()).abs().unflatten(-1, (-1, 32)).amax(-1)
    # int8 error plus the bfloat16 rounding of the result
    assert bool((err <= step * 0.51 + x.float().abs().unflatten(-1, (-1, 32)).amax(-1) * 2**-8 + 1e-6).all())


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_dense_quantised_decode_steps_go_straight_into_the_next_slot(
    tiny_model: Callable[..., GPT], monkeypatch: pytest.MonkeyPatch, storage: str
) -> None:
    """A dense quantised cache with room: decode steps take the direct path (the token written into slot
    `num_filled`, the filled prefix attended from its codes), not the staged one (room, eviction machinery).
    Against the staged path (forced by a policy that does not claim `fills_in_order`), on a ragged batch
    (pads in the slots): the same greedy tokens, and every token's stored codes bitwise the same."""
    model = tiny_model(0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (21,), generator=gen), torch.randint(0, 128, (9,), generator=gen)]
    config = KVCacheConfig("dense", cache_length=64, chunk_size=8, storage=storage)
    paths: list[str] = []
    staged = SlotMachine._attend_staged

    def spy(self, *args):
        paths.append("staged")
        return staged(self, *args)

    def keep_last(into: list) -> Callable[[object], None]:
        def keep(_: object) -> None:
            into[:] = [{name: t.clone() for name, t in model.kv_caches[0].state_tensors().items()}]

        return keep

    monkeypatch.setattr(SlotMachine, "_attend_staged", spy)
    held: list[dict] = []
    direct = generate(model, prompts, 24, config, on_tokens=keep_last(held))
    assert paths == []  # decode steps went straight into empty slots
    monkeypatch.setattr(DenseKVCache, "fills_in_order", lambda self: False)
    other: list[dict] = []
    via_room = generate(model, prompts, 24, config, on_tokens=keep_last(other))
    assert paths  # the staged path ran this time
    assert [t.tolist() for t in direct] == [t.tolist() for t in via_room]
    held, other = held[0], other[0]
    # layer 0: its keys and values come from the tokens alone, so equal tokens give equal bits on any CPU
    for row in range(2):  # the same tokens held, each stored bitwise the same (in other slots: pads' holes)
        for g in range(held["positions"].shape[1]):
            mine, theirs = held["positions"][row, g], other["positions"][row, g]
            assert sorted(mine[mine >= 0].tolist()) == sorted(theirs[theirs >= 0].tolist())
            for name in ("storage.codes", "storage.scales", "storage.offsets"):
                a = held[name][row, g][mine >= 0][mine[mine >= 0].argsort()]
                b = other[name][row, g][theirs >= 0][theirs[theirs >= 0].argsort()]
                assert torch.equal(a, b), name
