"""A decode step's linear products on the CPU in C: a few rows times a column-major float32 weight.

A decode step multiplies one row per sequence by every weight of the model. With the weight column-major (the
memory of `W^T`, as `litkv.modeling.weight_layout.columns_contiguous` stores a CPU model's float32 weights), the
BLAS's one-row product still read it well under the memory's pace on the AMD EPYC measured (docs/cpu_speed.md;
`scripts/bench_weight_layout.py` compares the two on any CPU);
`row_linear_cpu.c` (beside this file) reads each weight once, in order, into sums held in the first level of
cache (`litkv_row_linear`). `RowLinear` is the `nn.Linear` that takes it: `columns_contiguous` gives a CPU model's
column-major float32 linears that class (same parameters, same state dict), and its `forward` sends a call of at
most `MAX_ROWS` rows of one position each (a decode step, or a prefill chunk of one token), float32, without
autograd, to the C product (inside `torch.compile`: the same product as the opaque op `litkv::row_linear`, so a
compiled step keeps the eager step's bits); every other call is `F.linear`.

Rounding: each output is one running sum over the inputs in order (fused multiply-adds, the bias added last),
another order than the BLAS's: within float32 rounding of a float64 oracle (`tests/modeling/test_row_linear.py`),
and the same bits for a row alone and in any batch of up to `MAX_ROWS` rows. Built on first use by the machine's C
compiler (`litkv.core.c_build`); without one, one warning and `F.linear` everywhere.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from litkv.core.c_build import load

__all__ = ["CPU_KERNEL", "MAX_OUT", "MAX_ROWS", "RowLinear", "applies", "library", "row_linear"]

#: Whether `RowLinear` takes the C product where it applies; False: `F.linear` everywhere.
CPU_KERNEL = True
#: Rows (sequences of one position) a call may have to take the C product.
MAX_ROWS = 8
#: Widest weight (outputs) given the class: a wider one (an LM head) is read faster by the BLAS.
MAX_OUT = 8192
_LANES = 16  # the C product's vectors: the outputs a multiple of it

SOURCE = Path(__file__).with_name("row_linear_cpu.c")
_SIGNATURE = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3, ctypes.c_int)


class RowLinear(nn.Linear):
    """An `nn.Linear` whose decode-step calls take the C product (`applies`); constructed as an `nn.Linear`, or
    given to one by `columns_contiguous` (`fits`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(..., in_features)` -> `(..., out_features)`: `F.linear`, or the C product where `applies`."""
        if applies(x, self.weight):
            op = _row_linear_op if torch.compiler.is_compiling() else row_linear
            return op(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    @staticmethod
    def fits(module: nn.Module) -> bool:
        """Whether `module` is a plain `nn.Linear` whose weight the C product can take (float32 on the CPU,
        column-major, at most `MAX_OUT` outputs, a multiple of 16)."""
        weight = getattr(module, "weight", None)
        return (
            type(module) is nn.Linear
            and isinstance(weight, torch.Tensor)
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and _column_major(weight)
            and weight.shape[0] <= MAX_OUT
            and weight.shape[0] % _LANES == 0
        )


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x` `(..., 1, in)` times `weight` `(out, in)` may take the C product: `CPU_KERNEL`, float32 on the
    CPU, one position per row and at most `MAX_ROWS` rows, the weight's input size, a column-major weight, no
    autograd (anything else, a wrong size included, is `F.linear`'s to take or refuse)."""
    shape = x.shape
    return (
        CPU_KERNEL
        and x.is_cpu
        and x.dtype is torch.float32
        and weight.dtype is torch.float32
        and len(shape) >= 2
        and shape[-2] == 1
        and shape[-1] == weight.shape[1]
        and x.numel() <= MAX_ROWS * shape[-1]
        and _column_major(weight)
        and weight.shape[0] % _LANES == 0
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the C product (`applies(x, weight)` holds; `F.linear` itself where the
    library cannot be built): x `(..., K)` float32 of at most `MAX_ROWS` rows, weight `(N, K)` column-major,
    bias `(N,)` or None -> `(..., N)` float32."""
    lib = library()
    n, k = weight.shape
    if lib is None:
        return F.linear(x, weight, bias)
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.contiguous().data_ptr()
    if lib.litkv_row_linear(x.data_ptr(), weight.data_ptr(), bias_ptr, y.data_ptr(), x.numel() // k, n, k):
        return F.linear(x, weight, bias)
    return y


_row_linear_op = torch.library.custom_op("litkv::row_linear", row_linear, mutates_args=())


@_row_linear_op.register_fake
def _row_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def library() -> ctypes.CDLL | None:
    """The compiled product (built on first use, then loaded from the kernel cache), or None (one warning)
    where it cannot be built."""
    return load(SOURCE, (), "row_linear_cpu", {"litkv_row_linear": _SIGNATURE}, "one-row linear products take F.linear")


def _column_major(weight: torch.Tensor) -> bool:
    """Whether a 2-D `weight` `(out, in)` is stored column-major: strides `(1, out)`."""
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])
