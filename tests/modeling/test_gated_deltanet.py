"""The Gated DeltaNet's chunked delta-rule scan and its one-token step against the gated delta rule run token
by token (float64), and pads (`g = beta = 0`) leaving a state bitwise unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from litkv.modeling.gated_deltanet import delta_rule_scan, delta_rule_step


def _naive(q, k, v, g, beta, s):  # noqa: ANN001, ANN202 -- the reference, the rule as written, token by token
    outs = []
    for t in range(q.shape[1]):
        for_row = []
        new = torch.empty_like(s)
        for b in range(q.shape[0]):
            heads = []
            for h in range(q.shape[2]):
                state = s[b, h] * torch.exp(g[b, t, h])
                state = state + beta[b, t, h] * torch.outer(k[b, t, h], v[b, t, h] - state.T @ k[b, t, h])
                new[b, h] = state
                heads.append(state.T @ q[b, t, h])
            for_row.append(torch.stack(heads))
        s = new
        outs.append(torch.stack(for_row))
    return torch.stack(outs, dim=1), s


def _inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    bsz, heads, dk, dv = 2, 3, 4, 5

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(bsz, t, heads, dk), dim=-1) * dk**-0.5
    k = F.normalize(randn(bsz, t, heads, dk), dim=-1)
    v = randn(bsz, t, heads, dv)
    g = -F.softplus(randn(bsz, t, heads))
    beta = torch.sigmoid(randn(bsz, t, heads))
    s0 = randn(bsz, heads, dk, dv)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize(("t", "chunk"), [(1, 4), (7, 1), (7, 3), (16, 4), (13, 8), (10, 64)])
def test_scan_equals_recurrence(t: int, chunk: int) -> None:
    q, k, v, g, beta, s0 = _inputs(t)
    out, s = delta_rule_scan(q, k, v, g, beta, chunk, s0)
    out_ref, s_ref = _naive(q, k, v, g, beta, s0)
    torch.testing.assert_close(out, out_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=1e-12)


def test_step_equals_recurrence() -> None:
    q, k, v, g, beta, s0 = _inputs(1, seed=1)
    out, s = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
    out_ref, s_ref = _naive(q, k, v, g, beta, s0)
    torch.testing.assert_close(out, out_ref[:, 0], atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(s, s_ref, atol=1e-13, rtol=1e-13)


def test_pads_keep_the_state_bitwise() -> None:
    """`g = beta = 0` is a token that leaves the state as it was, bit for bit, in the step and in the scan
    (a row whose tokens in a call are all pads); in the scan, pads after the real tokens change nothing."""
    q, k, v, g, beta, s0 = _inputs(6, seed=2)
    zero = torch.zeros_like(g)
    _, same = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], zero[:, 0], zero[:, 0], s0)
    assert torch.equal(same, s0)
    _, same = delta_rule_scan(q, k, v, zero, zero, 4, s0)
    assert torch.equal(same, s0)
    real = 4
    g_pad = torch.cat((g[:, :real], zero[:, real:]), dim=1)
    beta_pad = torch.cat((beta[:, :real], zero[:, real:]), dim=1)
    out, s = delta_rule_scan(q, k, v, g_pad, beta_pad, 4, s0)
    out_ref, s_ref = _naive(q[:, :real], k[:, :real], v[:, :real], g[:, :real], beta[:, :real], s0)
    torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out[:, :real], out_ref, atol=1e-12, rtol=1e-12)


def test_scan_with_strong_decay_stays_finite() -> None:
    """Large log decays (a state forgotten within a block) give the recurrence's values, no inf/nan."""
    q, k, v, g, beta, s0 = _inputs(24, seed=3)
    g = g * 40
    out, s = delta_rule_scan(q, k, v, g, beta, 8, s0)
    out_ref, s_ref = _naive(q, k, v, g, beta, s0)
    assert torch.isfinite(out).all() and torch.isfinite(s).all()
    torch.testing.assert_close(out, out_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=1e-12)
