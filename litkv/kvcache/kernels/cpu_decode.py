"""A quantised cache's decode step on the CPU in C: attention read straight from the codes, in one pass, and
the step's new tokens quantised in one call.

The PyTorch path (`litkv.kvcache.quant_attention._quant_attend_torch`) turns every layer's codes into a
full-size float32 temporary (or, from 2,048 slots, integer products with a dozen passes over the results)
before two matrix products, and quantising a token is some twenty small operators per layer. Here
`quant_decode_cpu.c` (beside this file) does both in C:

- `litkv_quant_attend` (`decode_attend`): per (row, KV head), blocks of 64 slots: the keys scored from their
  codes, a running softmax, the values added from their codes, so each slot's codes are read once (a block's
  float16 scales turned into float32 once; masks and soft-capping applied there; the weight sums
  (`need_weights`) from the scores it keeps and each query's maximum and sum). The keys' products are integer:
  each query (times the scale) rounded per group to two int8 digits (about 16 bits; `254 d1 + d2` an int16)
  whose products with the codes add up exactly in int32 (AVX-512 VNNI over 16 slots at a time where the
  compiler targets it, else vectors of ints: the same integers), the scale and offset applied per group
  (`quant_keys_cpu.h`); the values' codes as numbers times the softmax numerators times their scale, the
  offsets once per block. Written with GCC / Clang vector extensions (vectors of 16 numbers, or 8 or 4 where a
  group's size is not a multiple of 16; a group size that is not a multiple of 4 has no kernel and takes the
  PyTorch path).
- `litkv_quantize` (`quantize`, `quantize_into`; `litkv_quantize_pair`: `quantize_token`, a decode step's key
  and value read where they are): `litkv.kvcache.quantized.quantize` with float16 scales, bit for bit;
  `litkv_round_trip_errors` (`round_trip_errors`): the quantisation error `qh2o` reads.

The source is compiled on first use, once per (head size, groups per head, bits, query heads per KV head),
by the machine's C compiler (`$CC`, else `cc`, `gcc` or `clang`) with `-O3 -march=native`, into
`$LITKV_HOME/kernels/` (default `~/.cache/litkv`; `litkv.core.c_build`): a file named by the hash of the source,
the flags, the compiler and this CPU, written under a temporary name and renamed into place. Where no compiler
is found or the build fails, a warning says why once and the PyTorch path is taken.

Rounding: the queries' two int8 digits move each score by at most `sum_d |dq_d| |k_d - offset|` (|dq_d| at most
max |q| / 127 / 508 per group), the weights by a factor within `e^(+-2 eps)`; beyond that the kernel adds in another
order and takes its exponentials from a polynomial (relative error below 2e-7): results equal a float64 oracle of the
rounded queries within `atol=1e-5, rtol=1e-4` and the PyTorch path within the bound
(`tests/kvcache/test_quant_decode_cpu.py`; on the real model the KL to float32 weights and KV is that of the
PyTorch path: `scripts/bench_cpu.py kl --decode`). Every row is computed alone, in a fixed order: a row's result does
not depend on the batch it is in. The functions run on the calling thread (one core).

Attention takes the kernel where `supported` says so (the CPU, one query per row, float32 queries, no
autograd, `CPU_KERNEL`) and the scales are float16; every other call takes the PyTorch path.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from litkv.core.c_build import build, find_compiler

__all__ = ["CPU_KERNEL", "decode_attend", "find_compiler", "float_attend", "library", "quantize", "supported"]

#: Whether a decode step on the CPU takes this kernel where it applies; False: the PyTorch path everywhere
#: (`scripts/bench_cpu.py kv --cpu_kernel both` measures the two side by side).
CPU_KERNEL = True

SOURCE = Path(__file__).with_name("quant_decode_cpu.c")

_ARGS = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 11 + [ctypes.c_float] * 2
_FLOAT_ARGS = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 11 + [ctypes.c_float] * 2  # litkv_float_attend's
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
_QUANTIZE_ARGS = [_POINTER, _INT, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT]  # litkv_quantize's
_COMMIT_ARGS = [_POINTER, _INT, _POINTER, _POINTER, _INT, _POINTER, _INT, _INT]  # litkv_commit's
_PAIR_ARGS = [_POINTER, _INT, _INT, _POINTER, _INT, _INT, _INT, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT]
_lock = threading.Lock()
_built: dict[tuple[int, int, int, int], ctypes.CDLL | None] = {}


def supported(q: torch.Tensor, t: int) -> bool:
    """Whether a call of `t` queries per row with queries `q` may take this kernel (before it is built)."""
    return (
        CPU_KERNEL
        and q.device.type == "cpu"
        and t == 1
        and q.dtype == torch.float32
        and not (torch.is_grad_enabled() and q.requires_grad)
    )


def decode_attend(
    q: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    mask: torch.Tensor,
    query_valid: torch.Tensor | None,
    bits: int,
    group_size: int,
    scale: float,
    softcap: float | None,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Decode attention over quantised slots (`quant_attention._quant_attend_eager`'s contract at `T = 1`),
    or None when the kernel cannot be built here or has no attention for this shape (`group_size` not a
    multiple of 4, or above 256 for int8 codes; the caller then takes the PyTorch path).

    Args:
        q: `(B, G, M, D)` float32 queries, `M` the query heads of a KV head (one query each).
        codes: `(B, G, S, 2, D * bits / 8)` uint8 (index 0 of the fourth axis: key, 1: value), any strides
            over the first three axes (a slice of a larger buffer), the last two contiguous (else copied).
        scales, offsets: `(B, G, S, 2, D / group_size)` float16 (read as they are: any strides over the first
            three axes, the same for both) or bfloat16 (not taken: None).
        mask: `(B, G or 1, 1, S)` bool, True where attention is allowed, or None (every slot).
        query_valid: `(B, 1)` bool, whether the row's query counts in the weights (default: all).
        bits: 8 or 4; group_size: numbers per scale; scale: factor of `q . k`; softcap: or `None`.
        need_weights: also compute the weights summed over the query heads.

    Returns:
        `y` `(B, G, M, D)` float32 and the weights `(B, G, S)` float32 (a 0-element tensor unless
        `need_weights`), or None.
    """
    b, g, m, d = q.shape
    s, width = codes.shape[2], codes.shape[-1]
    if scales.dtype != torch.float16 or offsets.dtype != torch.float16:
        return None  # bfloat16 scales: a bfloat16 model, whose queries are not float32 either
    if bits == 8 and group_size > 256:
        return None  # a group's int8 codes times the queries' int16 numbers could pass int32 (quant_keys_cpu.h)
    lib = library(d, d // group_size, bits, m)
    if lib is None or not hasattr(lib, "litkv_quant_attend"):
        return None
    if codes.stride(-1) != 1 or codes.stride(-2) != width:
        codes = codes.contiguous()
    if scales.stride() != offsets.stride() or scales.stride(-1) != 1 or scales.stride(-2) != scales.shape[-1]:
        scales, offsets = scales.contiguous(), offsets.contiguous()
    call = _Call.of(q, mask, query_valid, need_weights, s)
    sizes = (b, g, s, *codes.stride()[:3], *scales.stride()[:3], *call.mask_strides)
    lib.litkv_quant_attend(*call.pointers(codes, scales, offsets), *sizes, scale, float(softcap or 0.0))
    return call.y, call.weights


def float_attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    query_valid: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Decode attention over float32 slots in one pass (`decode_attend`'s contract on float keys and values), or
    None when the kernel cannot be built here or has none for this head size (not a multiple of 4; the caller then
    takes its PyTorch path).

    Args:
        q: `(B, G, M, D)` float32 queries, `M` the query heads of a KV head (one query each).
        keys, values: `(B, G, S, D)` float32, any strides over the first three axes, the last contiguous (else
            copied).
        mask: `(B, G or 1, 1, S)` bool, True where attention is allowed, or None (every slot).
        query_valid, scale, softcap, need_weights: as `decode_attend`'s.
    """
    b, g, m, d = q.shape
    s = keys.shape[2]
    lib = library(d, 1, 32, m)
    if lib is None or not hasattr(lib, "litkv_float_attend"):
        return None
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if values.stride(-1) != 1:
        values = values.contiguous()
    call = _Call.of(q, mask, query_valid, need_weights, s)
    sizes = (b, g, s, *keys.stride()[:3], *values.stride()[:3], *call.mask_strides)
    lib.litkv_float_attend(*call.pointers(keys, values), *sizes, scale, float(softcap or 0.0))
    return call.y, call.weights


class _Call(NamedTuple):
    """What an attention call hands the C code beside its slots: the queries (contiguous; the C code scales them),
    the mask as bytes per slot `(B, G or 1, 1, S)` (or None: every slot) and its (row, KV head) strides, which rows
    count in the weights, the output `y`, and with `need_weights` the scores' scratch and the weights (else `None`
    and an empty tensor)."""

    queries: torch.Tensor
    mask: torch.Tensor | None
    mask_strides: tuple[int, int]
    counted: torch.Tensor | None
    y: torch.Tensor
    scores: torch.Tensor | None
    weights: torch.Tensor

    @classmethod
    def of(
        cls, q: torch.Tensor, mask: torch.Tensor | None, query_valid: torch.Tensor | None, need_weights: bool, s: int
    ) -> _Call:
        """The buffers of a call with queries `q` `(B, G, M, D)` over `s` slots."""
        b, g, m, d = q.shape
        mask_strides = (0, 0)
        if mask is not None:
            mask = mask.expand(b, mask.shape[1], 1, s)
            if mask.stride(-1) != 1:
                mask = mask.contiguous()
            mask_strides = (mask.stride(0), mask.stride(1) if mask.shape[1] == g else 0)
        if need_weights:
            counted = None if query_valid is None else query_valid[:, 0].contiguous()
            scores, weights = torch.empty(b, g, m, s, dtype=torch.float32), torch.empty(b, g, s, dtype=torch.float32)
        else:
            counted, scores, weights = None, None, q.new_empty(0)
        y = torch.empty(b, g, m, d, dtype=torch.float32)
        return cls(q if q.is_contiguous() else q.contiguous(), mask, mask_strides, counted, y, scores, weights)

    def pointers(self, *slots: torch.Tensor) -> list[int | None]:
        """The C function's pointer arguments: the queries, the `slots` tensors, then the mask, counted rows, `y`,
        the scores and the weights (`None` for those absent)."""
        weights = self.weights if self.scores is not None else None
        tensors = (self.queries, *slots, self.mask, self.counted, self.y, self.scores, weights)
        return [None if x is None else x.data_ptr() for x in tensors]


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`litkv.kvcache.quantized.quantize` with float16 scales, bit for bit, in one C call (`litkv_quantize`);
    None where it does not apply (not the CPU, `CPU_KERNEL` off, no kernel, a number that is not finite or
    beyond float16's range, signed zeros at a group's extreme): the caller then takes the PyTorch path.

    Args:
        x: `(..., D)` float32 (or narrower), `D` a multiple of `group_size` (and even for 4 bits).

    Returns:
        codes `(..., D * bits / 8)` uint8, scales and offsets `(..., D / group_size)` float16.
    """
    if not _applies(x) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    d = x.shape[-1]
    lib = library(d, d // group_size, bits, 1)
    if lib is None:
        return None
    flat = x.to(torch.float32).contiguous()
    codes = torch.empty(*x.shape[:-1], d * bits // 8, dtype=torch.uint8)
    scales = torch.empty(*x.shape[:-1], d // group_size, dtype=torch.float16)
    offsets = torch.empty_like(scales)
    rows = flat.numel() // d
    if lib.litkv_quantize(flat.data_ptr(), rows, rows, codes.data_ptr(), 0, scales.data_ptr(), offsets.data_ptr(), 0):
        return None
    return codes, scales, offsets


def round_trip_errors(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor | None:
    """`litkv.kvcache.quantized.round_trip_error` with float16 scales in one C call (`litkv_round_trip_errors`:
    the same codes, the squares summed in another order, so equal within float32 rounding); None where
    `quantize` is (the caller then takes the PyTorch path).

    Args:
        x: `(..., D)` float32.

    Returns:
        `(...)` float32 mean squared errors.
    """
    if not _applies(x) or x.dtype != torch.float32:
        return None
    d = x.shape[-1]
    lib = library(d, d // group_size, bits, 1)
    if lib is None:
        return None
    flat = x.detach().contiguous()
    errors = torch.empty(x.shape[:-1], dtype=torch.float32)
    if lib.litkv_round_trip_errors(flat.data_ptr(), flat.numel() // d, errors.data_ptr()):
        return None
    return errors


def quantize_into(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group_size: int
) -> bool:
    """`quantize(x)` written straight into a storage's slots (`QuantizedStorage.write_range`), bit for bit; False
    (nothing to rely on written) where it does not apply (as `quantize`, or slots laid out otherwise, or under
    `torch.compile`): the caller then writes `quantized.quantize`'s result.

    Args:
        x: `(B, G, T, 2, D)` float32 keys and values; codes `(B, G, T, 2, D * bits / 8)` uint8 and scales,
            offsets `(B, G, T, 2, D / group_size)` float16: views of slots `[start, start + T)` of buffers
            `(B, G, L, 2, *)` whose last three axes are contiguous and whose rows follow each other.
    """
    if not _applies(x) or x.dtype != torch.float32:
        return False
    b, g, t, _, d = x.shape
    if not _slots_in_rows(codes, scales, offsets):
        return False
    lib = library(d, d // group_size, bits, 1)
    if lib is None:
        return False
    flat = x.contiguous()
    per = t * 2  # a (row, KV head)'s T slots of key and value, then the next one's
    pointers = (codes.data_ptr(), codes.stride(1), scales.data_ptr(), offsets.data_ptr(), scales.stride(1))
    return lib.litkv_quantize(flat.data_ptr(), b * g * per, per, *pointers) == 0


def quantize_token(
    keys: torch.Tensor, values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
    slot: int, bits: int, group_size: int,
) -> bool:  # fmt: skip
    """`quantize_into` of a decode step's token (`litkv_quantize_pair`): keys and values `(B, G, 1, D)` float32 (any
    strides but the last axis's; no stacked copy) quantised into slot `slot` of a storage's whole buffers `(B, G,
    L, 2, *)` (`QuantizedStorage.write_range`), bit for bit; False (nothing to rely on written) where it does not
    apply, as `quantize_into`."""
    if not _applies(keys) or keys.dtype != torch.float32 or values.dtype != torch.float32 or keys.shape[2] != 1:
        return False
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or not _slots_in_rows(codes, scales, offsets):
        return False
    b, g, _, d = keys.shape
    lib = library(d, d // group_size, bits, 1)
    if lib is None:
        return False
    at = scales.element_size() * slot * scales.stride(2)
    pointers = (codes.data_ptr() + slot * codes.stride(2), codes.stride(1), scales.data_ptr() + at)
    done = lib.litkv_quantize_pair(
        keys.data_ptr(), keys.stride(0), keys.stride(1), values.data_ptr(), values.stride(0), values.stride(1), b, g,
        *pointers, offsets.data_ptr() + at, scales.stride(1),
    )  # fmt: skip
    return done == 0


def commit(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, target: torch.Tensor, bits: int, group_size: int
) -> bool:
    """`KVStorage.commit_staged` for a quantised storage's buffers in one C call (`litkv_commit`): the staged slot
    (the last) copied into slot `target` of each (row, KV head); False where it does not apply (as
    `quantize_into`'s layout conditions, or under `torch.compile`): the caller then moves it with PyTorch.

    Args:
        codes: `(B, G, L + 1, 2, D * bits / 8)` uint8, scales and offsets `(B, G, L + 1, 2, D / group_size)` float16:
            the storage's buffers; target: `(B, G, 1)` int64 slots, `L` where the staged token is dropped.
    """
    if not _applies(codes):
        return False
    b, g, room = codes.shape[0], codes.shape[1], codes.shape[2] - 1
    if target.dtype != torch.int64 or not _slots_in_rows(codes, scales, offsets):
        return False
    d = codes.shape[-1] * 8 // bits
    lib = library(d, d // group_size, bits, 1)
    if lib is None:
        return False
    slots = target.contiguous()
    pointers = (codes.data_ptr(), codes.stride(1), scales.data_ptr(), offsets.data_ptr(), scales.stride(1))
    lib.litkv_commit(*pointers, slots.data_ptr(), b * g, room)
    return True


def _applies(x: torch.Tensor) -> bool:
    """Whether a C call may serve `x` at all: on the CPU, `CPU_KERNEL` on, and not inside `torch.compile`'s
    tracing (which cannot follow a ctypes call)."""
    return CPU_KERNEL and x.device.type == "cpu" and not torch.compiler.is_compiling()


def _slots_in_rows(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether `(B, G, S, 2, *)` codes and float16 scales and offsets (the same strides) keep each slot's key and
    value side by side, slots one after the other, and the `(row, KV head)` pairs at one stride apart (the
    layout `litkv_quantize` and `litkv_commit` address)."""
    if scales.dtype != torch.float16 or scales.stride() != offsets.stride():
        return False
    b, g = codes.shape[:2]
    for part in (codes, scales):
        width = part.shape[-1]
        if part.stride()[2:] != (2 * width, width, 1) or (b > 1 and part.stride(0) != g * part.stride(1)):
            return False
    return True


def library(head: int, groups: int, bits: int, queries: int) -> ctypes.CDLL | None:
    """The kernel compiled for vectors of `head` numbers in `groups` groups of `bits`-bit codes and `queries`
    queries per KV head (built on first use, then loaded from `$LITKV_HOME/kernels/`), or None (with one
    warning) where it cannot be built."""
    key = (head, groups, bits, queries)
    if key in _built:  # built or refused before: no lock (a dict read is atomic)
        return _built[key]
    with _lock:
        if key not in _built:
            try:
                lib = ctypes.CDLL(str(_build(*key)))
                if bits == 32:  # float32 slots: attention only (none where `head` is not a multiple of 4)
                    if hasattr(lib, "litkv_float_attend"):
                        lib.litkv_float_attend.argtypes = _FLOAT_ARGS
                        lib.litkv_float_attend.restype = None
                    _built[key] = lib
                    return lib
                if hasattr(lib, "litkv_quant_attend"):  # absent where a group's size is not a multiple of 4
                    lib.litkv_quant_attend.argtypes = _ARGS
                    lib.litkv_quant_attend.restype = None
                lib.litkv_quantize.argtypes = _QUANTIZE_ARGS
                lib.litkv_quantize.restype = ctypes.c_int
                lib.litkv_round_trip_errors.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                lib.litkv_round_trip_errors.restype = ctypes.c_int
                lib.litkv_commit.argtypes = _COMMIT_ARGS
                lib.litkv_commit.restype = None
                lib.litkv_quantize_pair.argtypes = _PAIR_ARGS
                lib.litkv_quantize_pair.restype = ctypes.c_int
                _built[key] = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                warnings.warn(
                    f"litkv: the CPU kernel for KV decode ({head} numbers, {groups} groups, {bits} bits, "
                    f"{queries} queries per KV head) "
                    f"could not be built: {error}; its calls take the PyTorch path",
                    RuntimeWarning,
                    stacklevel=2,
                )
                _built[key] = None
        return _built[key]


def _build(head: int, groups: int, bits: int, queries: int) -> Path:
    """Compile the source for one (head, groups, bits, queries) into the kernel cache unless it is there."""
    if head % groups or head % 2 and bits == 4 or bits not in (8, 4, 32) or bits == 32 and groups != 1 or queries < 1:
        raise RuntimeError(f"no kernel for {head} numbers in {groups} groups of {bits} bits, {queries} queries")
    defines = (f"-DHEAD={head}", f"-DGROUPS={groups}", f"-DBITS={bits}", f"-DM={queries}")
    return build(SOURCE, defines, f"quant_decode_cpu_{head}_{groups}_{bits}_{queries}")
