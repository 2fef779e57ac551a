"""Score policies' per-candidate arithmetic on the CPU in C: KeyDiff's cosines, SnapKV's one-query attention and
pool, Expected Attention's scores and a decode step's statistics.

`keydiff` scores every candidate by minus the cosine of its key to the anchor (the mean of the unit keys); `snapkv`'s
decode step scores it by the new query's softmax weights. Through PyTorch's operators each is a few batched products
of a few hundred keys per layer, each far slower than its arithmetic on the CPU; `scores_cpu.c` (beside this file)
does them per (row, KV head): `keydiff_scores` reads a layer's keys twice (the norms and the anchor, then the
products), `snapkv_weights` once (the logits, then each query head's softmax). Inside `torch.compile` each is an
opaque op (`litkv::keydiff_scores`, `litkv::snapkv_weights`), so a compiled step keeps the eager step's bits.
`snapkv_pool` is snapkv's pool over neighbours in token order, mask and running maximum in one pass per row, the
PyTorch path's bits (its sort by position starts from the order the last call found: a decode step moves one
slot); eager only, a compiled step keeps the PyTorch operators (the same bits). `expected_scores` and
`expected_stats` are `expected-attention`'s score and statistics of a decode step (ops `litkv::expected_scores`,
`litkv::expected_stats` inside `torch.compile`).

Rounding: each product is 16 partial sums in a fixed order, not the BLAS's order, exponentials from a polynomial
(`exp_cpu.h`, relative error below 2e-7): within float32 rounding of float64 oracles
(`tests/kvcache/test_cpu_scores.py`), and a (row, head)'s numbers the same alone and in a batch. Built on first use
by the machine's C compiler (`litkv.core.c_build`); without one, one warning and the PyTorch path everywhere.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch

from litkv.core.c_build import load

__all__ = [
    "CPU_KERNEL",
    "applies",
    "available",
    "expected_scores",
    "expected_stats",
    "keydiff_scores",
    "keydiff_scores_layers",
    "library",
    "snapkv_pool",
    "snapkv_weights",
    "snapkv_weights_layers",
]

#: Whether `keydiff`, `snapkv` and `expected-attention` scores take the C passes where they apply; False: the PyTorch
#: path everywhere.
CPU_KERNEL = True

SOURCE = Path(__file__).with_name("scores_cpu.c")
_SIGNATURES = {
    "litkv_keydiff_scores": ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6, None),
    "litkv_keydiff_scores_layers": ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 7, None),
    "litkv_snapkv_weights": ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float], None),
    "litkv_snapkv_pool": (
        [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3,
        ctypes.c_int,
    ),
    "litkv_snapkv_weights_layers": ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float], None),
    "litkv_expected_scores": ([ctypes.c_void_p] * 12 + [ctypes.c_int64] * 16 + [ctypes.c_float], None),
    "litkv_expected_stats": (
        [ctypes.c_void_p]
        + [ctypes.c_int64] * 2
        + [ctypes.c_void_p] * 3
        + [ctypes.c_int64] * 5
        + [ctypes.c_double]
        + [ctypes.c_void_p] * 6
        + [ctypes.c_int64] * 2,
        None,
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


def keydiff_scores_layers(keys: Sequence[torch.Tensor], positions: torch.Tensor) -> torch.Tensor | None:
    """`keydiff_scores` of every layer of one decode step in one C call (eager), the same bits as a call per layer,
    stacked `(n_layers, B, G, N)`: each layer's keys `(B, G, N, D)` float32 (`applies`; every layer's of one shape
    and the same strides), positions `(n_layers, B, G, N)` int64; None where that does not hold or under
    `torch.compile` (then a call per layer)."""
    if not _alike_layers(keys):
        return None
    layers, (b, g, n, d) = len(keys), keys[0].shape
    addresses = torch.tensor([k.data_ptr() for k in keys], dtype=torch.int64)
    positions = positions.contiguous()
    out = torch.empty(layers, b, g, n, dtype=torch.float32)
    pointers = (x.data_ptr() for x in (addresses, positions, out))
    library(d).litkv_keydiff_scores_layers(*pointers, layers, b, g, n, *keys[0].stride()[:3])
    return out


def _alike_layers(keys: Sequence[torch.Tensor]) -> bool:
    """Whether one C call may read every layer's keys by address: eager, and every layer's keys of the first's
    shape and strides, the last axis contiguous."""
    first = keys[0]
    if torch.compiler.is_compiling() or first.stride(-1) != 1:
        return False
    return all(k.shape == first.shape and k.stride() == first.stride() for k in keys)


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


def snapkv_weights_layers(
    queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor], query_pos: torch.Tensor, key_pos: torch.Tensor
) -> torch.Tensor | None:
    """`snapkv_weights` of every layer of one decode step in one C call (eager), the same bits as a call per layer,
    stacked `(n_layers, B, G, N)`: each layer's queries `(B, H, 1, D)` and keys `(B, G, N, D)` float32 (every
    layer's keys of one shape and the same strides), query_pos `(B, 1)`, key_pos `(n_layers, B, G, N)` int64; None
    where that does not hold or under `torch.compile` (then a call per layer)."""
    if not _alike_layers(keys):
        return None
    first = keys[0]
    layers, (b, g, n, d) = len(keys), first.shape
    q = torch.stack(list(queries)).float()  # (n_layers, B, H, 1, D), contiguous
    addresses = torch.tensor([k.data_ptr() for k in keys], dtype=torch.int64)
    key_pos, query_pos = key_pos.contiguous(), query_pos.reshape(b).contiguous()
    m = q.shape[2] // g
    scratch, out = torch.empty(m * n, dtype=torch.float32), torch.empty(layers, b, g, n, dtype=torch.float32)
    pointers = (x.data_ptr() for x in (q, addresses, key_pos, query_pos, scratch, out))
    library(d).litkv_snapkv_weights_layers(*pointers, layers, b, g, m, n, *first.stride()[:3], d**-0.5)
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


def expected_scores(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, stats: tuple[torch.Tensor, ...],
    rope: tuple[torch.Tensor, torch.Tensor], future: tuple[torch.Tensor, torch.Tensor], n_sink: int, vnorm: bool,
    epsilon: float,
) -> torch.Tensor:  # fmt: skip
    """`(B, G, N)` float32 expected-attention scores (`ExpectedAttentionKVCache.expected`'s rule; `available` and
    `applies(keys)` hold, `values` float32, the head size a multiple of 16): keys and values `(B, G, N, D)` (any
    strides but the last axis's), positions `(B, G, N)` int64 (below `n_sink`: hidden), the float64 statistics
    `(s0 (B, H), s1 (B, H, D), s2 (B, H, D, D) or (B, H, 0, 0) without the covariance)`, `rope` the model's
    float32 RoPE tables `(positions, n_elem)` (any strides), `future` the mean cos and signed sin of the future
    offsets `(n_elem,)` float64.

    Unlike the PyTorch path, the mean future rotation `R` is applied to the statistics (`R mu`, `R Sigma R^T`, in
    float64) instead of to every key, and the quadratic forms run over 16 slots at a time in float32: within
    float32 rounding of the same float64 numbers."""
    op = _expected_op if torch.compiler.is_compiling() else _expected_scores
    return op(keys, values, positions, *stats, *rope, *future, n_sink, vnorm, epsilon)


def _expected_scores(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor,
    s2: torch.Tensor, table_cos: torch.Tensor, table_sin: torch.Tensor, future_cos: torch.Tensor,
    future_sin: torch.Tensor, n_sink: int, vnorm: bool, epsilon: float,
) -> torch.Tensor:  # fmt: skip
    b, g, n, d = keys.shape
    hq = s0.shape[1]
    covariance = s2.numel() > 0
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    s0, s1, positions = s0.contiguous(), s1.contiguous(), positions.contiguous()
    s2 = s2.contiguous() if covariance else None
    future_cos, future_sin = future_cos.contiguous(), future_sin.contiguous()
    scratch = torch.empty(hq * (d + (d * d if covariance else 0)) + hq // g * n, dtype=torch.float32)
    out = torch.empty(b, g, n, dtype=torch.float32)
    tensors = (keys, values, positions, s0, s1, s2, table_cos, table_sin, future_cos, future_sin, scratch, out)
    pointers = [None if x is None else x.data_ptr() for x in tensors]
    table_strides = _table_strides(table_cos, table_sin, d)
    n_elem = table_cos.shape[-1]
    if future_cos.shape != (n_elem,) or future_sin.shape != (n_elem,) or future_cos.dtype != torch.float64:
        raise ValueError(f"future must be two float64 ({n_elem},), got {future_cos.dtype} {tuple(future_cos.shape)}")
    _check_stats(s0, s1, s2)
    sizes = (b, g, hq // g, n, n_elem, table_cos.shape[0], *table_strides)
    strides = (*keys.stride()[:3], *values.stride()[:3])
    library(d).litkv_expected_scores(*pointers, *sizes, *strides, n_sink, vnorm, epsilon)
    return out


def expected_stats(
    queries: torch.Tensor, query_pos: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
    stats: tuple[torch.Tensor, ...], n_sink: int, decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Expected attention's statistics after a decode step (`ExpectedAttentionKVCache.updated_stats` with one query
    per row; `available` holds): queries `(B, H, 1, D)` float32 after RoPE (any strides but the last axis's) at
    `query_pos` `(B, 1)` int64, `rope` the model's float32 tables `(positions, n_elem)`, `stats` the float64
    `(s0, s1, s2)` before (`s2` `(B, H, 0, 0)` without the covariance), `decay` `1 - 1 / n_stats` (1: uniform
    weights). New tensors; the query turned back to position 0 in float64, as the PyTorch path does."""
    op = _stats_op if torch.compiler.is_compiling() else _expected_stats
    return op(queries, query_pos, *rope, *stats, n_sink, decay)


def _expected_stats(
    queries: torch.Tensor, query_pos: torch.Tensor, table_cos: torch.Tensor, table_sin: torch.Tensor,
    s0: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, n_sink: int, decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    b, hq, _, d = queries.shape
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    s0, s1, s2, query_pos = s0.contiguous(), s1.contiguous(), s2.contiguous(), query_pos.contiguous()
    _check_stats(s0, s1, s2)
    out = (torch.empty_like(s0), torch.empty_like(s1), torch.empty_like(s2))
    covariance = s2.numel() > 0
    pointers = [x.data_ptr() if covariance or i % 3 != 2 else None for i, x in enumerate((s0, s1, s2, *out))]
    library(d).litkv_expected_stats(
        queries.data_ptr(), queries.stride(0), queries.stride(1), query_pos.data_ptr(), table_cos.data_ptr(),
        table_sin.data_ptr(), table_cos.shape[0], *_table_strides(table_cos, table_sin, d), table_cos.shape[-1], n_sink,
        decay, *pointers, b, hq,
    )  # fmt: skip
    return out


def _check_stats(*stats: torch.Tensor | None) -> None:
    """The statistics the C passes read as float64."""
    if any(x is not None and x.dtype != torch.float64 for x in stats):
        raise ValueError(f"the statistics must be float64, got {[None if x is None else x.dtype for x in stats]}")


def _table_strides(table_cos: torch.Tensor, table_sin: torch.Tensor, head: int) -> tuple[int, int]:
    """The RoPE tables' strides (rows, numbers), which the C passes read for both; they rotate an even number of a
    head's `head` numbers."""
    n_elem = table_cos.shape[-1]
    if table_cos.dtype != torch.float32 or table_cos.stride() != table_sin.stride() or table_cos.dim() != 2:
        raise ValueError(
            f"the RoPE tables must be 2-D float32 of the same strides, got {table_cos.dtype} {table_cos.stride()} "
            f"and {table_sin.dtype} {table_sin.stride()}"
        )
    if n_elem % 2 or n_elem > head or table_sin.shape != table_cos.shape:
        raise ValueError(f"the RoPE tables must rotate an even number <= {head} of numbers, got {n_elem}")
    return table_cos.stride(0), table_cos.stride(1)


_expected_op = torch.library.custom_op("litkv::expected_scores", _expected_scores, mutates_args=())
_stats_op = torch.library.custom_op("litkv::expected_stats", _expected_stats, mutates_args=())


@_expected_op.register_fake
def _expected_scores_shape(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor,
    s2: torch.Tensor, table_cos: torch.Tensor, table_sin: torch.Tensor, future_cos: torch.Tensor,
    future_sin: torch.Tensor, n_sink: int, vnorm: bool, epsilon: float,
) -> torch.Tensor:  # fmt: skip
    return keys.new_empty(keys.shape[:3])


@_stats_op.register_fake
def _expected_stats_shape(
    queries: torch.Tensor, query_pos: torch.Tensor, table_cos: torch.Tensor, table_sin: torch.Tensor,
    s0: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, n_sink: int, decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return torch.empty_like(s0), torch.empty_like(s1), torch.empty_like(s2)


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
