"""The chunked gradient engine carries the recurrent state across chunks: its gradients equal plain
autograd over the whole sequence (dense caches) and over the chunked pass (h2o evicting), float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from bamba_helpers import VOCAB, bamba_config
from helpers import tiny_gpt

from litkv import KVCacheConfig
from litkv.gradient.chunked_backward import chunked_loss_backward
from litkv.inference.generate import forward_chunked


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_engine_gradients_equal_autograd(policy: str) -> None:
    model = tiny_gpt(13, torch.float64, config=bamba_config(chunk=4)).train()
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, VOCAB, (2, 27), generator=gen)
    targets = torch.randint(0, VOCAB, (2, 27), generator=gen)
    targets[0, :5] = -100
    cfg = KVCacheConfig(policy, cache_length=32 if policy == "dense" else 12, chunk_size=5, prefill_length=7)
    loss = chunked_loss_backward(model, idx, targets, cfg)
    got = _grads(model)
    logits = model(idx) if policy == "dense" else forward_chunked(model, idx, cfg)
    expected_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    expected_loss.backward()
    expected_loss = expected_loss.detach()
    expected = _grads(model)
    assert loss == pytest.approx(float(expected_loss), rel=1e-6)  # the engine's cross-entropy runs in float32
    assert set(got) == set(expected)
    mixer = [n for n in expected if ".attn.A_log" in n or ".attn.conv1d.weight" in n]
    assert mixer and all(expected[n].abs().sum() > 0 for n in mixer)
    for name, ref in expected.items():  # float32 cross-entropy in the engine: errors ~1e-7 of the largest entry
        error = float((got[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        assert error < 1e-5, (name, error)
