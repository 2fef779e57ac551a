"""Score policies' per-candidate arithmetic on the CPU in C: KeyDiff's cosines, SnapKV's one-query attention and
pool.

`keydiff` scores every candidate by minus the cosine of its key to the anchor (the mean of the unit keys); `snapkv`'s
decode step scores it by the new query's softmax weights. Through PyTorch's operators each is a few batched products
of a few hundred keys per layer, each far slower than its arithmetic on the CPU; `scores_cpu.c` (beside this file)
does them per (row, KV head): `keydiff_scores` reads a layer's keys twice (the norms and the anchor, then the
products), `snapkv_weights` once (the logits, then each query head's softmax). Inside `torch.compile` each is an
opaque op (`litkv::keydiff_scores`, `litkv::snapkv_weights`), so a compiled step keeps the eager step's bits.
`snapkv_pool` is snapkv's pool over neighbours in token order, mask and running maximum in one pass per row, the
PyTorch path's bits (its sort by position starts from the order the last call found: a decode step moves one
slot); eager only, a compiled step keeps the PyTorch operators (the same bits).

Rounding: each product is 16 partial sums in a fixed order, not the BLAS's order, exponentials from a polynomial
(`exp_cpu.h`, relative error below 2e-7): within float32 rounding of float64 oracles
(`tests/kvcache/test_cpu_scores.py`), and a (row, head)'s numbers the same alone and in a batch. Built on first use
by the machine's C compiler (`litkv.core.c_build`); without one, one warning and the PyTorch path everywhere.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from litkv.core.c_build import load

__all__ = ["CPU_KERNEL", "applies", "available", "keydiff_scores", "library", "snapkv_pool", "snapkv_weights"]

#: Whether `keydiff` and `snapkv` scores take the C passes where they apply; False: the PyTorch path everywhere.
CPU_KERNEL = True

SOURCE = Path(__file__).with_name("scores_cpu.c")
_SIGNATURES = {
    "litkv_keydiff_scores": ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6, None),
    "litkv_snapkv_weights": ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float], None),
    "litkv_snapkv_pool": (
        [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3,
        ctypes.c_int,
    ),
}


def available(device: torch.device, head: int) -> bool:
    """Whether calls on `device` with keys of `head` numbers may take the C pass: `CPU_KERNEL`, the CPU, and the
    library for that size built (built now if it is not: ask before `torch.compile` traces a call, as a policy
    does when its cache is built)."""
    return CPU_KERNEL and device.type == "cpu" and library(head) is not None


def applies(keys: torch.Tensor) -> bool:
    """Whether keys `(B, G, N, D)` on a device `available` said yes to may take the C pass: `CPU_KERNEL`, float32 on
    the CPU, no autograd."""
    return (
        CPU_KERNEL
        and keys.device.type == "cpu"
        and keys.dtype == torch.float32
        and keys.dim() == 4
        and not (torch.is_grad_enabled() and keys.requires_grad)
    )


def keydiff_scores(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`(B, G, N)` float32 minus the cosine of each key to its (row, head)'s anchor (`available` and `applies(keys)`
    hold): keys `(B, G, N, D)` float32, any strides but the last axis's; positions `(B, G, N)` int64, `-1` where no
    token (left out of the anchor)."""
    op = _keydiff_op if torch.compiler.is_compiling() else _keydiff_scores
    return op(keys, positions)


def _keydiff_scores(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    b, g, n, d = keys.shape
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    positions = positions.contiguous()
    out = torch.empty(b, g, n, dtype=torch.float32)
    library(d).litkv_keydiff_scores(keys.data_ptr(), positions.data_ptr(), out.data_ptr(), b, g, n, *keys.stride()[:3])
    return out


def snapkv_weights(
    queries: torch.Tensor, keys: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor
) -> torch.Tensor:
    """`(B, G, N)` float32 softmax weights of one query per head over the keys it may see (positions `0..` its
    own; none for a pad query), scale `1 / sqrt(D)`, summed over each KV head's query heads (`available` and
    `applies(keys)` hold): queries `(B, H, 1, D)` float32, keys `(B, G, N, D)` float32 (any strides but the last
    axis's), query_pos `(B, 1)` int64, key_pos `(B, G, N)` int64."""
    op = _snapkv_op if torch.compiler.is_compiling() else _snapkv_weights
    return op(queries, keys, query_pos, key_pos)


def _snapkv_weights(
    queries: torch.Tensor, keys: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor
) -> torch.Tensor:
    b, g, n, d = keys.shape
    m = queries.shape[1] // g
    q = queries.reshape(b, g, m, d).contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    key_pos, query_pos = key_pos.contiguous(), query_pos.reshape(b).contiguous()
    scratch = torch.empty(m * n, dtype=torch.float32)
    out = torch.empty(b, g, n, dtype=torch.float32)
    pointers = (x.data_ptr() for x in (q, keys, key_pos, query_pos, scratch, out))
    library(d).litkv_snapkv_weights(*pointers, b, g, m, n, *keys.stride()[:3], d**-0.5)
    return out


def snapkv_pool(
    weights: torch.Tensor, positions: torch.Tensor, best: torch.Tensor | None, kernel: int, order: torch.Tensor,
    head: int,
) -> torch.Tensor:  # fmt: skip
    """snapkv's kept scores `(..., N)` float32 (`snapkv._kept_scores`, the same bits): `weights` `(..., N)` float32
    pooled over `kernel` neighbours in token order, 0 at negative `positions` `(..., N)` int64, then the larger of
    that and `best` `(..., NB)` (`NB <= N`, 0 past it; None: no running maximum). `order` `(..., N)` int32, a
    permutation of `0..N-1` per row, is sorted in place by position and kept by the caller for its next call
    (a decode step's order then needs a few moves; any permutation gives the same result). Eager only
    (`order` is written): not for `torch.compile`'s graphs. `available(weights.device, head)` must hold (`head`: the
    keys' size, whose library holds the pass)."""
    *lead, n = weights.shape
    rows = weights.numel() // max(n, 1)
    if order.shape != weights.shape or order.dtype != torch.int32 or not order.is_contiguous():
        got = f"{order.dtype} {tuple(order.shape)}"
        raise ValueError(f"order must be int32 {tuple(weights.shape)} and contiguous, got {got}")
    if positions.shape != weights.shape or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be int64 {tuple(weights.shape)}, got {positions.dtype} {tuple(positions.shape)}"
        )
    weights, positions = weights.float().contiguous(), positions.contiguous()
    nb = 0 if best is None else best.shape[-1]
    best = None if best is None else best.float().contiguous()
    out = torch.empty(*lead, n, dtype=torch.float32)
    pointers = [None if x is None else x.data_ptr() for x in (weights, positions, best)]
    if library(head).litkv_snapkv_pool(*pointers, nb, order.data_ptr(), out.data_ptr(), rows, n, kernel):
        raise MemoryError(f"snapkv_pool: no scratch for {n} + {kernel} numbers")
    return out


_keydiff_op = torch.library.custom_op("litkv::keydiff_scores", _keydiff_scores, mutates_args=())
_snapkv_op = torch.library.custom_op("litkv::snapkv_weights", _snapkv_weights, mutates_args=())


@_snapkv_op.register_fake
def _snapkv_weights_shape(
    queries: torch.Tensor, keys: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor
) -> torch.Tensor:
    return keys.new_empty(keys.shape[:3])


@_keydiff_op.register_fake
def _keydiff_scores_shape(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return keys.new_empty(keys.shape[:3])


def library(head: int) -> ctypes.CDLL | None:
    """The passes compiled for keys of `head` numbers (built on first use, then loaded from the kernel cache), or
    None (one warning) where they cannot be built."""
    defines = (f"-DHEAD={int(head)}",)
    return load(SOURCE, defines, f"scores_cpu_{int(head)}", _SIGNATURES, "policy scores take the PyTorch path")
