"""The chunked gradient engine carries each hybrid family's recurrent state (Mamba-2's, Gated DeltaNet's, and
their convolution windows) across chunks: its gradients equal plain autograd over the whole sequence (dense
caches) and over the chunked pass (h2o evicting on the attention layers), float64. LoRA on the Gated
DeltaNet projections: tests/gradient/test_qwen35_gradients.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from bamba_helpers import bamba_config
from helpers import tiny_gpt
from hybrid_families import HYBRID_FAMILIES, VOCAB

from litkv import KVCacheConfig
from litkv.gradient.chunked_backward import chunked_loss_backward
from litkv.inference.generate import forward_chunked

CONFIGS = {**HYBRID_FAMILIES, "bamba": lambda: bamba_config(chunk=4)}  # Mamba-2's scan in chunks of 4
# per family: the mixers' own parameters that must get a gradient (two recurrent layers each)
MIXER_PARAMS = {
    "bamba": (".attn.A_log", ".attn.conv1d.weight", ".attn.dt_bias", ".attn.D"),
    "qwen3.5": (".attn.A_log", ".attn.conv1d.weight", ".attn.dt_bias", ".attn.gate.weight"),
}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_engine_gradients_equal_autograd(family: str, policy: str) -> None:
    model = tiny_gpt(13, torch.float64, config=CONFIGS[family]()).train()
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
    mixer = [n for n in expected if n.endswith(MIXER_PARAMS[family])]
    assert len(mixer) == 8 and all(expected[n].abs().sum() > 0 for n in mixer)
    for name, ref in expected.items():  # float32 cross-entropy in the engine: errors ~1e-7 of the largest entry
        error = float((got[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        assert error < 1e-5, (name, error)
