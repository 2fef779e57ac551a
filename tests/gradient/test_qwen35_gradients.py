"""LoRA on Qwen3.5's Gated DeltaNet projections: the targets it takes, and the adapters' gradients through the
chunked engine equal plain autograd (float64). The engine over both hybrid families, without adapters:
tests/gradient/test_hybrid_gradients.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_gpt
from qwen35_helpers import VOCAB, qwen35_config

from litkv import KVCacheConfig
from litkv.finetune.lora import LoRAArgs, LoRALinear, apply_lora, mark_only_lora_as_trainable
from litkv.gradient.chunked_backward import chunked_loss_backward

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
