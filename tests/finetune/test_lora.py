"""LoRA on `litkv.GPT`: identity at init, merging, trainable parameters, and adapter gradients from
`chunked_loss_backward` against plain autograd through `forward_chunked` + cross-entropy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import litkv
from litkv.finetune.lora import (
    LoRAArgs,
    LoRALinear,
    apply_lora,
    load_lora_state_dict,
    lora_state_dict,
    mark_only_lora_as_trainable,
    merge_lora,
    merged_state_dict,
)
from litkv.gradient import chunked_loss_backward
from litkv.kvcache.config import KVCacheConfig

B, T, VOCAB = 2, 40, 64
TOLERANCE = 1e-4
ALL_TARGETS = ["attn.qkv", "attn.proj", "mlp", "lm_head"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config() -> litkv.Config:
    return litkv.Config(
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=32,
        intermediate_size=48,
        block_size=256,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        rotary_percentage=1.0,
        bias=False,
        parallel_residual=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )


def _base(seed: int = 0) -> litkv.GPT:
    torch.manual_seed(seed)
    model = litkv.GPT(_config())
    with torch.no_grad():  # peaked attention, so that evictions change the result
        for block in model.transformer.h:
            block.attn.qkv.weight.mul_(4.0)
    return model


def _lora_model(targets: list[str], seed: int = 0) -> litkv.GPT:
    """Base model with adapters whose `lora_B` is random (a trained adapter, not the zero init)."""
    model = _base(seed)
    apply_lora(model, LoRAArgs(r=4, alpha=8.0, targets=targets))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=gen) * 0.1)
    return model


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (B, T), generator=gen)
    targets = torch.randint(0, VOCAB, (B, T), generator=gen)
    targets[0, :6] = -100
    return idx, targets


def _lora_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def test_apply_lora_targets_and_fresh_adapter_is_identity(batch):
    base = _base()
    model = copy.deepcopy(base)
    names = apply_lora(model, LoRAArgs(targets=ALL_TARGETS))
    expected = {"lm_head"} | {
        f"transformer.h.{i}.{m}"
        for i in range(2)
        for m in ("attn.qkv", "attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj")
    }
    assert set(names) == expected
    assert set(base.state_dict()) <= set(model.state_dict())  # base keys unchanged
    assert torch.equal(model(batch[0]), base(batch[0]))  # lora_B starts at zero


def test_merged_equals_unmerged(batch):
    idx = batch[0]
    model = _lora_model(ALL_TARGETS)
    kv = KVCacheConfig(policy="h2o", cache_length=16, chunk_size=4)
    out, out_chunked = model(idx), litkv.forward_chunked(model, idx, kv)
    assert (out - _base()(idx)).abs().max() > 1e-2  # the adapters do change the output
    plain = litkv.GPT(_config())
    state = merged_state_dict(model)
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state, strict=True)
    assert (plain(idx) - out).abs().max() <= 1e-5 * out.abs().max()
    assert (litkv.forward_chunked(plain, idx, kv) - out_chunked).abs().max() <= 1e-5 * out.abs().max()
    merged = merge_lora(copy.deepcopy(model))
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(plain.state_dict())
    assert (merged(idx) - out).abs().max() <= 1e-5 * out.abs().max()


def test_lora_state_dict_round_trip(batch):
    model = _lora_model(["attn.qkv", "mlp"])
    fresh = _base()
    apply_lora(fresh, LoRAArgs(r=4, alpha=8.0, targets=["attn.qkv", "mlp"]))
    adapters = lora_state_dict(model)
    assert all(k.endswith(("lora_A", "lora_B")) for k in adapters) and len(adapters) == 2 * 2 * 4
    load_lora_state_dict(fresh, adapters)
    assert torch.equal(fresh(batch[0]), model(batch[0]))
    with pytest.raises(ValueError, match="missing 4 keys"):
        load_lora_state_dict(fresh, {k: v for k, v in adapters.items() if ".attn." not in k})


@pytest.mark.parametrize("targets", [["attn.qkv", "attn.proj"], ALL_TARGETS], ids=["attn", "all"])
def test_only_adapters_receive_gradients(batch, targets):
    model = _lora_model(targets)
    mark_only_lora_as_trainable(model)
    chunked_loss_backward(model, *batch, KVCacheConfig(policy="h2o", cache_length=16, chunk_size=4))
    for name, param in model.named_parameters():
        if "lora_" in name:
            assert param.requires_grad and param.grad is not None and param.grad.abs().max() > 0, name
        else:
            assert not param.requires_grad and param.grad is None, name


KV_CASES = [
    dict(policy="dense", cache_length=40, chunk_size=8),
    dict(policy="last-recent", cache_length=12, chunk_size=4, options=dict(sinks=2)),
    dict(policy="h2o", cache_length=16, chunk_size=4),
    dict(policy="h2o", cache_length=16, chunk_size=7, prefill_length=10),
]


@pytest.mark.parametrize("options", KV_CASES, ids=lambda o: f"{o['policy']}-c{o['chunk_size']}")
def test_adapter_gradients_match_plain_autograd(batch, options):
    idx, targets = batch
    kv = KVCacheConfig(**options)
    engine, naive = _lora_model(ALL_TARGETS), _lora_model(ALL_TARGETS)
    mark_only_lora_as_trainable(engine)
    mark_only_lora_as_trainable(naive)
    loss = chunked_loss_backward(engine, idx, targets, kv)
    logits = litkv.forward_chunked(naive, idx, kv)
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    got, expected = _lora_grads(engine), _lora_grads(naive)
    assert set(got) == set(expected) and len(got) == 2 * 11
    for name in expected:
        assert _rel_err(got[name], expected[name]) <= TOLERANCE, name


def test_adapters_on_attention_output_only(batch):
    """Layer 0's cached keys/values need no gradient here (nothing below them is trainable)."""
    idx, targets = batch
    kv = KVCacheConfig(policy="h2o", cache_length=16, chunk_size=4)
    engine, naive = _lora_model(["attn.proj"]), _lora_model(["attn.proj"])
    mark_only_lora_as_trainable(engine)
    mark_only_lora_as_trainable(naive)
    chunked_loss_backward(engine, idx, targets, kv)
    logits = litkv.forward_chunked(naive, idx, kv)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    got, expected = _lora_grads(engine), _lora_grads(naive)
    assert set(got) == set(expected) and len(got) == 4
    for name in expected:
        assert _rel_err(got[name], expected[name]) <= TOLERANCE, name


def test_lora_errors():
    with pytest.raises(ValueError, match="r must be"):
        LoRAArgs(r=0)
    with pytest.raises(ValueError, match="unknown lora targets"):
        LoRAArgs(targets=["attn.q"])
    with pytest.raises(TypeError, match="non-empty list"):
        LoRAArgs(targets="attn.qkv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no LoRA adapters"):
        mark_only_lora_as_trainable(_base())
    with pytest.raises(TypeError, match="nn.Linear"):
        LoRALinear(nn.Embedding(3, 4), r=2, alpha=2.0)  # type: ignore[arg-type]
