"""Weight-only int8/int4 linear layers (`litkv.modeling.quant_weights`) against float references.

Tolerances: the packed kernels take bfloat16 activations and return bfloat16 outputs, so a product
differs from the float32 product with the same (dequantised) weight by at most the bfloat16 rounding
of each input and of the output: `|y - ref| <= 2^-7 * (|x| @ |w|.T + |bias|) + 1e-6` (two roundings of
relative 2^-9 each, with margin); a decode step's rows take the C products instead where they apply, which
meet a far tighter bound (test_quant_rows.py) and so this one too. The dequantised weights differ from the float
ones by at most half a quantisation step (plus the bfloat16 rounding of the scales and zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from litkv import GPT
from litkv.checkpoints.runtime import load_for_inference
from litkv.inference.generate import generate
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.quant_weights import (
    _PACK_ROWS,
    KERNEL_ROWS,
    Int4Linear,
    Int8Linear,
    WeightQuant,
    _kernel_codes,
    int4_codes,
    parse_quantize,
    quantize_model,
)


def _linear(out_features: int, in_features: int, bias: bool = True) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features) * in_features**-0.5)
        if bias:
            layer.bias.copy_(torch.randn(out_features) * 0.1)
    return layer


def _bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The bfloat16 rounding bound of `x @ w.T + bias` (module docstring)."""
    mag = x.abs() @ w.abs().T + (0 if bias is None else bias.abs())
    return mag * 2**-7 + 1e-6


def _half_steps(layer: nn.Linear, group: int) -> torch.Tensor:
    """Half the int4 quantisation step of each weight's group, `(range of the group) / 30`, float64."""
    w = layer.weight.detach().double()
    n, k = w.shape
    groups = w.view(n, k // group, group)
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    return (step / 2).expand_as(groups).reshape(n, k)


@pytest.mark.parametrize("shape", [(64, 64), (192, 128), (128, 256)])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_weights_are_the_group_quantisation_and_the_kernel_multiplies_by_them(
    shape: tuple[int, int], group: int
) -> None:
    n, k = shape
    layer = _linear(n, k)
    q = Int4Linear.from_linear(layer, group)
    w = q.dequantized(torch.float64)
    original, half_step = layer.weight.detach().double(), _half_steps(layer, group)
    # half a step, plus the bfloat16 rounding of the scale (relative 2^-9, times up to 15 steps) and zero
    assert ((w - original).abs() <= half_step * (1 + 2**-4) + 2**-8 * (original.abs() + 16 * half_step)).all()
    assert (w - original).abs().max() > 0.2 * half_step.max()  # really quantised
    for rows in (1, 3, KERNEL_ROWS + 5):
        x = torch.randn(2, rows, k)
        y = q(x)
        exact = x.double() @ w.T + layer.bias.double()
        assert y.shape == (2, rows, n) and y.dtype == torch.float32
        assert ((y.double() - exact).abs() <= _bound(x.double(), w, layer.bias.double())).all()


@pytest.mark.parametrize("n", [64, 80, 2048 + 64])
def test_int4_dequantised_weight_is_the_codes_times_scales_on_any_packed_layout(n: int) -> None:
    # the packed layout differs between CPUs (AVX512 / AVX2): whichever way the layer reads its codes back,
    # they are `int4_codes`'s and the weight is `(c - 8) * scale + zero` in float64, not rounded to bfloat16
    layer = _linear(n, 128)
    q = Int4Linear.from_linear(layer, 32)
    codes, scale_zeros = int4_codes(layer.weight, 32)
    assert torch.equal(q.codes_rows(0, n), codes)
    assert torch.equal(q.codes_rows(48, n - 16), codes[48 : n - 16])  # rows off the packed blocks
    scale, zero = (part.T.double().repeat_interleave(32, dim=1) for part in scale_zeros.unbind(-1))
    torch.testing.assert_close(q.dequantized(torch.float64), (codes.double() - 8) * scale + zero, rtol=0, atol=0)


def test_where_the_packed_layout_is_the_known_one_the_kernel_read_back_gives_the_unpacked_codes() -> None:
    layer = _linear(2048 + 64, 64)
    q = Int4Linear.from_linear(layer, 32)
    if not q.unpackable:  # measured at run time (`_layout_known`), e.g. False on an AVX2-only CPU
        pytest.skip("this CPU packs int4 in a layout litkv does not unpack (the kernel read-back is used)")
    codes = int4_codes(layer.weight, 32)[0]
    assert torch.equal(q.codes_rows(0, q.out_features), codes)  # `_unpack`
    for start in range(0, q.out_features, _PACK_ROWS):
        block = _kernel_codes(q.packed[start : start + _PACK_ROWS], 64, 32)
        assert torch.equal(block, codes[start : start + _PACK_ROWS])


@pytest.mark.parametrize("rows", [1, 4, KERNEL_ROWS + 1])
def test_int8_kernel_matches_the_per_channel_dequantised_product(rows: int) -> None:
    layer = _linear(96, 80)
    q = Int8Linear.from_linear(layer)
    w = layer.weight.detach().double()
    scales = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantized(torch.float64) - w).abs() <= scales * (0.5 + 2**-7) + 1e-9).all()
    ref = q.codes.double() * q.scales.double()[:, None]  # independent of `dequantized`
    x = torch.randn(rows, 80)
    y = q(x)
    exact = x.double() @ ref.T + layer.bias.double()
    assert ((y.double() - exact).abs() <= _bound(x.double(), ref, layer.bias.double())).all()


def test_no_bias_and_leading_dims() -> None:
    layer = _linear(64, 64, bias=False)
    for q in (Int8Linear.from_linear(layer), Int4Linear.from_linear(layer, 32)):
        x = torch.randn(3, 1, 64)
        w = q.dequantized(torch.float64)
        assert ((q(x).double() - x.double() @ w.T).abs() <= _bound(x.double(), w, None)).all()


@pytest.mark.parametrize(
    ("shape", "group", "message"),
    [
        ((40, 64), 32, "out_features a multiple of 16, got 40"),
        ((64, 48), 32, "in_features a multiple of the group size 32, got 48"),
        ((64, 96), 64, "in_features a multiple of the group size 64, got 96"),
    ],
)
def test_int4_shapes_the_kernel_cannot_take_are_refused_in_one_line(
    shape: tuple[int, int], group: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as err:
        Int4Linear.from_linear(_linear(*shape), group)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("int3", "quantize mode must be one of"),
        ("int4-g16", "int4 group size must be one of \\[32, 64, 128, 256\\], got 16"),
        ("int4-gx", "int4-gN"),
    ],
)
def test_bad_quantize_strings_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quantize(text)


def test_parse_quantize_names() -> None:
    assert parse_quantize("int4") == WeightQuant("int4", 32)
    assert parse_quantize("int4-g64").name == "int4-g64"
    assert parse_quantize("int8").name == "int8" and parse_quantize("none").mode == "none"


def test_a_refused_model_is_left_as_it_was() -> None:
    model = nn.Sequential(_linear(64, 64), _linear(40, 64))
    with pytest.raises(ValueError, match="^1: int4 weights need out_features a multiple of 16, got 40$"):
        quantize_model(model, WeightQuant("int4"))
    assert all(isinstance(m, nn.Linear) for m in model)


def test_a_model_off_the_cpu_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ValueError, match="runs on the CPU only, got a model on meta"):
        quantize_model(model, WeightQuant("int8"))


def _dequantised_copy(model: GPT, quantised: GPT) -> GPT:
    """`model` with each linear weight replaced by the quantised model's dequantised weight (float32)."""
    modules = dict(quantised.named_modules())
    with torch.no_grad():
        for name, linear in model.named_modules():
            if isinstance(linear, nn.Linear):
                linear.weight.copy_(modules[name].dequantized(torch.float32))
    return model


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tiny_model_logits_and_greedy_tokens_match_the_dequantised_float_model(
    tiny_model: Callable[..., GPT], mode: str
) -> None:
    quantised = quantize_model(tiny_model(seed=3), WeightQuant(mode))
    reference = _dequantised_copy(tiny_model(seed=3), quantised)
    assert isinstance(quantised.lm_head, Int8Linear)  # int4 keeps the LM head at int8 (`layer_quant`)
    assert isinstance(quantised.transformer.h[0].mlp.proj, Int8Linear if mode == "int8" else Int4Linear)
    idx = torch.randint(0, 128, (2, 5))
    with torch.no_grad():
        got, want = quantised(idx), reference(idx)
    tolerance = 0.05 * want.abs().max()
    assert (got - want).abs().max() < tolerance
    prompt = torch.randint(0, 128, (6,))
    kv = KVCacheConfig(policy="dense", cache_length=64)
    ours, theirs = (generate(m, [prompt], 24, kv)[0] for m in (quantised, reference))
    differ = (ours != theirs).nonzero()
    if len(differ):  # greedy paths may part only where the reference's top two are within the tolerance
        first = int(differ[0])
        with torch.no_grad():
            logits = reference(torch.cat((prompt, theirs[:first]))[None])[0, -1]
        assert logits.max() - logits[ours[first]] < 2 * tolerance
    assert len(differ) == 0 or int(differ[0]) >= 4


def test_load_for_inference_quantises_and_refuses_a_bad_mode(tiny_ckpt: Path) -> None:
    model, dev = load_for_inference(tiny_ckpt, None, "cpu", 1, "int4")
    assert dev.type == "cpu" and isinstance(model.transformer.h[0].attn.qkv, Int4Linear)
    assert isinstance(model.lm_head, Int8Linear)
    assert all(not isinstance(m, nn.Linear) for m in model.modules())
    with pytest.raises(ValueError, match="quantize mode must be one of"):
        load_for_inference(tiny_ckpt, None, "cpu", 1, "fp8")


def test_int4_groups_of_32_find_a_q4_1_grid_back_up_to_the_bfloat16_scales() -> None:
    # weights already on a 4-bit grid per block of 32 (what a Q4_1 GGUF dequantises to): the int4 codes
    # must land on that grid, so the error is the bfloat16 rounding of scale and zero, not half a step
    gen = torch.Generator().manual_seed(0)
    n, k = 64, 128
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=gen).double()
    codes[..., 0], codes[..., 1] = 0, 15  # every block spans its whole grid
    step = torch.rand(n, k // 32, 1, generator=gen, dtype=torch.float64) * 0.01 + 0.001
    low = torch.randn(n, k // 32, 1, generator=gen, dtype=torch.float64) * 0.05
    weight = (codes * step + low).reshape(n, k)
    linear = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    assert torch.equal(int4_codes(linear.weight, 32)[0].double(), codes.view(n, k))  # the grid's own codes
    error = (Int4Linear.from_linear(linear, 32).dequantized(torch.float64) - weight).abs().view(n, k // 32, 32)
    # bfloat16 rounds to 8 significant bits (relative error <= 2^-8): the scale, times codes up to 15, and
    # the zero (low + 8 scale)
    assert (error <= 2**-8 * (low.abs() + 23 * step) + 1e-7).all()
