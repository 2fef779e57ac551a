"""Rotary position embeddings applied to queries and keys (LitGPT's and Hugging Face's conventions).

The cos/sin tables come from LitGPT (`GPT.rope_cache`, with all its scaling variants); applying them
is litkv's own, so that the attention does not depend on helper functions that move between LitGPT
patch releases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["BoundRope", "RopeTable", "apply_rope", "yarn_mscale"]

#: The model's tables: `table(n)` gives cos and sin `(N, n_elem[, k])` with `N >= n` (`GPT._rope_table`).
RopeTable = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BoundRope:
    """The model's RoPE tables as a cache that declares `needs_rope` receives them (`KVCache.bind_rope`).

    Attributes:
        table: `table(n)` -> cos, sin covering every position of the calls the model runs.
        n_elem: how many dims of a head RoPE rotates.
        column: picks the last dim of per-layer tables, `None` for one table.
    """

    table: RopeTable
    n_elem: int
    column: int | None = None

    def at(self, positions: torch.Tensor, needed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `(*positions.shape, n_elem)` in the table's dtype at `positions` (`-1` read as 0). No
        host read: the table covers the positions of the call the model runs (`needed` more may be asked for)."""
        cos, sin = self.tables(needed)
        index = positions.to(cos.device).clamp(min=0, max=cos.shape[0] - 1)
        return cos[index], sin[index]

    def tables(self, needed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, sin tables `(N, n_elem)` (views, strided where the model has per-layer tables), `N >=
        needed` covering every position of the calls the model runs."""
        cos, sin = self.table(needed)
        if self.column is not None:
            cos, sin = cos[..., self.column], sin[..., self.column]
        return cos[:, : self.n_elem], sin[:, : self.n_elem]

    def at_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `(1, 1, n_elem)` at position 0: `at` of a zero position, read by slicing (no index)."""
        cos, sin = self.tables(1)
        return cos[None, :1], sin[None, :1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """Rotate `x` by the angles whose cosines and sines are `cos` and `sin`.

    Args:
        x: `(B, H, T, n)` queries or keys (the rotated part of the head only).
        cos: `(B or 1, T, n)` cosines.
        sin: `(B or 1, T, n)` sines.
        interleave: Pairs are `(x[2i], x[2i+1])` (GPT-J / DeepSeek layout) instead of `(x[i], x[i + n/2])`;
            the output is in the half-split layout either way, as in Hugging Face's `apply_rotary_pos_emb_interleave`.

    Returns:
        `(B, H, T, n)` in the dtype of `x`.
    """
    if cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must be 3-D of one shape (B, T, n), got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if interleave:
        *lead, d = x.shape
        x = x.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return (x * cos + rotated * sin).to(x.dtype)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature factor: `0.1 * mscale * ln(factor) + 1` for `factor > 1`, else 1."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0
