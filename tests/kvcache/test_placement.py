"""`Placement.carry`: a direct call's placement (`start` set, no per-slot source) carries per-candidate state as
the gather over the slot-by-slot source (`placement_of`) does, bitwise, for every start and call length."""

from __future__ import annotations

import pytest
import torch

from litkv.kvcache.candidates import Placement, placement_of


@pytest.mark.parametrize(("start", "t"), [(0, 1), (5, 1), (9, 3), (0, 12), (11, 1)])
def test_a_direct_placement_carries_as_the_gather_does(start: int, t: int) -> None:
    b, g, length = 2, 3, 12
    state = torch.randn(b, g, length + t, generator=torch.Generator().manual_seed(start + t))
    slots = torch.arange(start, start + t).expand(b, g, t)
    valid = torch.ones_like(slots, dtype=torch.bool)
    gathered = placement_of(slots, slots - start, valid, length).carry(state)
    direct = Placement(slots, slots - start, valid, slots.new_empty(0), start)
    assert torch.equal(direct.carry(state), gathered)
    expected = state[..., :length].clone()  # slot start + j holds new token j (candidate length + j)
    expected[..., start : start + t] = state[..., length:]
    assert torch.equal(direct.carry(state), expected)
    stacked = Placement(slots[None].expand(2, b, g, t), (slots - start)[None].expand(2, b, g, t),
                        valid[None].expand(2, b, g, t), slots.new_empty(0), start)  # fmt: skip
    assert torch.equal(stacked.layer(1).carry(state), expected)
