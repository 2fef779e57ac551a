"""A decode step over float32 slots on the CPU in one C pass (`cpu_decode.float_attend`, taken by
`attention.attend` for one query per head), against a float64 oracle and against the PyTorch path
(`attention._attend_torch`: SDPA, or the weights pass).

Bounds: the kernel adds in another order than SDPA (a key in 16, 8 or 4 partial sums, a running softmax over
blocks of 64 slots) and takes its exponentials from a polynomial (relative error below 2e-7), so outputs and
weight sums agree with the float64 oracle within `atol=1e-5, rtol=1e-4`, as the quantised caches' kernel does.
A row's result does not depend on its batch: asserted bitwise. Skipped where this machine has no C compiler
(the kernel is then not used: `test_without_the_kernel_attend_takes_the_pytorch_path`).
"""

from __future__ import annotations

import pytest
import torch

from litkv.kvcache.kernels import cpu_decode
from litkv.modeling import attention
from litkv.modeling.attention import CAUSAL, attend, build_mask

TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}

needs_compiler = pytest.mark.skipif(cpu_decode.find_compiler() is None, reason="no C compiler")


def _case(b: int, n_head: int, g: int, s: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Queries `(B, H, 1, D)`, keys and values `(B, G, S, D)` as views of larger slots, key positions with empty
    slots and a hidden run longer than a block, and which rows' queries count (the last is a pad)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n_head, 1, d, generator=gen)
    k = torch.randn(b, g, s + 5, d, generator=gen)[:, :, :s] * 1.5
    v = torch.randn(b, g, s + 5, d, generator=gen)[:, :, :s]
    k_pos = torch.randperm(4 * s, generator=gen)[:s].expand(b, g, s).clone()
    k_pos[:, :, :3] = -1
    k_pos[-1, -1, s // 4 : 3 * s // 4] = -1
    valid = torch.ones(b, 1, dtype=torch.bool)
    valid[-1] = False
    return q, k, v, k_pos, valid


def _oracle(q, k, v, allowed, scale, softcap=None):  # noqa: ANN001, ANN202
    """float64 attention: `y` `(B, 1, H * D)` and the weights summed over each group's heads `(B, G, S)`."""
    b, n_head, _, d = q.shape
    g = k.shape[1]
    scores = torch.einsum("bgmd,bgsd->bgms", q.double().view(b, g, n_head // g, d), k.double()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    y = torch.einsum("bgms,bgsd->bgmd", probs, v.double())
    return y.reshape(b, 1, n_head * d), probs.sum(dim=2)


@needs_compiler
@pytest.mark.parametrize(("n_head", "g", "d"), [(9, 3, 64), (8, 8, 32), (4, 1, 12)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_kernel_matches_the_float64_oracle_and_its_rows_do_not_depend_on_the_batch(
    n_head: int, g: int, d: int, softcap: float | None
) -> None:
    """Output and weight sums within the bounds above: a mask from positions (empty slots, a hidden run of more
    than a block, a pad query that counts in no sum), grouped heads (3 per KV head, 1, and 4 with 12 numbers per
    head: vectors of 4), soft-capping; each row alone gives its batched result bit for bit."""
    q, k, v, k_pos, valid = _case(3, n_head, g, 150, d)
    mask = build_mask(torch.full((3, 1), 1000), k_pos)  # (B, G, 1, S)
    y, w = attend(q, k, v, mask, 0.3, softcap=softcap, need_weights=True, query_valid=valid)
    want_y, want_w = _oracle(q, k, v, mask, 0.3, softcap)
    torch.testing.assert_close(y[:2].double(), want_y[:2], **TOLERANCE)  # the pad row sees nothing: undefined
    torch.testing.assert_close(w.double(), torch.where(valid[:, :, None], want_w, 0.0), **TOLERANCE)
    for row in range(3):
        y1, w1 = attend(q[row : row + 1], k[row : row + 1], v[row : row + 1], mask[row : row + 1], 0.3,
                        softcap=softcap, need_weights=True, query_valid=valid[row : row + 1])  # fmt: skip
        assert torch.equal(y1, y[row : row + 1]) and torch.equal(w1, w[row : row + 1])


@needs_compiler
@pytest.mark.parametrize("mask", [None, CAUSAL])
def test_every_key_visible_matches_the_pytorch_path(mask: object) -> None:
    """No mask (a dense decode step over full slots) and `CAUSAL` (the query is the last key): the kernel's output
    agrees with SDPA's (`_attend_torch`) and the oracle's; without weights no sums come back."""
    q, k, v, _, _ = _case(2, 9, 3, 513, 64, seed=1)
    y, w = attend(q, k, v, mask, 0.125)
    torch_y, _ = attention._attend_torch(q, k, v, mask, 0.125, None, False, None)
    want_y, _ = _oracle(q, k, v, torch.ones(1, dtype=torch.bool), 0.125)
    assert w is None
    torch.testing.assert_close(y, torch_y, **TOLERANCE)
    torch.testing.assert_close(y.double(), want_y, **TOLERANCE)


@needs_compiler
def test_attend_takes_the_kernel_only_for_one_float32_query_without_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which calls reach `float_attend`: a float32 decode step under no_grad does; several queries, float64, and a
    query that needs gradients take the PyTorch path."""
    calls = []
    real = cpu_decode.float_attend
    monkeypatch.setattr(cpu_decode, "float_attend", lambda *a: calls.append(1) or real(*a))
    q, k, v, _, _ = _case(1, 4, 2, 20, 16, seed=2)
    with torch.no_grad():
        attend(q, k, v, None, 0.25)
        assert len(calls) == 1
        attend(torch.cat((q, q), dim=2), k, v, None, 0.25)  # two queries
        attend(q.double(), k.double(), v.double(), None, 0.25)
    attend(q.requires_grad_(), k, v, None, 0.25)
    assert len(calls) == 1


@pytest.mark.parametrize("why", ["no kernel", "head size"])
def test_without_the_kernel_attend_takes_the_pytorch_path(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """Where the kernel cannot be built (`library` gives None: no compiler, a failed build) or has no vectors for
    the head size (6 numbers: not a multiple of 4), a decode step's output and weights are the PyTorch path's, bit
    for bit."""
    if why == "no kernel":
        monkeypatch.setattr(cpu_decode, "library", lambda *a: None)
    q, k, v, k_pos, valid = _case(2, 9, 3, 70, 64 if why == "no kernel" else 6, seed=3)
    mask = build_mask(torch.full((2, 1), 1000), k_pos)
    with torch.no_grad():
        y, w = attend(q, k, v, mask, 0.3, need_weights=True, query_valid=valid)
        want_y, want_w = attention._attend_torch(q, k, v, mask, 0.3, None, True, valid)
    assert torch.equal(y, want_y) and torch.equal(w, want_w)
