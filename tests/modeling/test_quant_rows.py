"""The C products of a few rows by int4 / int8 weights (`litkv.modeling.quant_rows`) against float64 oracles.

The oracle of an int4 layer is built from `int4_codes` of the float weight (the codes, scales and zeros before any
packing), so it does not read the packed layout the kernel reads. Each test runs both ways the library is built
(`INT8_ACTIVATIONS` on and off), and asks the library which one this CPU takes (`rows_quantized`): where the rows are
quantised to int8, the oracle's input is the dequantised row `quantized_rows(x)` (computed here in PyTorch), and the
output must also be within `|x - x_q| @ |W|^T` (plus the rounding bound) of the product with `x` itself.

Error bounds of the C products, per output, with `m = |x| @ ((|c| + 8) |s| + |z|)^T` (int4) or `|x| @ |W|^T`
(int8): float32 rows, int4: each group of G inputs one running sum of codes times inputs and one of inputs (G
roundings each), then a few roundings per group, so `(G + K / G + 4) * 2^-23 * m`; int8: `K` roundings. Int8 rows:
the integer sums are exact, then two roundings per block of 32 (int4) or 64 (int8) inputs and a few per group, so
`(K / 16 + 4 K / G + 8) * 2^-23 * m`. All far inside the bfloat16 bound the packed kernels meet
(test_quant_weights.py), which the tests check too, so they fail if a call silently took the packed kernels.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litkv.modeling import quant_rows
from litkv.modeling.quant_weights import Int4Linear, Int8Linear, WeightQuant, int4_codes, quantize_model

EPS = 2.0**-23


def _linear(out_features: int, in_features: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features) * in_features**-0.5 + 0.02)
    return layer


def _int4_oracle(layer: nn.Linear, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantised weight `(c - 8) s + z` in float64 and its magnitude `(|c| + 8) |s| + |z|`, `(N, K)` each."""
    codes, scale_zeros = int4_codes(layer.weight, group)
    scale, zero = (part.T.double().repeat_interleave(group, dim=1) for part in scale_zeros.unbind(-1))
    c = codes.double()
    return (c - 8) * scale + zero, (c + 8) * scale.abs() + zero.abs()


@pytest.fixture(params=[True, False], ids=["int8-activations", "float-activations"])
def activations(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both builds of the library; True where this CPU then quantises the rows."""
    monkeypatch.setattr(quant_rows, "INT8_ACTIVATIONS", request.param)
    return quant_rows.rows_quantized()


def _input(x: torch.Tensor, quantized: bool) -> torch.Tensor:
    """The row the product multiplies: `x`, or where the library quantises rows, `x` dequantised from int8."""
    return quant_rows.quantized_rows(x) if quantized else x


def _needs_kernel() -> None:
    if quant_rows.library() is None:
        pytest.skip("no C compiler: the quantised layers take PyTorch's packed kernels")
    if torch.get_num_threads() != 1:
        pytest.skip("PyTorch runs on more than one thread: the quantised layers take the packed kernels")


@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (960, 576, 32), (128, 512, 64), (192, 256, 128)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_rows_are_the_dequantised_product_within_float32_rounding(
    n: int, k: int, group: int, rows: int, activations: bool
) -> None:
    _needs_kernel()
    layer = _linear(n, k)
    q = Int4Linear.from_linear(layer, group)
    if not q.unpackable:
        pytest.skip("this CPU packs int4 in a layout litkv does not read (the packed kernel is used)")
    w, magnitude = _int4_oracle(layer, group)
    x = torch.randn(rows, k) * torch.linspace(0.1, 3, k)
    assert quant_rows.int4_applies(x, q.packed, group, q.unpackable)
    y = q(x)
    row = _input(x, activations).double()
    error = (y.double() - row @ w.T).abs()
    roundings = k // 16 + 4 * (k // group) + 8 if activations else group + k // group + 4
    bound = roundings * EPS * (row.abs() @ magnitude.T)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert (error <= bound).all()
    assert error.max() < 2**-12 * (row.abs() @ w.abs().T).max()  # not the bfloat16 kernel's rounding
    assert ((y.double() - x.double() @ w.T).abs() <= (row - x.double()).abs() @ w.abs().T + bound).all()


@pytest.mark.parametrize(("n", "k"), [(16, 16), (1000, 576), (35, 80), (40, 128)])
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_int8_rows_are_the_dequantised_product_within_float32_rounding(
    n: int, k: int, rows: int, activations: bool
) -> None:
    _needs_kernel()
    q = Int8Linear.from_linear(_linear(n, k))
    w = q.codes.double() * q.scales.double()[:, None]  # not `dequantized`: the codes and scales themselves
    x = torch.randn(rows, k)
    assert quant_rows.int8_applies(x, q.codes)
    y = q(x)
    quantized = activations and k % 64 == 0  # int8 weights quantise rows of whole 64-input pieces only
    row = _input(x, quantized).double()
    error = (y.double() - row @ w.T).abs()
    bound = ((k // 16 + 8) if quantized else (k + 4)) * EPS * (row.abs() @ w.abs().T)
    assert (error <= bound).all()
    assert error.max() < 2**-12 * (row.abs() @ w.abs().T).max()
    assert ((y.double() - x.double() @ w.T).abs() <= (row - x.double()).abs() @ w.abs().T + bound).all()


def test_a_row_gives_the_same_bits_alone_and_in_any_batch(activations: bool) -> None:
    _needs_kernel()
    layers = (Int4Linear.from_linear(_linear(192, 128), 32), Int8Linear.from_linear(_linear(1000, 576)))
    for q in layers:
        x = torch.randn(8, q.in_features)
        together = q(x)
        for r in range(8):
            assert torch.equal(q(x[r : r + 1]), together[r : r + 1])
        assert torch.equal(q(x[2:5]), together[2:5])


def test_calls_it_cannot_take_go_to_the_packed_kernels() -> None:
    _needs_kernel()
    int4 = Int4Linear.from_linear(_linear(80, 64), 32)  # 80 outputs: not whole 64-row blocks
    x = torch.randn(2, 64)
    assert not quant_rows.int4_applies(x, int4.packed, 32, int4.unpackable)
    want = torch._weight_int4pack_mm_for_cpu(x.bfloat16(), int4.packed, 32, int4.scale_zeros).float()
    assert torch.equal(int4(x), want)
    int8 = Int8Linear.from_linear(_linear(32, 48))
    wide = torch.randn(1, 48, dtype=torch.float64)  # not float32
    assert not quant_rows.int8_applies(wide, int8.codes)
    want = torch._weight_int8pack_mm(wide.bfloat16(), int8.codes, int8.scales).double()
    assert torch.equal(int8(wide), want)
    many = torch.randn(9, 64)  # a prefill chunk: more rows than the C products take
    assert not quant_rows.int4_applies(many, int4.packed, 32, True)


def test_int8_layers_need_inputs_a_multiple_of_16() -> None:
    # PyTorch's int8 CPU kernel crashes the process on other widths: refused in one line instead
    with pytest.raises(ValueError, match="int8 weights need in_features a multiple of 16, got 40"):
        Int8Linear.from_linear(_linear(32, 40))
    model = nn.Sequential(nn.Linear(48, 32), nn.Linear(32, 40), nn.Linear(40, 16))
    with pytest.raises(ValueError, match=r"^2: int8 weights need in_features a multiple of 16, got 40$"):
        quantize_model(model, WeightQuant("int8"))
    assert all(type(m) is nn.Linear for m in model)  # left as it was


def test_switched_off_the_layers_take_the_packed_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    q = Int4Linear.from_linear(_linear(128, 64), 32)
    x = torch.randn(1, 64)
    monkeypatch.setattr(quant_rows, "CPU_KERNEL", False)
    want = torch._weight_int4pack_mm_for_cpu(x.bfloat16(), q.packed, 32, q.scale_zeros).float()
    assert torch.equal(q(x), want)


def test_on_more_threads_the_layers_take_the_packed_kernels() -> None:
    q = Int8Linear.from_linear(_linear(64, 64))
    x = torch.randn(1, 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = q(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, torch._weight_int8pack_mm(x.bfloat16(), q.codes, q.scales).float())


def test_compiled_calls_take_the_same_product_as_an_op() -> None:
    _needs_kernel()
    int4 = Int4Linear.from_linear(_linear(128, 64), 32)
    int8 = Int8Linear.from_linear(_linear(48, 128))
    x = torch.randn(2, 1, 64)
    with torch.inference_mode():
        eager = int8(int4(x))
        compiled = torch.compile(lambda t: int8(int4(t)), backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(compiled, eager)


def test_quantized_rows_are_within_half_a_step_of_the_row() -> None:
    x = torch.randn(3, 128) * torch.linspace(0.01, 5, 128)
    x[1, 32:64] = 0  # a block of zeros stays zeros
    x[2, 5] = 2.5 * (x[2, :32].abs().max() / 127) * 127 / 2.5  # ties and the block's largest value alike
    q = quant_rows.quantized_rows(x)
    step = x.reshape(3, -1, 32).abs().amax(-1, keepdim=True) / 127
    codes = q.reshape(3, -1, 32) / torch.where(step > 0, step, torch.ones_like(step))
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 127 + 1e-4
    assert ((q - x).reshape(3, -1, 32).abs() <= step / 2 * (1 + 1e-5)).all()
    assert torch.equal(q[1, 32:64], torch.zeros(32))
