"""`cpu_select.lowest_one`, a decode step's drop in C, against a per-row brute force of the rule it stands for
(`ScoreKVCache.lowest(scores, positions, 1)`), and the PyTorch path giving the same drops, steps and tokens."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_gpt

from litkv import KVCacheConfig
from litkv.inference.generate import decode_greedy
from litkv.kvcache.config import ChunkPlan
from litkv.kvcache.kernels import cpu_select
from litkv.kvcache.kernels.cpu_select import lowest_one
from litkv.modeling.runner import run_chunks

pytestmark = pytest.mark.skipif(cpu_select.library() is None, reason="no C compiler")


def _brute_force(scores: torch.Tensor, positions: torch.Tensor, recent: int, sinks: int) -> list[int]:
    """Per row: the recent window by sorting (the `recent`-th largest position and every one at least it), the
    sinks, then the candidate with the lowest (value, position, index), values -inf for negative positions and
    +inf where protected."""
    out = []
    for s_row, p_row in zip(scores.reshape(-1, scores.shape[-1]).tolist(),
                            positions.reshape(-1, positions.shape[-1]).tolist(), strict=True):  # fmt: skip
        kth = sorted(p_row, reverse=True)[recent - 1] if recent > 0 else math.inf
        values = [
            -math.inf if p < 0 else math.inf if p >= kth or p < sinks else s + 0.0
            for s, p in zip(s_row, p_row, strict=True)
        ]
        out.append(min(range(len(p_row)), key=lambda i: (values[i], p_row[i], i)))  # noqa: B023 (used at once)
    return out


def _case(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(4, 3, n)` scores with ties, +-0, +-inf, and positions as a full cache holds them mid-decode: a shuffled
    window of consecutive newest positions, older ones scattered below, a few empty slots (-1)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (4, 3, n), generator=gen).float() / 2
    scores[scores == 0] = torch.tensor([0.0, -0.0])[torch.randint(0, 2, (int((scores == 0).sum()),), generator=gen)]
    scores[0, 0, 1], scores[1, 2, 3] = math.inf, -math.inf
    scores[3, 0] = torch.tensor([0.0, -0.0])[torch.randint(0, 2, (n,), generator=gen)]  # a row of +-0 ties
    positions = torch.empty(4, 3, n, dtype=torch.long)
    for row in positions.view(-1, n):
        older = torch.randperm(4 * n, generator=gen)[: n // 2].sort().values
        row.copy_(torch.cat((older, torch.arange(4 * n, 4 * n + n - n // 2)))[torch.randperm(n, generator=gen)])
    older_slots = (positions[2, 1] < 4 * n).nonzero().flatten()
    positions[2, 1, older_slots[:2]] = -1  # two empty slots
    return scores, positions


@pytest.mark.parametrize("n", [5, 33, 513])
@pytest.mark.parametrize(("recent", "sinks"), [(0, 0), (1, 0), (0, 4), ("window", 0), ("window", 3)])
def test_lowest_one_matches_brute_force(n: int, recent: int | str, sinks: int) -> None:
    scores, positions = _case(n, n)
    window = n - n // 2 if recent == "window" else recent  # every row's newest `window` are consecutive
    for r in range(4 if window else 1):  # smaller windows of the same rows, down to one token
        count = max(1, window >> r) if window else 0
        got = lowest_one(scores, positions, count, sinks)
        assert got is not None and got.shape == (4, 3, 1)
        assert got.flatten().tolist() == _brute_force(scores, positions, count, sinks), (count, sinks)


def test_lowest_one_declines_what_it_cannot_tell() -> None:
    """None where a row's newest candidates are not consecutive, a score it reads is NaN, a position is outside
    [-1, 2^31 - 1), or the scores are not float32 on the CPU; a NaN the rule overrides (a protected or empty slot)
    is no reason to decline."""
    scores, positions = _case(1, 33)
    gap = positions.clone()
    gap[3, 2][gap[3, 2].argmax()] += 2  # one row's newest token two positions after the rest of its window
    assert lowest_one(scores, gap, 10, 0) is None
    nan = scores.clone()
    nan[1, 1, positions[1, 1].argmin()] = math.nan  # its oldest token: read
    assert lowest_one(nan, positions, 10, 0) is None
    hidden = scores.clone()
    hidden[1, 1, positions[1, 1].argmax()] = math.nan  # its newest token: protected
    hidden[2, 1, 0] = math.nan  # an empty slot
    assert lowest_one(hidden, positions, 10, 0).flatten().tolist() == _brute_force(hidden, positions, 10, 0)
    far = positions.clone()
    far[0, 0, 0] = 2**31 - 1
    assert lowest_one(scores, far, 0, 0) is None
    assert lowest_one(scores.double(), positions, 10, 0) is None


@pytest.mark.parametrize("policy", ["h2o", "keydiff", "snapkv"])
def test_decode_takes_the_same_drops_with_and_without_it(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch decoding past a full cache (sinks and a recent window): the same tokens and cache positions with
    the C pass as with the PyTorch path, and the C pass answered the steps."""
    model = tiny_gpt(3)
    config = KVCacheConfig(policy, cache_length=24, chunk_size=8, options={"sinks": 2, "recent": 6})
    prompt = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(30))
    positions = torch.arange(30).expand(2, 30)
    answered = []
    real = cpu_select.lowest_one
    monkeypatch.setattr("litkv.kvcache.score.lowest_one", lambda *a: answered.append(real(*a)) or answered[-1])
    runs = []
    for kernel in (True, False):
        monkeypatch.setattr(cpu_select, "CPU_KERNEL", kernel)
        with torch.inference_mode(), model.kv_caches_attached(config, 2):
            hidden = run_chunks(model, prompt, positions, ChunkPlan.of(config), lm_head=False, last_only=True)
            tokens = decode_greedy(model, hidden, torch.tensor([30, 30]), 20)
            runs.append((torch.stack(tokens), torch.stack([c.positions for c in model.caches.policy_caches])))
        if kernel:
            assert sum(a is not None for a in answered) >= 19
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
