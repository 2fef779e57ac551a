"""The C kernel of a quantised cache's decode step on the CPU (`litkv.kvcache.kernels.cpu_decode`), against a
float64 oracle of its arithmetic and within a stated bound of the PyTorch path (`quant_attention._quant_attend_torch`)
and of the exact float64 attention (the codes dequantised in float64, then `attention.attend`).

The kernel multiplies the keys' codes by the queries as integers: each query (times the attention's scale) is
rounded per group to two int8 digits (`_rounded_queries`), about 16 bits, while the keys' offsets take the float32
query sums. So (1) the kernel equals the float64 attention of those rounded queries within `atol=1e-5, rtol=1e-4`
(it adds in another order and takes its exponentials from a polynomial), and (2) against the exact attention every
score moves by at most `eps`, the rounding's `sum_d |dq_d| |k_d - offset|`, so each softmax weight by a factor
within `e^(+-2 eps)` and each output by at most `(e^(2 eps) - 1) max |v|` (`_assert_within_rounding`). A row's
result does not depend on its batch: asserted bitwise. Skipped where this machine has no C compiler (the kernel
then is not used: `test_without_a_compiler...`).
"""

from __future__ import annotations

import dataclasses
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import litkv.kvcache.quant_attention as qa
from litkv.core.c_build import build
from litkv.kvcache.kernels import cpu_decode
from litkv.kvcache.quantized import QuantizedSlots, QuantizedStorage, quantize, round_trip_error
from litkv.kvcache.storage import CacheShape
from litkv.modeling.attention import attend, build_mask

FLOAT32 = {"atol": 1e-5, "rtol": 1e-4}

needs_compiler = pytest.mark.skipif(cpu_decode.find_compiler() is None, reason="no C compiler")


def _case(
    bits: int, n_head: int, g: int, s: int, d: int, group: int, b: int = 2, seed: int = 0
) -> tuple[torch.Tensor, QuantizedSlots, torch.Tensor, torch.Tensor]:
    """A decode step of `b` rows over `s` slots of a larger buffer (as the storage hands them over): empty
    slots, a KV head with a run of hidden slots longer than a block, a constant vector; queries, the mask
    from positions, and which rows' queries count."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, g, s + 5, 2, d, generator=gen) * 1.5 + torch.randn(b, g, 1, 2, 1, generator=gen)
    x[0, 0, 1] = 0.25  # a constant vector: scale 0
    codes, scales, offsets = (t[:, :, :s] for t in quantize(x, bits, min(group, d), torch.float16))
    slots = QuantizedSlots(codes, scales, offsets, bits, min(group, d), torch.float32)
    k_pos = torch.randperm(4 * s, generator=gen)[:s].expand(b, g, s).clone()
    k_pos[:, :, :3] = -1  # empty slots
    k_pos[-1, -1, s // 4 : 3 * s // 4] = -1
    q = torch.randn(b, n_head, 1, d, generator=gen)
    valid = torch.ones(b, 1, dtype=torch.bool)
    valid[-1] = False
    return q, slots, build_mask(torch.full((b, 1), 4 * s), k_pos), valid


def _run(kernel: bool, q, slots, mask, valid, need_weights=True, softcap=None):
    """One decode step through the kernel (`decode_attend`) or the PyTorch path; `y` `(B, 1, n_head * D)`."""
    b, n_head, _, d = q.shape
    g = slots.codes.shape[1]
    folded = q.reshape(b, g, n_head // g, d)
    args = (folded, slots.codes, slots.scales, slots.offsets, mask, valid, slots.bits, slots.group_size, 0.3)
    fn = cpu_decode.decode_attend if kernel else qa._quant_attend_torch
    y, w = fn(*args, softcap, need_weights)
    return y.reshape(b, n_head, d)[:, :, None].transpose(1, 2).reshape(b, 1, n_head * d), w


def _oracle(q, slots, mask, valid, softcap=None):
    """Dequantised in float64, then the ordinary attention in float64."""
    keys, values = dataclasses.replace(slots, dtype=torch.float64).unpack()
    return attend(q.double(), keys, values, mask, 0.3, softcap, True, valid)


DIGITS = 2  # int8 digits per query number in the kernel (`quant_keys_cpu.h`)


def _rounded_queries(x: torch.Tensor, group: int) -> torch.Tensor:
    """The kernel's rounding of the scaled queries `x` `(..., D)` float32, in float64: per group of `group` numbers
    `step = max|x| / 127` and `x / step` as DIGITS int8 digits (each the nearest integer, ties to even, to what the
    digits before left, times 254), read back as `step * (d_1 + d_2 / 254)`."""
    by_group = x.unflatten(-1, (-1, group))
    top = by_group.abs().amax(-1, keepdim=True)
    rest = by_group * torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    total, place = torch.zeros_like(by_group, dtype=torch.float64), 1.0
    for _ in range(DIGITS):
        digit = torch.round(rest)
        assert bool((digit.abs() <= 127).all())  # every digit is an int8
        total += digit.double() * place
        rest, place = (rest - digit) * 254.0, place / 254.0
    return (total * (top / 127.0).double()).flatten(-2)


def _rounded_oracle(q, slots, mask, valid, softcap=None):
    """The kernel's arithmetic in float64: the queries times 0.3 (float32) rounded as `_rounded_queries`, dotted
    with the dequantised keys, plus each key group's offset times what the rounding took from the group's sum (the
    kernel multiplies the offsets by the float32 sums); then the ordinary attention."""
    x = q * 0.3
    rounded = _rounded_queries(x, slots.group_size)
    taken = (x.double() - rounded).unflatten(-1, (-1, slots.group_size)).sum(-1)  # (B, H, 1, groups)
    keys, values = dataclasses.replace(slots, dtype=torch.float64).unpack()
    key_offsets = slots.offsets[:, :, :, 0].double()  # (B, G, S, groups)
    extended = (torch.cat((rounded, taken), -1), torch.cat((keys, key_offsets), -1))
    return attend(*extended, values, mask, 1.0, softcap, True, valid)


def _assert_within_rounding(y, w, q, slots, mask, valid, softcap=None) -> None:
    """`y`, `w` within the bound the queries' rounding sets around the exact float64 attention (module docstring):
    `eps` per query head the largest `sum_d |x_d - rounded_d| |k_d - offset_g|` over its slots."""
    b, n_head, _, d = q.shape
    x = q * 0.3
    moved = (x.double() - _rounded_queries(x, slots.group_size)).abs()  # (B, H, 1, D)
    keys, values = dataclasses.replace(slots, dtype=torch.float64).unpack()
    codes = keys - slots.offsets[:, :, :, 0].double().repeat_interleave(slots.group_size, -1)  # scale * code
    per_head = codes.abs().repeat_interleave(n_head // codes.shape[1], 1)  # (B, H, S, D)
    eps = (moved @ per_head.transpose(-1, -2)).amax(-1)  # (B, H, 1)
    y_ref, w_ref = _oracle(q, slots, mask, valid, softcap)
    factor = torch.expm1(2 * eps).view(b, 1, n_head, 1)
    top = values.abs().amax().item()
    gap = (y.double() - y_ref).abs().view(b, 1, n_head, d)
    assert bool((gap <= factor * top + 1e-5 + 1e-4 * y_ref.abs().view(b, 1, n_head, d)).all())
    heads = factor.view(b, -1, n_head // w.shape[1]).amax(-1)[..., None]  # (B, G, 1)
    assert bool(((w.double() - w_ref).abs() <= heads * w_ref + 1e-5 + 1e-4 * w_ref).all())


CASES = [  # (bits, query heads, KV heads, slots, head size, group size)
    (8, 9, 3, 300, 64, 64),  # SmolLM2-135M's heads; blocks of 64 and a partial one
    (4, 9, 3, 300, 64, 32),
    (4, 9, 3, 300, 64, 64),  # the default group: one scale per vector (its products factor the scale out)
    (8, 32, 8, 17, 32, 16),  # Llama-3.2-1B's head ratio; fewer slots than a block; two groups per vector
    (4, 4, 2, 129, 16, 8),
    (8, 2, 2, 65, 80, 80),  # a head size that is not a multiple of 32; one query per KV head
    (4, 6, 1, 4, 8, 8),  # one slot seen (three empty)
    (4, 8, 2, 100, 128, 64),  # a 128-number head in two groups
]


@needs_compiler
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"int{c[0]}-{c[1]}q{c[2]}kv-{c[3]}slots-d{c[4]}-g{c[5]}")
def test_kernel_equals_its_rounding_in_float64_within_the_bound_of_exact(case: tuple) -> None:
    bits, n_head, g, s, d, group = case
    q, slots, mask, valid = _case(bits, n_head, g, s, d, group)
    y, w = _run(True, q, slots, mask, valid)
    y_rounded, w_rounded = _rounded_oracle(q, slots, mask, valid)
    assert y.dtype == torch.float32 and w.shape == (2, g, s)
    torch.testing.assert_close(y.double(), y_rounded, **FLOAT32)
    torch.testing.assert_close(w.double(), w_rounded.double(), **FLOAT32)
    _assert_within_rounding(y, w, q, slots, mask, valid)
    y_torch, w_torch = _run(False, q, slots, mask, valid)  # the PyTorch path: the exact queries
    y_ref, w_ref = _oracle(q, slots, mask, valid)
    torch.testing.assert_close(y_torch.double(), y_ref, **FLOAT32)
    torch.testing.assert_close(w_torch.double(), w_ref.double(), **FLOAT32)
    assert bool((w[~mask[:, :, 0].expand(2, g, s)] == 0).all())  # hidden slots get no weight
    assert bool((w[1] == 0).all())  # the second row's query does not count
    torch.testing.assert_close(w[0].sum(-1), torch.full((g,), n_head / g))  # each head's weights sum to one


@needs_compiler
@pytest.mark.parametrize("group", [64, 32])
@pytest.mark.parametrize("bits", [8, 4])
def test_what_hidden_slots_hold_is_never_read(bits: int, group: int) -> None:
    """Hidden slots (empty ones and a long run) whose codes, scales and offsets are NaN or infinite: the same
    outputs and weights, bit for bit, as with the slots' finite numbers, none NaN."""
    q, slots, mask, valid = _case(bits, 9, 3, 300, 64, group, seed=4)
    y, w = _run(True, q, slots, mask, valid)
    hidden = ~mask[:, :, 0].expand(2, 3, 300)  # (B, G, S)
    spoiled = dataclasses.replace(slots, scales=slots.scales.clone(), offsets=slots.offsets.clone())
    spoiled.scales[hidden] = float("nan")
    spoiled.offsets[hidden] = float("inf")
    y2, w2 = _run(True, q, spoiled, mask, valid)
    assert not bool(y[0].isnan().any()) and torch.equal(y2, y) and torch.equal(w2, w)


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
def test_softcap_no_weights_and_a_mask_per_kv_head(bits: int) -> None:
    """Soft-capping (large scores, so that it bites), no weights asked, and a `(B, G, 1, S)` mask."""
    q, slots, mask, valid = _case(bits, 9, 3, 200, 32, 16, seed=1)
    q = q * 8
    per_head = mask.expand(2, 3, 1, 200).clone()
    per_head[0, 1, 0, 50:] = False
    y, w = _run(True, q, slots, per_head, valid, need_weights=False, softcap=2.0)
    y_rounded, w_rounded = _rounded_oracle(q, slots, per_head, valid, softcap=2.0)
    assert w.numel() == 0
    torch.testing.assert_close(y.double(), y_rounded, **FLOAT32)
    _, w_all = _run(True, q, slots, per_head, valid, softcap=2.0)
    _assert_within_rounding(y, w_all, q, slots, per_head, valid, softcap=2.0)


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
def test_slots_a_step_apart_read_their_own_scales(bits: int) -> None:
    """Every other slot of a buffer (codes, scales and offsets two slots apart, a layout the kernel reads its
    scales from one slot at a time, not as one run): the same as the PyTorch path and the float64 oracle."""
    q, slots, mask, valid = _case(bits, 9, 3, 260, 64, 32, seed=3)
    every_other = QuantizedSlots(
        *(t[:, :, ::2] for t in (slots.codes, slots.scales, slots.offsets)), bits, 32, torch.float32
    )
    assert every_other.scales.stride(2) == 2 * every_other.scales.shape[-2] * every_other.scales.shape[-1]
    mask = mask[..., ::2]
    y, w = _run(True, q, every_other, mask, valid)
    y_rounded, w_rounded = _rounded_oracle(q, every_other, mask, valid)
    torch.testing.assert_close(y.double(), y_rounded, **FLOAT32)
    torch.testing.assert_close(w.double(), w_rounded.double(), **FLOAT32)
    _assert_within_rounding(y, w, q, every_other, mask, valid)


@needs_compiler
def test_a_row_hidden_everywhere_gives_nan_as_the_pytorch_path() -> None:
    """A row whose every slot is hidden: the softmax of nothing, NaN on both paths, in the same places."""
    q, slots, mask, valid = _case(8, 9, 3, 100, 32, 32)
    mask = mask.clone()
    mask[1] = False
    y, w = _run(True, q, slots, mask, valid)
    y_torch, w_torch = _run(False, q, slots, mask, valid)
    assert bool(y[1].isnan().all()) and not bool(y[0].isnan().any())
    assert torch.equal(y.isnan(), y_torch.isnan()) and torch.equal(w.isnan(), w_torch.isnan())
    y_rounded, w_rounded = _rounded_oracle(q, slots, mask, valid)
    torch.testing.assert_close(y.double(), y_rounded, equal_nan=True, **FLOAT32)
    torch.testing.assert_close(w[0].double(), w_rounded[0].double(), **FLOAT32)  # the other row's: uncounted


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_equals_itself_in_any_batch_bitwise(bits: int) -> None:
    """Every row is computed alone in a fixed order: a row alone, in a batch of three, and as another row's
    neighbour give the same bits (on any CPU: the same compiled code runs for each row)."""
    q, slots, mask, valid = _case(bits, 9, 3, 150, 64, 32, b=3, seed=2)
    y, w = _run(True, q, slots, mask, valid)
    for row in range(3):
        one = QuantizedSlots(
            *(t[row : row + 1] for t in (slots.codes, slots.scales, slots.offsets)), bits, 32, torch.float32
        )
        y_one, w_one = _run(True, q[row : row + 1], one, mask[row : row + 1], valid[row : row + 1])
        assert torch.equal(y_one, y[row : row + 1]) and torch.equal(w_one, w[row : row + 1])


@needs_compiler
def test_attend_takes_the_kernel_for_a_decode_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `attention.attend`: a float32 decode step goes to the kernel (with the folded heads), a call of
    several queries, a float64 one and one with `CPU_KERNEL` off to the PyTorch path."""
    calls = []
    decode_attend = cpu_decode.decode_attend

    def spy(*args):
        calls.append(tuple(args[0].shape))
        return decode_attend(*args)

    monkeypatch.setattr(cpu_decode, "decode_attend", spy)
    q, slots, mask, valid = _case(8, 9, 3, 40, 32, 32)
    got = attend(q, slots, slots, mask, 0.3, None, True, valid)
    assert calls == [(2, 3, 3, 32)]
    two = torch.cat((q, q), dim=2)
    attend(two, slots, slots, mask.expand(2, 3, 2, 40), 0.3, None, True)
    wide = dataclasses.replace(slots, dtype=torch.float64)
    attend(q.double(), wide, wide, mask, 0.3, None, True)
    monkeypatch.setattr(cpu_decode, "CPU_KERNEL", False)
    want = attend(q, slots, slots, mask, 0.3, None, True, valid)
    assert calls == [(2, 3, 3, 32)]
    y_rounded, w_rounded = _rounded_oracle(q, slots, mask, valid)
    torch.testing.assert_close(got[0].double(), y_rounded, **FLOAT32)
    torch.testing.assert_close(got[1].double(), w_rounded.double(), **FLOAT32)
    assert not torch.equal(got[0], want[0])  # rounded queries: the kernel did run


@needs_compiler
def test_a_group_size_without_vectors_takes_the_pytorch_path() -> None:
    """Groups of 6 numbers fill no vector of 4, 8 or 16: the library is built (its quantisation serves) but has
    no attention, `decode_attend` says None and `attend` gives the PyTorch path's bits."""
    q, slots, mask, valid = _case(8, 4, 2, 30, 12, 6)
    assert cpu_decode.library(12, 2, 8, 2) is not None
    assert not hasattr(cpu_decode.library(12, 2, 8, 2), "litkv_quant_attend")
    args = (q.reshape(2, 2, 2, 12), slots.codes, slots.scales, slots.offsets, mask, valid, 8, 6, 0.3, None, True)
    assert cpu_decode.decode_attend(*args) is None
    y, w = attend(q, slots, slots, mask, 0.3, None, True, valid)
    y_torch, w_torch = _run(False, q, slots, mask, valid)
    assert torch.equal(y, y_torch) and torch.equal(w, w_torch)


def test_int8_groups_past_256_numbers_take_the_pytorch_path() -> None:
    """A group's int8 codes times the queries' int16 numbers stay within int32 up to 256 numbers a group: past that
    `decode_attend` says None (before building anything) and `attend` gives the PyTorch path's bits."""
    q, slots, mask, valid = _case(8, 2, 1, 20, 512, 512)
    args = (q.reshape(2, 1, 2, 512), slots.codes, slots.scales, slots.offsets, mask, valid, 8, 512, 0.3, None, True)
    assert cpu_decode.decode_attend(*args) is None
    y, w = attend(q, slots, slots, mask, 0.3, None, True, valid)
    y_torch, w_torch = _run(False, q, slots, mask, valid)
    assert torch.equal(y, y_torch) and torch.equal(w, w_torch)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty kernel cache: `$LITKV_HOME` in `tmp_path`, no library loaded in this process."""
    monkeypatch.setenv("LITKV_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_decode, "_built", {})
    return tmp_path / "kernels"


def test_without_a_compiler_one_warning_then_the_pytorch_path(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler: `library` is None with one RuntimeWarning naming why, and `attend` gives the PyTorch
    path's numbers bitwise (the build is not tried again)."""
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    q, slots, mask, valid = _case(8, 9, 3, 40, 32, 32)
    with pytest.warns(RuntimeWarning, match="could not be built.*no-such-compiler.*PyTorch path"):
        y, w = attend(q, slots, slots, mask, 0.3, None, True, valid)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second build
        attend(q, slots, slots, mask, 0.3, None, True, valid)
    monkeypatch.setattr(cpu_decode, "CPU_KERNEL", False)
    y_torch, w_torch = attend(q, slots, slots, mask, 0.3, None, True, valid)
    assert torch.equal(y, y_torch) and torch.equal(w, w_torch)
    assert not any(fresh.glob("*.so"))


PORTABLE_CASES = [(4, 9, 3, 70, 64, 64), (8, 9, 3, 70, 64, 64), (4, 8, 2, 40, 128, 64), (8, 8, 2, 40, 32, 16)]


@needs_compiler
@pytest.mark.parametrize("case", PORTABLE_CASES, ids=lambda c: f"int{c[0]}-d{c[4]}-g{c[5]}")
def test_the_portable_build_gives_the_same_bits(case: tuple, fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this CPU has AVX-512 VNNI the keys' integer products take it (16 slots transposed, 4 codes times 4
    digits per lane); a build without it (`-DLITKV_PORTABLE`, what a CPU without VNNI compiles) sums the same
    integers per slot in other vectors: outputs and weights equal bit for bit."""
    bits, n_head, g, s, d, group = case
    q, slots, mask, valid = _case(bits, n_head, g, s, d, group, seed=6)
    lib = cpu_decode.library(d, d // min(group, d), bits, n_head // g)
    if not lib.litkv_vnni():
        pytest.skip("this CPU's build has no VNNI path: the portable path is the only one")
    y, w = _run(True, q, slots, mask, valid)
    monkeypatch.setattr(cpu_decode, "_built", {})
    portable = lambda source, defines, name: build(source, (*defines, "-DLITKV_PORTABLE"), name)  # noqa: E731
    monkeypatch.setattr(cpu_decode, "build", portable)
    assert not cpu_decode.library(d, d // min(group, d), bits, n_head // g).litkv_vnni()
    y2, w2 = _run(True, q, slots, mask, valid)
    assert torch.equal(y2, y) and torch.equal(w2, w)


@needs_compiler
def test_built_once_into_the_cache_then_loaded(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call compiles into `$LITKV_HOME/kernels/` under a temporary name, renamed into place (no
    temporary left); a new process (here: the loaded libraries forgotten) loads the file without compiling."""
    lib = cpu_decode.library(32, 2, 4, 3)
    assert lib is not None
    files = sorted(p.name for p in fresh.iterdir())
    assert len(files) == 1 and files[0].startswith("quant_decode_cpu_32_2_4_3_") and files[0].endswith(".so")
    monkeypatch.setattr(cpu_decode, "_built", {})

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert cpu_decode.library(32, 2, 4, 3) is not None
    assert sorted(p.name for p in fresh.iterdir()) == files


def _quantize_both(x: torch.Tensor, bits: int, group: int, monkeypatch: pytest.MonkeyPatch):
    """`quantized.quantize` through the C call and through PyTorch (`CPU_KERNEL` off)."""
    fast = quantize(x, bits, group, torch.float16)
    monkeypatch.setattr(cpu_decode, "CPU_KERNEL", False)
    slow = quantize(x, bits, group, torch.float16)
    monkeypatch.setattr(cpu_decode, "CPU_KERNEL", True)
    return fast, slow


@needs_compiler
@pytest.mark.parametrize("group", [64, 32, 8])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_gives_the_pytorch_bits(monkeypatch: pytest.MonkeyPatch, bits: int, group: int) -> None:
    """The C quantisation gives the PyTorch quantisation's codes, scales and offsets bit for bit (so a token
    stored by a decode step equals the same token stored by a prefill chunk): magnitudes from 1e-9 (float16
    subnormal scales) to 1e4, constant groups (scale 0), numbers on float16's grid and on quarter steps (ties
    of the rounding), float16's extremes."""
    gen = torch.Generator().manual_seed(bits + group)
    for trial, magnitude in enumerate([1e-9, 1e-6, 1e-3, 1.0, 30.0, 1e4]):
        x = torch.randn(3, 2, 5, 2, 64, generator=gen) * magnitude
        x[0, 0, :, :, :group] = 0.25  # constant groups
        x[1] = x[1].half().float() + 0.0  # on float16's grid (+ 0.0: no -0 beside +0, see below)
        x[2, 0] = (x[2, 0] * 4).round() / 4 + 0.0  # ties
        if trial == 5:
            x[2, 1, 0, 0, :2] = torch.tensor([65504.0, -65504.0])
        assert cpu_decode.quantize(x, bits, group) is not None  # the C call applies
        fast, slow = _quantize_both(x, bits, group, monkeypatch)
        for a, b in zip(fast, slow, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@needs_compiler
def test_quantize_leaves_what_it_cannot_match_to_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN, numbers beyond float16's range and both zeros at a group's extreme: no C result, so `quantize`
    gives the PyTorch path's (the same bits either way)."""
    x = torch.randn(4, 64)
    x[0, 5] = float("nan")
    x[1, 7] = 7e4
    x[2] = 0.0
    x[2, 3] = -0.0
    for row in range(3):
        assert cpu_decode.quantize(x[row : row + 1], 8, 32) is None
    assert cpu_decode.quantize(x[3:], 8, 32) is not None
    fast, slow = _quantize_both(x[1:3], 4, 32, monkeypatch)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _stored_both_ways(
    monkeypatch: pytest.MonkeyPatch, shape: CacheShape, bits: int, start: int, keys: torch.Tensor, values: torch.Tensor
) -> list[QuantizedStorage]:
    """`write_range(start, keys, values)` into two fresh storages (groups of 16): the C calls on, then off."""
    stores = [QuantizedStorage(shape, None, torch.float32, bits, 16) for _ in range(2)]
    stores[0].write_range(start, keys, values)
    monkeypatch.setattr(cpu_decode, "CPU_KERNEL", False)
    stores[1].write_range(start, keys, values)
    monkeypatch.setattr(cpu_decode, "CPU_KERNEL", True)
    return stores


def _assert_same_bits_in(stores: list[QuantizedStorage], start: int, end: int) -> None:
    """The two storages' buffers equal bit for bit, and zero outside slots `[start, end)`."""
    for name, buffer in stores[0].buffers().items():
        assert torch.equal(buffer.view(torch.uint8), stores[1].buffers()[name].view(torch.uint8)), name
        assert bool((buffer[:, :, :start] == 0).all() and (buffer[:, :, end:] == 0).all())


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
def test_a_storage_write_quantises_into_its_slots_with_the_pytorch_bits(
    monkeypatch: pytest.MonkeyPatch, bits: int
) -> None:
    """`QuantizedStorage.write_range` quantises straight into slots `[start, start + T)` of a batch (the C call:
    `quantize_into`), and the buffers then hold the bits the PyTorch path writes, the other slots untouched;
    a token the C call leaves to PyTorch (a -0 beside +0 at a group's minimum) is written by PyTorch, the
    same bits again."""
    shape = CacheShape(3, 2, 10, 32, 32)
    gen = torch.Generator().manual_seed(bits)
    keys, values = (torch.randn(3, 2, 4, 32, generator=gen) * 3 for _ in range(2))
    awkward = keys.clone()
    awkward[1, 1, 2, :16] = 0.0
    awkward[1, 1, 2, 3] = -0.0
    calls: list[bool] = []
    real = cpu_decode.quantize_into
    monkeypatch.setattr(cpu_decode, "quantize_into", lambda *a: calls.append(real(*a)) or calls[-1])
    for new_keys in (keys, awkward):
        calls.clear()
        stores = _stored_both_ways(monkeypatch, shape, bits, 5, new_keys, values)
        assert calls == [new_keys is keys, False]  # the C call wrote the slots (or left the awkward batch), then not
        _assert_same_bits_in(stores, 5, 9)


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
def test_a_decode_steps_token_is_quantised_where_it_lies_with_the_pytorch_bits(
    monkeypatch: pytest.MonkeyPatch, bits: int
) -> None:
    """A decode step's token (`write_range` of one slot, keys and values strided views as the model hands them)
    takes `quantize_token` (no stacked copy): the PyTorch path's bits in its slot, the other slots untouched; a
    token it leaves (a -0 beside +0 at a group's minimum, a NaN) has nothing written by it and is stored by the
    paths after it, the same bits as with the C calls off."""
    shape = CacheShape(3, 2, 10, 32, 32)
    gen = torch.Generator().manual_seed(bits)
    qkv = torch.randn(3, 1, 2, 3, 32, generator=gen) * 3  # (B, T, G, [q k v], D): k and v are strided views
    keys, values = qkv[:, :, :, 1].transpose(1, 2), qkv[:, :, :, 2].transpose(1, 2)
    awkward, broken = keys.clone(), values.clone()
    awkward[1, 1, 0, :16] = 0.0
    awkward[1, 1, 0, 3] = -0.0
    broken[2, 0, 0, 7] = float("nan")
    calls: list[bool] = []
    real = cpu_decode.quantize_token
    monkeypatch.setattr(cpu_decode, "quantize_token", lambda *a: calls.append(real(*a)) or calls[-1])
    for new_keys, new_values, taken in ((keys, values, True), (awkward, values, False), (keys, broken, False)):
        assert not new_keys.is_contiguous() or not new_values.is_contiguous()
        calls.clear()
        stores = _stored_both_ways(monkeypatch, shape, bits, 6, new_keys, new_values)
        assert calls == [taken, False]
        _assert_same_bits_in(stores, 6, 7)


@needs_compiler
@pytest.mark.parametrize("group", [64, 16])
@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_errors_equal_the_pytorch_ones(bits: int, group: int) -> None:
    """The C quantisation error (what `qh2o` reads, `QuantizedStorage.token_errors`) against PyTorch's
    `round_trip_error`: the same codes, the squares summed in another order (float32 rounding); a NaN row
    leaves the call to PyTorch."""
    gen = torch.Generator().manual_seed(bits * group)
    x = torch.randn(5, 3, 64, generator=gen) * torch.logspace(-3, 3, 5)[:, None, None]
    x[0, 0, :group] = 0.5  # a constant group: no error
    errors = cpu_decode.round_trip_errors(x, bits, group)
    assert errors is not None and errors.shape == (5, 3)
    torch.testing.assert_close(errors, round_trip_error(x, bits, group, torch.float16), rtol=1e-5, atol=0.0)
    assert float(errors[1:].min()) > 0.0
    x[2, 1, 7] = float("nan")
    assert cpu_decode.round_trip_errors(x, bits, group) is None


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
def test_a_staged_token_moves_into_its_slot_as_pytorch_moves_it(monkeypatch: pytest.MonkeyPatch, bits: int) -> None:
    """`QuantizedStorage.commit_staged` through the C call (`cpu_decode.commit`) leaves the buffers bitwise as
    the PyTorch move does: each (row, KV head)'s staged slot copied into its target, or nothing where the
    target is the room (the staged token dropped)."""
    shape = CacheShape(2, 3, 6, 32, 32)
    gen = torch.Generator().manual_seed(bits)
    stores = [QuantizedStorage(shape, None, torch.float32, bits, 16) for _ in range(2)]
    target = torch.tensor([[[0], [5], [6]], [[3], [6], [2]]])  # 6: the room
    moved = []
    for on, store in zip((True, False), stores, strict=True):
        store.write_range(0, torch.randn(2, 3, 6, 32, generator=gen), torch.randn(2, 3, 6, 32, generator=gen))
        store.stage(torch.randn(2, 3, 1, 32, generator=gen), torch.randn(2, 3, 1, 32, generator=gen))
        gen.manual_seed(bits)  # both stores hold the same tokens
        monkeypatch.setattr(cpu_decode, "CPU_KERNEL", on)
        before = {name: buffer.clone() for name, buffer in store.buffers().items()}
        if on:  # the C call applies to these buffers
            assert cpu_decode.commit(*(buffer.clone() for buffer in store._buffers()), target, bits, 16)
        store.commit_staged(target)
        moved.append(not any(torch.equal(buffer, before[name]) for name, buffer in store.buffers().items()))
    assert moved == [True, True]  # every buffer changed
    for name, buffer in stores[0].buffers().items():
        assert torch.equal(buffer.view(torch.uint8), stores[1].buffers()[name].view(torch.uint8)), name
