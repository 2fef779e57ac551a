"""A score policy's per-candidate arithmetic on the CPU in C: KeyDiff's cosines.

`keydiff` scores every candidate by minus the cosine of its key to the anchor (the mean of the unit keys). Through
PyTorch's operators that is a norm and two batched products of a few hundred keys per layer, each far slower than
its arithmetic on the CPU; `scores_cpu.c` (beside this file) reads a layer's keys twice (the norms and the anchor,
then the products), per (row, KV head) (`keydiff_scores`). Inside `torch.compile` the same pass is the opaque op
`litkv::keydiff_scores`, so a compiled step keeps the eager step's bits.

Rounding: each product is 16 partial sums in a fixed order, not the BLAS's order: within float32 rounding of a
float64 oracle (`tests/kvcache/test_cpu_scores.py`), and a (row, head)'s scores the same alone and in a batch.
Built on first use by the machine's C compiler (`litkv.core.c_build`); without one, one warning and the PyTorch
path everywhere.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
import warnings
from pathlib import Path

import torch

from litkv.core.c_build import build

__all__ = ["CPU_KERNEL", "applies", "available", "keydiff_scores", "library"]

#: Whether `keydiff` scores take the C pass where it applies; False: the PyTorch path everywhere.
CPU_KERNEL = True

SOURCE = Path(__file__).with_name("scores_cpu.c")
_lock = threading.Lock()
_built: dict[int, ctypes.CDLL | None] = {}


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
    hold): keys
    `(B, G, N, D)` float32, any strides but the last axis's; positions `(B, G, N)` int64, `-1` where no token
    (left out of the anchor)."""
    op = _keydiff_op if torch.compiler.is_compiling() else _keydiff_scores
    return op(keys, positions)


def _keydiff_scores(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    b, g, n, d = keys.shape
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    positions = positions.contiguous()
    out = torch.empty(b, g, n, dtype=torch.float32)
    library(d).litkv_keydiff_scores(keys.data_ptr(), positions.data_ptr(), out.data_ptr(), b, g, n, *keys.stride()[:3])
    return out


_keydiff_op = torch.library.custom_op("litkv::keydiff_scores", _keydiff_scores, mutates_args=())


@_keydiff_op.register_fake
def _keydiff_scores_shape(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return keys.new_empty(keys.shape[:3])


def library(head: int) -> ctypes.CDLL | None:
    """The pass compiled for keys of `head` numbers (built on first use, then loaded from the kernel cache), or None
    (one warning) where it cannot be built."""
    with _lock:
        if head not in _built:
            try:
                lib = ctypes.CDLL(str(build(SOURCE, (f"-DHEAD={int(head)}",), f"scores_cpu_{int(head)}")))
                lib.litkv_keydiff_scores.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6
                lib.litkv_keydiff_scores.restype = ctypes.c_int
                _built[head] = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                warnings.warn(
                    f"litkv: the CPU kernel for policy scores ({head} numbers per key) could not be built: {error}; "
                    "they take the PyTorch path",
                    RuntimeWarning,
                    stacklevel=2,
                )
                _built[head] = None
        return _built[head]
