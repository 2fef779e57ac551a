"""`candidates.newest`, the recent window score policies and kvzip protect, against a per-row sort."""

from __future__ import annotations

import pytest
import torch

from litkv.kvcache.candidates import newest


def _by_sorting(positions: torch.Tensor, count: int) -> torch.Tensor:
    """The reference: each row's positions sorted newest first, the `count`-th of them the threshold."""
    flat = positions.reshape(-1, positions.shape[-1])
    out = torch.zeros_like(flat, dtype=torch.bool)
    for r, row in enumerate(flat.tolist()):
        threshold = sorted(row, reverse=True)[count - 1]
        out[r] = torch.tensor([p >= threshold for p in row])
    return out.view(positions.shape)


def _layouts(n: int) -> dict[str, torch.Tensor]:
    """`(2, 3, n)` positions as caches hold them: filled in order with one slot overwritten, shuffled by
    evictions, with empty slots and pads (-1), and with positions repeated (rows of a packed batch)."""
    gen = torch.Generator().manual_seed(n)
    in_order = torch.arange(n).repeat(2, 3, 1)
    in_order[..., n // 3] = n + 7
    shuffled = torch.stack([torch.randperm(n, generator=gen) for _ in range(6)]).view(2, 3, n)
    empty = shuffled.clone()
    empty[0, :, : n // 4] = -1
    repeated = torch.randint(0, n // 3 + 1, (2, 3, n), generator=gen)
    return {"in order": in_order, "shuffled": shuffled, "empty": empty, "repeated": repeated}


@pytest.mark.parametrize("n", [7, 64, 513])
@pytest.mark.parametrize("layout", ["in order", "shuffled", "empty", "repeated"])
def test_newest_marks_each_rows_count_largest_positions_and_their_ties(n: int, layout: str) -> None:
    positions = _layouts(n)[layout]
    for count in sorted({1, 2, n // 2, n - 1, n}):
        got = newest(positions, count)
        assert torch.equal(got, _by_sorting(positions, count)), (layout, count)
        assert bool((got.sum(-1) >= count).all())
