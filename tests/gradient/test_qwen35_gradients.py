"""The chunked gradient engine carries the Gated DeltaNet state (and its convolution window) across chunks:
its gradients equal plain autograd over the whole sequence (dense caches) and over the chunked pass (h2o
evicting on the gated attention layers), float64; LoRA on the Gated DeltaNet projections, the adapters'
engine gradients equal plain autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_gpt
from qwen35_helpers import VOCAB, qwen35_config

from litkv import KVCacheConfig
from litkv.finetune.lora import LoRAArgs, LoRALinear, apply_lora, mark_only_lora_as_trainable
from litkv.gradient.chunked_backward import chunked_loss_backward
from litkv.inference.generate import forward_chunked


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_engine_gradients_equal_autograd(policy: str) -> None:
    model = tiny_gpt(13, torch.float64, config=qwen35_config()).train()
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
    mixer = [
        n for n in expected if n.endswith((".attn.A_log", ".attn.conv1d.weight", ".attn.dt_bias", ".attn.gate.weight"))
    ]
    assert len(mixer) == 8 and all(expected[n].abs().sum() > 0 for n in mixer)
    for name, ref in expected.items():  # float32 cross-entropy in the engine: errors ~1e-7 of the largest entry
        error = float((got[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        assert error < 1e-5, (name, error)


GDN_TARGETS = ["attn.qkv", "attn.proj", "gdn.in_proj", "gdn.out_proj"]


def _lora_qwen35(seed: int, targets: list[str]) -> torch.nn.Module:
    model = tiny_gpt(seed, torch.float64, config=qwen35_config(n_layer=2))
    torch.manual_seed(seed)  # the adapters' A: drawn from the global generator
    apply_lora(model, LoRAArgs(r=2, alpha=4.0, targets=targets))
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # non-zero B, so that every adapter's A gets a gradient too
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.normal_(0.0, 0.1)
    mark_only_lora_as_trainable(model)
    return model


def test_lora_targets_the_gated_deltanet_projections() -> None:
    names = sorted(n for n, m in _lora_qwen35(0, GDN_TARGETS).named_modules() if isinstance(m, LoRALinear))
    gdn = [f"transformer.h.0.attn.{p}" for p in ("in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z", "out_proj")]
    assert names == [*gdn, "transformer.h.1.attn.proj", "transformer.h.1.attn.qkv"]
    # Mamba-2's targets match no Gated DeltaNet projection
    with pytest.raises(ValueError, match="no linear layer of the model matches"):
        _lora_qwen35(0, ["mamba.in_proj", "mamba.out_proj"])


def test_lora_adapter_gradients_match_plain_autograd() -> None:
    engine, naive = _lora_qwen35(2, GDN_TARGETS), _lora_qwen35(2, GDN_TARGETS)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, VOCAB, (2, 29), generator=gen)
    targets = torch.randint(0, VOCAB, (2, 29), generator=gen)
    targets[0, :5] = -100
    loss = chunked_loss_backward(engine, idx, targets, KVCacheConfig("dense", cache_length=40, chunk_size=6))
    ref = F.cross_entropy(naive(idx).flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-6)
    got = {n: p.grad for n, p in engine.named_parameters() if p.requires_grad}
    expected = {n: p.grad for n, p in naive.named_parameters() if p.requires_grad}
    assert set(got) == set(expected) and len(got) == 2 * 7
    for name, grad in expected.items():
        assert float(grad.abs().max()) > 0, name
        error = float((got[name] - grad).abs().max() / grad.abs().max())
        assert error < 1e-5, (name, error)
