"""`sample`: the draw follows the (top-k / top-p filtered) softmax, with device ops only (no host read)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from litkv.inference.generate import sample


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
