"""The chunked scan and the recurrent step against the SSM recurrence run token by token (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from litkv.modeling.mamba2 import causal_conv, ssd_scan, ssd_step


def _naive(x, dt, a, b, c, h):  # noqa: ANN001, ANN202 -- the reference: h = exp(dt a) h + dt x b^T, y = h c
    ys = []
    for t in range(x.shape[1]):
        h = (
            torch.exp(dt[:, t] * a)[:, :, None, None] * h
            + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        )
        ys.append(torch.einsum("bhpn,bhn->bhp", h, c[:, t]))
    return torch.stack(ys, dim=1), h


def _inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    bsz, heads, p, n = 2, 3, 4, 5
    x = torch.randn(bsz, t, heads, p, generator=g, dtype=torch.float64)
    dt = F.softplus(torch.randn(bsz, t, heads, generator=g, dtype=torch.float64))
    a = -torch.rand(heads, generator=g, dtype=torch.float64) * 2
    b = torch.randn(bsz, t, heads, n, generator=g, dtype=torch.float64)
    c = torch.randn(bsz, t, heads, n, generator=g, dtype=torch.float64)
    h0 = torch.randn(bsz, heads, p, n, generator=g, dtype=torch.float64)
    return x, dt, a, b, c, h0


@pytest.mark.parametrize(("t", "chunk"), [(1, 4), (7, 1), (7, 3), (16, 4), (10, 32)])
def test_scan_equals_recurrence(t: int, chunk: int) -> None:
    x, dt, a, b, c, h0 = _inputs(t)
    y, h = ssd_scan(x, dt, a, b, c, chunk, h0)
    y_ref, h_ref = _naive(x, dt, a, b, c, h0)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(h, h_ref, atol=1e-12, rtol=1e-12)


def test_step_equals_recurrence_and_zero_dt_keeps_state_bitwise() -> None:
    x, dt, a, b, c, h0 = _inputs(1)
    y, h = ssd_step(x[:, 0], dt[:, 0], a, b[:, 0], c[:, 0], h0)
    y_ref, h_ref = _naive(x, dt, a, b, c, h0)
    torch.testing.assert_close(y, y_ref[:, 0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(h, h_ref, atol=1e-12, rtol=1e-12)
    _, same = ssd_step(x[:, 0], torch.zeros_like(dt[:, 0]), a, b[:, 0], c[:, 0], h0)
    assert torch.equal(same, h0)


def test_conv_continues_from_window() -> None:
    """Two calls through the window equal one causal convolution over the whole sequence."""
    g = torch.Generator().manual_seed(1)
    ch, k = 6, 4
    xbc = torch.randn(2, 9, ch, generator=g, dtype=torch.float64)
    weight = torch.randn(ch, 1, k, generator=g, dtype=torch.float64)
    bias = torch.randn(ch, generator=g, dtype=torch.float64)
    whole = F.conv1d(xbc.transpose(1, 2), weight, bias, padding=k - 1, groups=ch)[..., :9].transpose(1, 2)
    window = torch.zeros(2, ch, k - 1, dtype=torch.float64)
    first, window = causal_conv(xbc[:, :5], window, weight, bias, torch.full((2,), 5))
    second, _ = causal_conv(xbc[:, 5:], window, weight, bias, torch.full((2,), 4))
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, atol=1e-13, rtol=1e-13)
