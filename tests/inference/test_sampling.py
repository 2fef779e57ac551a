"""`sample`: the draw follows the (top-k / top-p filtered) softmax, with device ops only (no host read)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from litkv.inference.sampling import sample


def _frequencies(logits: torch.Tensor, n: int, **options: object) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits.expand(n, -1), generator=gen, **options)
    return torch.bincount(draws, minlength=logits.shape[-1]).double() / n


def test_draws_follow_the_softmax() -> None:
    """40,000 draws: every frequency within 4.5 standard errors of its probability (an independent
    reference: the softmax of the logits over the temperature, computed in float64)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 40_000
    freq = _frequencies(logits, n, temperature=0.7)
    p = torch.softmax(logits.double()[0] / 0.7, dim=-1)
    se = (p * (1 - p) / n).sqrt()
    assert bool(((freq - p).abs() <= 4.5 * se + 1e-12).all()), (freq, p)


def test_top_k_and_top_p_keep_only_their_tokens() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert set(torch.nonzero(_frequencies(logits, 5000, temperature=1.0, top_k=2)).flatten().tolist()) == {0, 1}
    p = torch.softmax(logits[0], dim=-1)  # 0.644, 0.237, 0.087, 0.032: top_p 0.7 keeps the first two
    assert float(p[0]) < 0.7 < float(p[:2].sum())
    assert set(torch.nonzero(_frequencies(logits, 5000, temperature=1.0, top_p=0.7)).flatten().tolist()) == {0, 1}


class _HostReads(TorchDispatchMode):
    """Counts ops that read a tensor on the host (`.item()`, `bool()`, `multinomial`'s checks)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func)
        if "_local_scalar_dense" in name or "multinomial" in name:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_sampling_reads_nothing_on_the_host() -> None:
    logits = torch.randn(3, 50)
    with _HostReads() as probe:
        sample(logits, temperature=0.8, top_k=10, top_p=0.9, generator=torch.Generator().manual_seed(1))
    assert probe.reads == []


# -- the edges (issue 47, item 6) -------------------------------------------------------------------


def test_temperatures_that_underflow_are_greedy() -> None:
    """1e-300 and 5e-324 are valid temperatures that are 0 in float32: greedy, never NaN or token 0."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) + 1.0
    logits[:, 0] = -5.0  # token 0 is nobody's argmax
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for t in (1e-300, 5e-324, 1e-40, 1e-7):
            got = sample(logits.to(dtype), temperature=t, generator=torch.Generator().manual_seed(0))
            assert torch.equal(got, logits.to(dtype).float().argmax(dim=-1)), (dtype, t)


def test_top_p_that_underflows_keeps_the_top_token() -> None:
    logits = torch.tensor([[0.5, 3.0, 1.0, 0.0]] * 64)
    for top_p in (1e-300, 5e-324, 1e-45):
        got = sample(logits, temperature=1.0, top_p=top_p, generator=torch.Generator().manual_seed(0))
        assert got.tolist() == [1] * 64, top_p


def test_tiny_temperature_above_the_floor_draws_among_tied_tokens_only() -> None:
    """Just above the floor: the float32 division is exact for a shifted row (largest logit 0), so two
    tied maxima share the draws and no other token is ever drawn; no NaN."""
    logits = torch.tensor([[1.0, 4.0, 4.0, 3.9999]])
    freq = _frequencies(logits, 4000, temperature=2e-6)
    assert float(freq[0] + freq[3]) == 0.0
    assert 0.4 < float(freq[1]) < 0.6


def test_huge_temperature_and_non_finite_logits() -> None:
    """A temperature that overflows float32 (1e300) is uniform over the kept tokens (top-k masks stay
    masked, no -inf/inf NaN); a NaN logit is never drawn; +inf (a float16 overflow) is the sure pick."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    freq = _frequencies(logits, 6000, temperature=1e300, top_k=3)
    assert float(freq[3:].sum()) == 0.0 and bool((freq[:3] > 0.28).all())
    nan_row = torch.tensor([[float("nan"), 1.0, 1.0, float("-inf")]])
    freq = _frequencies(nan_row, 2000, temperature=1.0)
    assert float(freq[0] + freq[3]) == 0.0
    inf_row = torch.tensor([[1.0, float("inf"), 2.0]], dtype=torch.float16)
    assert _frequencies(inf_row, 500, temperature=0.9).tolist() == [0.0, 1.0, 0.0]


def test_a_row_with_no_finite_logit_is_its_argmax() -> None:
    """docs/reliability.md: a row with no finite logit falls back to its argmax (issue 61 item 7: an
    all -inf row was drawn uniformly, -inf having become float32's lowest finite value); a NaN in it is
    never the pick. Every seed, temperature and top-k/top-p gives the argmax of the row without NaN."""
    rows = torch.full((3, 6), float("-inf"))
    rows[1, 4] = float("nan")
    rows[2, 0] = float("nan")
    expected = [0, 0, 1]  # the argmax of the -inf entries (all tied: the first), never the NaN
    for seed in range(20):
        for options in ({"temperature": 1.0}, {"temperature": 0.7, "top_k": 3}, {"temperature": 2.0, "top_p": 0.5}):
            got = sample(rows, generator=torch.Generator().manual_seed(seed), **options)  # type: ignore[arg-type]
            assert got.tolist() == expected, (seed, options)
