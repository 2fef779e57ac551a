"""A decode step's drop on the CPU in C: per row of scores, the one candidate that loses its slot.

`ScoreKVCache.lowest(scores, positions, 1)` (a decode step's choice, every score policy's, for one layer or all
layers stacked) is a dozen PyTorch operators over the rows: the recent window found by a `topk` of positions, the
sinks, two masked fills, a minimum, a comparison, a `where` and an `argmin`. `select_cpu.c` (beside this file)
does the same in one pass per row (`lowest_one`). Exact: comparisons only, so its answer is the PyTorch path's,
index for index; where it cannot tell (a row whose recent window is not its newest tokens one position each, a NaN
score) it says so and the caller takes the PyTorch path. Built on first use by the machine's C compiler
(`litkv.core.c_build`); without one, one warning and the PyTorch path everywhere.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from litkv.core.c_build import load

__all__ = ["CPU_KERNEL", "library", "lowest_one"]

#: Whether a decode step's drop takes the C pass where it applies; False: the PyTorch path everywhere.
CPU_KERNEL = True

SOURCE = Path(__file__).with_name("select_cpu.c")
_SIGNATURE = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4, ctypes.c_int)


def lowest_one(scores: torch.Tensor, positions: torch.Tensor, recent: int, sinks: int) -> torch.Tensor | None:
    """`(..., 1)` int64: per row the candidate `ScoreKVCache.lowest(scores, positions, 1)` drops, with the recent
    window of `recent` newest candidates and `sinks` protected, or None where the C pass does not answer (not
    `CPU_KERNEL`, not the CPU, inside `torch.compile`, under autograd, not float32 scores, no library, a row whose
    `recent` newest candidates are not those at least its largest position minus `recent - 1`, a NaN score).

    Args:
        scores: `(..., N)` float32 scores.
        positions: `(..., N)` int64 positions, `-1` for empty slots and pads.
        recent: the recent window (0: none), at most `N`.
        sinks: positions below it are protected (0: none).
    """
    if not (
        CPU_KERNEL
        and scores.device.type == "cpu"
        and scores.dtype == torch.float32
        and positions.dtype == torch.int64
        and scores.shape == positions.shape
        and scores.numel() > 0
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and scores.requires_grad)
    ):
        return None
    lib = library()
    if lib is None:
        return None
    n = scores.shape[-1]
    flat_scores, flat_positions = scores.reshape(-1, n).contiguous(), positions.reshape(-1, n).contiguous()
    out = torch.empty(flat_scores.shape[0], dtype=torch.int64)
    if lib.litkv_lowest_one(flat_scores.data_ptr(), flat_positions.data_ptr(), out.data_ptr(), out.shape[0], n,
                            recent, sinks):  # fmt: skip
        return None
    return out.view(*scores.shape[:-1], 1)


def library() -> ctypes.CDLL | None:
    """The compiled pass (built on first use, then loaded from the kernel cache), or None (one warning) where it
    cannot be built."""
    return load(SOURCE, (), "select_cpu", {"litkv_lowest_one": _SIGNATURE}, "a decode step's drop takes PyTorch")
