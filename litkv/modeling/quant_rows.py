"""A decode step's quantised linear products on the CPU in C: a few float32 rows times int4 or int8 weights.

PyTorch's packed kernels (`torch._weight_int4pack_mm_for_cpu`, `torch._weight_int8pack_mm`) take bfloat16 rows and
return bfloat16 outputs (fast on the CPU only so). `quant_rows_cpu.c` (beside this file) reads the codes once, in the
order they lie: `int4_rows` on the int4 kernel's own packed layout (where litkv reads it, `Int4Linear.unpackable`) and
its bfloat16 scales and zeros, `int8_rows` on the int8 codes and their per-output scales. Two ways, by the CPU:

- where it has AVX-512 VNNI and VBMI (and `INT8_ACTIVATIONS`), each row is first quantised to int8 per block of 32
  inputs (`d = max |x| / 127`, codes `round(x / d)`, as llama.cpp's `Q8_0`) and the codes multiplied in integer
  dot products (exact), then scaled in float32: each output is within float32 rounding of the float64 product of
  the dequantised weight with the dequantised row `quantized_rows(x)` (int8 weights: where `K` is a multiple of 64;
  else the other way), and within `sum |w| d / 2` of the product with `x` itself;
- elsewhere the codes are turned into float32 in registers and added into float32 sums: each output within float32
  rounding of the float64 product with `x`.

No bfloat16 rounding of the rows or of the outputs (`tests/modeling/test_quant_rows.py`); an output's bits are the
same for a row alone and in any batch of up to `MAX_ROWS`. The library also holds `litkv_int4_mlp` and
`litkv_int4_qkv`, a decode step's two halves of a block each in one call (`litkv.modeling.fused_decode`). Inside
`torch.compile` each product is the same computation as one opaque op (`litkv::int4_rows`, `litkv::int8_rows`), so
a compiled step keeps the eager step's bits. Built on first use by the machine's C compiler (`litkv.core.c_build`);
without one, one warning and the packed kernels everywhere. They run on the calling thread, so they are taken where
PyTorch runs on one thread; on more, the packed kernels (which split a product over the threads) as before.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from litkv.core.c_build import load

__all__ = [
    "CPU_KERNEL",
    "MAX_ROWS",
    "INT8_ACTIVATIONS",
    "int4_applies",
    "int4_packed",
    "int4_rows",
    "int4_rows_op",
    "int8_applies",
    "int8_packed",
    "int8_rows",
    "int8_rows_op",
    "library",
    "one_thread",
    "quantized_rows",
    "rows_quantized",
]

#: Whether the quantised layers take the C products where they apply; False: PyTorch's packed kernels.
CPU_KERNEL = True
#: Whether the C products quantise their rows to int8 where the CPU has AVX-512 VNNI and VBMI (faster; the outputs
#: differ from float32 rows' by the rows' rounding); False: float32 rows on every CPU (a library built apart).
INT8_ACTIVATIONS = True
#: Rows a call may have to take the C products (a decode step's sequences).
MAX_ROWS = 8
_INT4_BLOCK = 64  # output rows per block of the packed int4 layout
_LANES = 16  # the int8 product's vectors: the inputs a multiple of it
_LITTLE_ENDIAN = sys.byteorder == "little"  # the scale and zero of a bfloat16 pair read as one 32-bit word

SOURCE = Path(__file__).with_name("quant_rows_cpu.c")
_INT4_SIGNATURE = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4, ctypes.c_int)
_INT8_SIGNATURE = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3, ctypes.c_int)
_MLP_SIGNATURE = (
    [ctypes.c_void_p] * 3
    + [ctypes.c_int64]
    + [ctypes.c_void_p] * 2
    + [ctypes.c_float]
    + [ctypes.c_void_p] * 7
    + [ctypes.c_int64] * 4,
    ctypes.c_int,
)
_QKV_SIGNATURE = ([ctypes.c_void_p] * 2 + [ctypes.c_float] + [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 8, ctypes.c_int)
_QBLOCK = 32  # inputs per int8 block of a quantised row


def _rows_fit(flat: torch.Tensor) -> bool:
    """Whether `flat` `(rows, in)` is float32 on the CPU, at most `MAX_ROWS` rows, without autograd."""
    return (
        CPU_KERNEL
        and _LITTLE_ENDIAN
        and flat.is_cpu
        and flat.dtype is torch.float32
        and flat.dim() == 2
        and 1 <= flat.shape[0] <= MAX_ROWS
        and not (torch.is_grad_enabled() and flat.requires_grad)
    )


def int4_applies(flat: torch.Tensor, packed: torch.Tensor, group_size: int, unpackable: bool) -> bool:
    """Whether `flat` `(rows, K)` times an int4 layer's `packed` `(N, K / 2)` codes may take `int4_rows`: `_rows_fit`,
    the layout litkv reads (`unpackable`), `N` a multiple of the layout's 64-row blocks, `K` the layer's."""
    return (
        unpackable
        and _rows_fit(flat)
        and packed.shape[0] % _INT4_BLOCK == 0
        and flat.shape[1] == 2 * packed.shape[1]
        and flat.shape[1] % group_size == 0
    )


def int8_applies(flat: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether `flat` `(rows, K)` times int8 `codes` `(N, K)` may take `int8_rows`: `_rows_fit`, `K` the layer's and
    a multiple of 16."""
    return _rows_fit(flat) and flat.shape[1] == codes.shape[1] and codes.shape[1] % _LANES == 0


def int4_rows(flat: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """`flat @ W^T` for an int4 layer (`int4_applies` holds), `W = (c - 8) * scale + zero` per group of
    `group_size` inputs: `flat` `(rows, K)` float32, `packed` `(N, K / 2)` uint8, `scale_zeros` `(K / group_size,
    N, 2)` bfloat16 -> `(rows, N)` float32; by PyTorch's packed kernel (in bfloat16) where the library cannot be
    built or PyTorch runs on more than one thread (`one_thread`)."""
    lib = library() if one_thread() else None
    n, k = packed.shape[0], flat.shape[1]
    x, codes, sz = flat.contiguous(), packed.contiguous(), scale_zeros.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    pointers = (x.data_ptr(), codes.data_ptr(), sz.data_ptr(), y.data_ptr())
    if lib is None or lib.litkv_int4_rows(*pointers, *y.shape, k, group_size):
        return int4_packed(x, codes, sz, group_size)
    return y


def int8_rows(flat: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`flat @ (codes * scales[:, None])^T` for an int8 layer (`int8_applies` holds): `flat` `(rows, K)` float32,
    `codes` `(N, K)` int8, `scales` `(N,)` bfloat16 -> `(rows, N)` float32; by PyTorch's packed kernel (in bfloat16)
    where the library cannot be built or PyTorch runs on more than one thread (`one_thread`)."""
    lib = library() if one_thread() else None
    n, k = codes.shape
    x, c, s = flat.contiguous(), codes.contiguous(), scales.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    pointers = (x.data_ptr(), c.data_ptr(), s.data_ptr(), y.data_ptr())
    if lib is None or lib.litkv_int8_rows(*pointers, *y.shape, k):
        return int8_packed(x, c, s)
    return y


def quantized_rows(flat: torch.Tensor) -> torch.Tensor:
    """`flat` `(rows, K)` float32 as the C products see it where they quantise rows (`rows_quantized`): per block of
    32 inputs `d = max |x| / 127` and `round(x * (127 / max |x|)) * d` (ties to even; 0 where the block is 0)."""
    blocks = flat.reshape(flat.shape[0], -1, _QBLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127.0)).reshape(flat.shape)


def rows_quantized() -> bool:
    """Whether the C products quantise their rows to int8 on this CPU (`INT8_ACTIVATIONS` and the CPU's vector
    instructions; int8 weights only where `K` is a multiple of 64); False where there is no library."""
    lib = library()
    return lib is not None and bool(lib.litkv_int8_activations())


def int4_packed(flat: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """`int4_rows`'s product by PyTorch's packed kernel: `flat` `(rows, K)` rounded to bfloat16 on the way in, the
    output on the way out, returned in `flat`'s dtype."""
    y = torch._weight_int4pack_mm_for_cpu(flat.to(torch.bfloat16), packed, group_size, scale_zeros)
    return y.to(flat.dtype)


def int8_packed(flat: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`int8_rows`'s product by PyTorch's packed kernel, in bfloat16 as `int4_packed`'s, in `flat`'s dtype."""
    return torch._weight_int8pack_mm(flat.to(torch.bfloat16), codes, scales).to(flat.dtype)


int4_rows_op = torch.library.custom_op("litkv::int4_rows", int4_rows, mutates_args=())
int8_rows_op = torch.library.custom_op("litkv::int8_rows", int8_rows, mutates_args=())


@int4_rows_op.register_fake
def _int4_shape(flat: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    return flat.new_empty(flat.shape[0], packed.shape[0])


@int8_rows_op.register_fake
def _int8_shape(flat: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return flat.new_empty(flat.shape[0], codes.shape[0])


def one_thread() -> bool:
    """Whether PyTorch runs on one thread: the C products run on the calling thread only, and the packed kernels,
    which split a product over PyTorch's threads, measured faster on two (docs/results/cpu_speed.md). Read when a
    product runs (inside a compiled step too: the ops' bodies run eagerly), so eager and compiled steps agree."""
    return torch.get_num_threads() == 1


def library() -> ctypes.CDLL | None:
    """The compiled products (built on first use, then loaded from the kernel cache), or None (one warning) where
    they cannot be built."""
    signatures = {
        "litkv_int4_rows": _INT4_SIGNATURE,
        "litkv_int8_rows": _INT8_SIGNATURE,
        "litkv_int4_mlp": _MLP_SIGNATURE,
        "litkv_int4_qkv": _QKV_SIGNATURE,
        "litkv_int8_activations": ([], ctypes.c_int),
    }
    defines = () if INT8_ACTIVATIONS else ("-DLITKV_FLOAT_ACTIVATIONS",)
    fallback = "quantised one-row products take PyTorch's packed kernels"
    return load(SOURCE, defines, "quant_rows_cpu", signatures, fallback)
