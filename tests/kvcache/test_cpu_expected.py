"""Expected attention's C passes (`cpu_scores.expected_scores`, `cpu_scores.expected_stats`) against float64
oracles written from the paper's equations with explicit rotation matrices: partial RoPE, strided keys and values,
hidden slots, a (row, head) with nothing to see, with and without the covariance, the value norms and epsilon; a
row's bits alone and in a batch; the statistics of a decode step against the PyTorch path's, and the policy taking
both passes where they apply."""

from __future__ import annotations

import math

import pytest
import torch

from litkv import KVCacheConfig
from litkv.kvcache.base import CacheShape
from litkv.kvcache.expected_attention import ExpectedAttentionKVCache
from litkv.kvcache.kernels import cpu_scores
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.registry import get_kv_cache_class

pytestmark = pytest.mark.skipif(cpu_scores.library(64) is None, reason="no C compiler")

BASE, FUTURE = 500.0, 7


def _tables(n_elem: int, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 RoPE tables `(rows, n_elem)`, half-split layout, as views of wider tables (strided)."""
    inv = BASE ** (-torch.arange(0, n_elem, 2, dtype=torch.float64) / n_elem)
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv
    wide = torch.cat((angles.cos(), angles.cos(), angles.sin(), angles.sin()), dim=1).float()
    return wide[:, :n_elem], wide[:, n_elem:]


def _rotation(cos: torch.Tensor, sin: torch.Tensor, d: int) -> torch.Tensor:
    """`(d, d)` float64 matrix of RoPE at one position from the table's row (cos, sin `(n_elem,)`)."""
    n = cos.shape[0]
    r = torch.eye(d, dtype=torch.float64)
    for i in range(n // 2):
        j = i + n // 2
        r[i, i], r[i, j], r[j, i], r[j, j] = cos[i], -sin[i], sin[j], cos[j]
    return r


def _future(tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cos and signed sin of the offsets 1..FUTURE (what the policy's `bind_rope` keeps)."""
    cos, sin = (t[1 : FUTURE + 1].double().mean(dim=0) for t in tables)
    sign = torch.ones_like(sin)
    sign[: sin.shape[0] // 2] = -1
    return cos, sin * sign


def _stats(b: int, h: int, d: int, covariance: bool, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 30, d, generator=gen, dtype=torch.float64) * 2 + torch.randn(b, h, 1, d, generator=gen)
    s2 = q.transpose(-1, -2) @ q if covariance else q.new_zeros(b, h, 0, 0)
    return torch.full((b, h), 30.0, dtype=torch.float64), q.sum(dim=2), s2


def _case(d: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values `(2, 3, n, d)` (views of one slot more: strided) and positions: pads (-1), sinks (< 4), and
    row 1 head 2 with nothing but sinks and pads."""
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(2, 3, n + 1, d, generator=gen) * 1.5)[:, :, :n]
    values = (torch.randn(2, 3, n + 1, d, generator=gen) * torch.rand(2, 3, n + 1, 1, generator=gen))[:, :, 1:]
    positions = torch.randperm(2 * 3 * n, generator=gen).view(2, 3, n) + 2
    positions[0, 1, : n // 4] = -1
    positions[1, 2] = torch.arange(n) % 5 - 1
    return keys, values, positions


def _oracle(keys, values, positions, stats, tables, n_sink: int, vnorm: bool, epsilon: float) -> torch.Tensor:
    """Expected attention in float64 from its equations: `R` the mean of the rotations at the positions after the
    row's newest token, logits `(R mu) . k / sqrt(d) + k^T R Sigma R^T k / (2 d)` over the slots at positions
    `>= n_sink`, softmax per query head, the mean over the KV head's query heads, times `||v||` (plus epsilon)."""
    b, g, n, d = keys.shape
    s0, s1, s2 = stats
    per = s0.shape[1] // g
    out = torch.zeros(b, g, n, dtype=torch.float64)
    for r in range(b):
        newest = int(positions[r].max())
        rows = [min(max(newest + k, 0), tables[0].shape[0] - 1) for k in range(1, FUTURE + 1)]
        rot = torch.stack([_rotation(tables[0][p].double(), tables[1][p].double(), d) for p in rows]).mean(dim=0)
        for h in range(g):
            k, seen = keys[r, h].double(), positions[r, h] >= n_sink
            for p in range(h * per, (h + 1) * per):
                mu = s1[r, p] / s0[r, p]
                logits = k @ (rot @ mu) / math.sqrt(d)
                if s2.numel():
                    sigma = rot @ (s2[r, p] / s0[r, p] - torch.outer(mu, mu)) @ rot.T
                    logits = logits + ((k @ sigma) * k).sum(dim=-1) / (2 * d)
                if seen.any():
                    out[r, h] += torch.softmax(logits.masked_fill(~seen, -math.inf), dim=0) / per
        if vnorm:
            out[r] = (out[r] + epsilon) * values[r].double().norm(dim=-1)
    return out


@pytest.mark.parametrize("d, n_elem", [(64, 64), (64, 48), (16, 12)])
@pytest.mark.parametrize("n", [1, 17, 64, 513])
@pytest.mark.parametrize("covariance", [True, False])
def test_expected_scores_match_the_float64_equations(d: int, n_elem: int, n: int, covariance: bool) -> None:
    keys, values, positions = _case(d, n, d + n)
    tables = _tables(n_elem)
    stats = _stats(2, 9, d, covariance, n)
    for vnorm, epsilon in ((True, 0.0), (True, 0.25), (False, 0.0)):
        got = cpu_scores.expected_scores(keys, values, positions, stats, tables, _future(tables), 4, vnorm, epsilon)
        want = _oracle(keys, values, positions, stats, tables, 4, vnorm, epsilon)
        assert got.dtype == torch.float32 and got.shape == positions.shape
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-6 * float(want.abs().max()))
        if not epsilon:  # row 1 head 2 sees nothing: no weight anywhere
            assert not got[1, 2].any()


def test_expected_scores_of_a_row_are_the_same_bits_alone_and_in_a_batch() -> None:
    keys, values, positions = _case(64, 200, 3)
    tables, stats = _tables(64), _stats(2, 9, 64, True, 1)
    batch = cpu_scores.expected_scores(keys, values, positions, stats, tables, _future(tables), 4, True, 0.0)
    for r in range(2):
        one = tuple(s[r : r + 1] for s in stats)
        alone = cpu_scores.expected_scores(
            keys[r : r + 1].clone(), values[r : r + 1], positions[r : r + 1], one, tables, _future(tables), 4, True, 0.0
        )
        assert torch.equal(alone[0], batch[r])


def _policy(kernel: bool, n_stats: int | None, covariance: bool, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cpu_scores, "CPU_KERNEL", kernel)
    options = dict(n_stats=n_stats, use_covariance=covariance, n_sink=2, n_future_positions=FUTURE)
    config = KVCacheConfig("expected-attention", cache_length=32, options=options)
    cls = get_kv_cache_class("expected-attention")
    cache = SlotMachine(cls, config, CacheShape(2, 3, 32, 64, 64), None, torch.float32)
    policy = cache.policy
    assert isinstance(policy, ExpectedAttentionKVCache) and policy.c_scores is kernel
    tables = _tables(48)
    policy.bind_rope(lambda needed: tables, 48)
    return policy


@pytest.mark.parametrize("n_stats", [None, 3])
@pytest.mark.parametrize("covariance", [True, False])
def test_a_decode_steps_statistics_match_the_pytorch_path(
    n_stats: int | None, covariance: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three decode steps after a prompt: the C pass's statistics within float64 rounding of the PyTorch path's; a
    pad query (position -1) and one below `n_sink` leave their row's statistics as they were, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randn(2, 9, 6, 64, generator=gen)
    steps = [torch.randn(2, 9, 64 + 1, generator=gen)[..., 1:, None].transpose(-1, -2) for _ in range(3)]
    positions = [torch.tensor([[6], [-1]]), torch.tensor([[7], [1]]), torch.tensor([[8], [9]])]
    runs = {}
    for kernel in (True, False):
        policy = _policy(kernel, n_stats, covariance, monkeypatch)
        policy.stats = policy.updated_stats(prompt, torch.arange(6).expand(2, 6))
        history = []
        for q, pos in zip(steps, positions, strict=True):
            assert q.shape == (2, 9, 1, 64) and not q.is_contiguous()
            before = policy.stats
            policy.stats = policy.updated_stats(q, pos)
            history.append((before, policy.stats))
        runs[kernel] = history
    for (_, c_after), (_, t_after) in zip(runs[True], runs[False], strict=True):
        for got, want in zip(c_after, t_after, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # row 1: a pad at the first step, position 1 (below n_sink = 2) at the second
    for before, after in runs[True][:2]:
        assert all(torch.equal(a[1], b[1]) for a, b in zip(before, after, strict=True))


def test_the_policy_takes_the_c_passes_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 CPU cache's scores come from the C pass (the same bits as calling it), and with `CPU_KERNEL` off from
    the PyTorch path, within float32 rounding of the same equations."""
    keys, values, positions = _case(64, 40, 9)
    scores = {}
    for kernel in (True, False):
        policy = _policy(kernel, None, True, monkeypatch)
        stats = _stats(2, 9, 64, True, 4)
        scores[kernel] = policy.expected(stats, keys, values, positions)
    tables = _tables(48)
    direct = cpu_scores.expected_scores(keys, values, positions, stats, tables, _future(tables), 2, True, 0.0)
    assert torch.equal(scores[True], direct)
    want = _oracle(keys, values, positions, stats, tables, 2, True, 0.0)
    for got in scores.values():
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-6 * float(want.abs().max()))
