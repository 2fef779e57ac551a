"""`learned`'s gate logits of new keys (`_gate_new_keys`, run in every layer at every decode step): equal to a
float64 oracle written from the definition (rotate the key back by its angle, dot with the gate, scale, add the
bias), and a token's logit is the same float32 number whether it arrives alone (a decode step) or inside a chunk
or a batch (a prefill): the dot product is summed per token."""

from __future__ import annotations

import math

import pytest
import torch

from litkv.core.rope import BoundRope
from litkv.gates.gate import EvictionGates
from litkv.kvcache.learned import _gate_new_keys

G, D = 3, 16


def _table(n_elem: int, base: float = 10000.0):
    """cos, sin `(N, n_elem)` in the half-split layout (LitGPT's), float32, covering 4,096 positions."""

    def table(needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        theta = 1.0 / base ** (torch.arange(0, n_elem, 2, dtype=torch.float64) / n_elem)
        angles = torch.outer(torch.arange(max(needed, 4096), dtype=torch.float64), theta).repeat(1, 2)
        return angles.cos().float(), angles.sin().float()

    return table


def _oracle(keys: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_elem: int):
    """float64: each key (after RoPE at its position) rotated by minus its angle, then the gate's affine map."""
    k = keys.double()
    half = n_elem // 2
    theta = 1.0 / 10000.0 ** (torch.arange(0, n_elem, 2, dtype=torch.float64) / n_elem)
    angle = pos.double()[..., None] * theta  # (B, T, n_elem / 2)
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2 = k[..., :half], k[..., half:n_elem]
    # RoPE: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s); its inverse:
    pre = torch.cat((x1 * c + x2 * s, x2 * c - x1 * s, k[..., n_elem:]), dim=-1)
    return (pre * weight.double()[None, :, None]).sum(-1) / math.sqrt(k.shape[-1]) + bias.double()[None, :, None]


@pytest.mark.parametrize("n_elem", [D, D // 2])
def test_logits_equal_a_float64_oracle_and_do_not_depend_on_the_chunk(n_elem: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(1, G, D, generator=gen), torch.randn(1, G, generator=gen)
    gates = EvictionGates(weight, bias, window=4, sinks=2)
    rope = BoundRope(_table(n_elem), n_elem)
    keys = torch.randn(2, G, 37, D, generator=gen) * 3
    pos = torch.randint(0, 4000, (2, 37), generator=gen)
    logits = _gate_new_keys(gates, rope, keys, pos)
    assert logits.dtype == torch.float32 and logits.shape == (2, G, 37)
    want = _oracle(keys, pos, weight[0], bias[0], n_elem)
    torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5)
    for b in range(2):
        for t in range(37):
            alone = _gate_new_keys(gates, rope, keys[b : b + 1, :, t : t + 1], pos[b : b + 1, t : t + 1])
            assert torch.equal(alone, logits[b : b + 1, :, t : t + 1]), (b, t)


def test_one_token_at_two_positions_gets_one_logit() -> None:
    """A pre-RoPE key rotated to two positions (one token id at two places in the first layer) gets one float32
    logit, so `drop_lowest` breaks the tie by position, not by the rounding of the table."""
    gen = torch.Generator().manual_seed(1)
    gates = EvictionGates(torch.randn(1, G, D, generator=gen), torch.randn(1, G, generator=gen), 4, 2)
    table = _table(D)
    rope = BoundRope(table, D)
    pre = torch.randn(1, G, 1, D, generator=gen)
    cos, sin = table(4096)
    pos = torch.tensor([[5, 3001]])
    half = D // 2
    rotated = torch.cat((-pre[..., half:], pre[..., :half]), dim=-1)
    keys = torch.cat([pre * cos[p] + rotated * sin[p] for p in pos[0].tolist()], dim=2)  # RoPE, float32
    logits = _gate_new_keys(gates, rope, keys, pos)
    assert torch.equal(logits[..., 0], logits[..., 1])
