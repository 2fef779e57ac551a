"""A decode step's linear products in C (`row_linear.row_linear`, taken by `RowLinear` for a few rows of one
position times a column-major float32 weight), against a float64 oracle and `F.linear`.

Bounds: each output is one running sum in input order (fused multiply-adds), so it is within `K` float32
roundings of the float64 product: `|y - y64| <= K * 2^-24 * sum |x_k w_k|` (the bound of a sum of `K` products).
A row's result does not depend on its batch: asserted bitwise. Skipped where this machine has no C compiler.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_gpt
from torch import nn

from litkv.core.c_build import find_compiler
from litkv.modeling import row_linear
from litkv.modeling.row_linear import MAX_OUT, MAX_ROWS, RowLinear, applies

needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler")


def _column_major(n: int, k: int, seed: int) -> torch.Tensor:
    """A `(n, k)` float32 weight stored column-major (strides `(1, n)`), as `columns_contiguous` stores it."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) / k**0.5).t().contiguous().t()


def _assert_within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`y` within the running sum's rounding bound of the float64 product (module docstring)."""
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    magnitude = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = (w.shape[1] + 1) * 2.0**-24 * magnitude
    assert bool(((y.double() - exact).abs() <= bound).all())


@needs_compiler
@pytest.mark.parametrize(("n", "k"), [(16, 7), (64, 64), (576, 576), (960, 576), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_within_rounding_of_float64_and_rows_do_not_depend_on_the_batch(
    n: int, k: int, bias: bool
) -> None:
    """Every number of rows up to `MAX_ROWS`: within the bound above, and each row bitwise the row alone."""
    w = _column_major(n, k, seed=n + k)
    b = torch.randn(n) if bias else None
    x = torch.randn(MAX_ROWS, 1, k) * 3
    alone = [row_linear.row_linear(x[r : r + 1], w, b) for r in range(MAX_ROWS)]
    for rows in range(1, MAX_ROWS + 1):
        y = row_linear.row_linear(x[:rows], w, b)
        assert y.shape == (rows, 1, n) and y.dtype == torch.float32
        _assert_within_rounding(y, x[:rows], w, b)
        for r in range(rows):
            assert torch.equal(y[r : r + 1], alone[r])


@needs_compiler
def test_a_wide_weight_is_taken_a_block_of_outputs_at_a_time() -> None:
    """More outputs than a block holds (8,192 for one row, 1,024 for eight): the same bound, rows alone bitwise."""
    w = _column_major(8192 + 64, 40, seed=1)
    x = torch.randn(MAX_ROWS, 1, 40)
    y = row_linear.row_linear(x, w, None)
    _assert_within_rounding(y, x, w, None)
    assert torch.equal(y[3:4], row_linear.row_linear(x[3:4], w, None))


def test_which_calls_take_the_product() -> None:
    """A decode-step call (rows of one position, at most `MAX_ROWS`, float32, no autograd, column-major weight)
    and nothing else; `fits` gives the class to plain float32 column-major layers up to `MAX_OUT` outputs."""
    w = _column_major(64, 32, seed=2)
    one = torch.randn(3, 1, 32)
    assert applies(one, w)
    assert not applies(torch.randn(3, 2, 32), w)  # two positions per row: a prefill chunk
    assert not applies(torch.randn(MAX_ROWS + 1, 1, 32), w)
    assert not applies(torch.randn(3, 1, 31), w)  # another input size: F.linear's error
    assert not applies(one.double(), w.double())
    assert not applies(one, w.contiguous())  # row-major
    assert not applies(one.requires_grad_(), w)
    with torch.no_grad():
        assert applies(one, w)
    layer = nn.Linear(32, 64)
    assert not RowLinear.fits(layer)  # row-major as built
    layer.weight.data = w
    assert RowLinear.fits(layer)
    layer.weight.data = _column_major(MAX_OUT + 16, 32, seed=3)
    assert not RowLinear.fits(layer)


@needs_compiler
def test_a_row_linear_layer_gives_f_linear_where_the_product_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """`RowLinear.forward`: the C product for a decode-step call (within rounding of `F.linear`), `F.linear`'s own
    bits for a prefill chunk, under autograd (with a gradient), and with `CPU_KERNEL` off."""
    layer = nn.Linear(48, 32)
    layer.weight.data = layer.weight.data.t().contiguous().t()
    layer.__class__ = RowLinear
    calls = []
    real = row_linear.row_linear
    monkeypatch.setattr(row_linear, "row_linear", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        step = torch.randn(2, 1, 48)
        _assert_within_rounding(layer(step), step, layer.weight, layer.bias)
        assert len(calls) == 1
        chunk = torch.randn(2, 5, 48)
        assert torch.equal(layer(chunk), F.linear(chunk, layer.weight, layer.bias))
    with torch.no_grad(), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        layer(torch.randn(2, 1, 47))
    x = torch.randn(1, 1, 48, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias)) and y.requires_grad
    monkeypatch.setattr(row_linear, "CPU_KERNEL", False)
    with torch.no_grad():
        assert torch.equal(layer(step), F.linear(step, layer.weight, layer.bias))
    assert len(calls) == 1


@needs_compiler
def test_a_cpu_model_decodes_through_the_product_within_rounding_of_float64() -> None:
    """`columns_contiguous` gives the model's linears the class (the LM head too, at this vocabulary), and a
    decode step's logits stay within float32 rounding of the float64 model's."""
    model = tiny_gpt(0)
    kinds = {type(m) for m in model.modules() if isinstance(m, nn.Linear)}
    assert kinds == {RowLinear}
    reference = tiny_gpt(0, torch.float64)
    tokens = torch.randint(0, 100, (2, 1))
    with torch.no_grad():
        logits = model(tokens)
        exact = reference(tokens)
    assert torch.allclose(logits.double(), exact, atol=1e-4, rtol=1e-4)
