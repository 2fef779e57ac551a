"""Gradients through the cache in 16 bits: `chunked_loss_backward` under bf16 autocast (`bf16-mixed`:
float32 parameters, bfloat16 products) and with bfloat16 parameters (`bf16-true`).

References: plain autograd through `forward_chunked` under the same autocast (the engine must not change
the gradient beyond rounding), and the float64 twin with the same weights (where the policy keeps the same
tokens as in float64: positional `last-recent`, and `h2o`/`snapkv`, whose choices on this input agree).
Tolerance: `GRAD_EPS` eps(bfloat16) of each parameter's largest gradient (measured: at most 3.5; an engine
that drops the gradient sent through the cache to earlier chunks is off by more than 10).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from half import half_pair

from litkv import GPT, KVCacheConfig, chunked_loss_backward, forward_chunked

GRAD_EPS = 8.0
POLICIES = ("last-recent", "h2o", "snapkv")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(11))
    targets = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(12))
    targets[0, :6] = -100
    return idx, targets


def _grads(model: GPT) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert got.keys() == ref.keys() and len(ref) > 10
    return max(float((got[n] - r).abs().max() / r.abs().max()) for n, r in ref.items())


def _float64_grads(model64: GPT, cfg: KVCacheConfig) -> tuple[float, dict[str, torch.Tensor]]:
    idx, targets = _batch()
    model64.train()
    loss = F.cross_entropy(forward_chunked(model64, idx, cfg).flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item(), _grads(model64)


@pytest.mark.parametrize("policy", POLICIES)
def test_bf16_mixed_engine_equals_autograd_and_float64(policy: str) -> None:
    model, model64 = half_pair(torch.float32)
    cfg = KVCacheConfig(policy, cache_length=16, chunk_size=4, prefill_length=4)
    ref_loss, ref = _float64_grads(model64, cfg)
    idx, targets = _batch()
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = forward_chunked(model, idx, cfg).float()
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    autograd = _grads(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_loss_backward(model, idx, targets, cfg)
    engine = _grads(model)
    bound = GRAD_EPS * torch.finfo(torch.bfloat16).eps
    assert all(g.dtype == torch.float64 for g in engine.values())  # (copies of float32 .grad)
    assert loss == pytest.approx(ref_loss, rel=bound)
    assert _error(engine, autograd) <= bound
    assert _error(engine, ref) <= bound


@pytest.mark.parametrize("policy", POLICIES[:2])
def test_bf16_true_engine_equals_float64(policy: str) -> None:
    model, model64 = half_pair(torch.bfloat16)
    cfg = KVCacheConfig(policy, cache_length=16, chunk_size=4, prefill_length=4)
    ref_loss, ref = _float64_grads(model64, cfg)
    idx, targets = _batch()
    loss = chunked_loss_backward(model.train(), idx, targets, cfg)
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters() if p.grad is not None)
    bound = GRAD_EPS * torch.finfo(torch.bfloat16).eps
    assert loss == pytest.approx(ref_loss, rel=bound)
    assert _error(_grads(model), ref) <= bound
