"""Gate gradients through the chunked engine (`chunked_distill_backward`) against plain autograd: the
whole-sequence soft eviction when the cache keeps every token, `forward_chunked` through the evicting
`learned` caches otherwise; and the comparison fails when a chunk's contribution is dropped. With LoRA
adapters training with the gates (the teacher: the model with its adapters off), the adapters'
gradients too."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from helpers import random_tokens, tiny_config, tiny_gpt

import litkv.gradient.distill as distill
from litkv.finetune.gate_training import adapters_off
from litkv.finetune.lora import LoRAArgs, LoRALinear, apply_lora, mark_only_lora_as_trainable
from litkv.gates import EvictionGates, SoftEviction, soft_eviction
from litkv.gradient import LayerTape
from litkv.gradient.distill import chunked_distill_backward
from litkv.inference.generate import forward_chunked
from litkv.kvcache.config import KVCacheConfig

CONFIG = tiny_config("pythia-14m", n_layer=2, n_head=4, n_query_groups=2, rotary_percentage=0.5)
B, T, WINDOW, SINKS, TAU, WEIGHT = 2, 30, 4, 1, 0.7, 3.0


@pytest.fixture(scope="module")
def model():
    return tiny_gpt(11, torch.float64, config=CONFIG).requires_grad_(False)


def _gates(seed: int = 12) -> EvictionGates:
    g = torch.Generator().manual_seed(seed)
    c = CONFIG
    weight = torch.randn(c.n_layer, c.n_query_groups, c.head_size, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(c.n_layer, c.n_query_groups, generator=g, dtype=torch.float64) + 1.0
    return EvictionGates(weight.requires_grad_(True), bias.requires_grad_(True), WINDOW, SINKS)


def _soft(gates: EvictionGates, straight_through: bool) -> SoftEviction:
    noise = torch.rand(CONFIG.n_layer, B, CONFIG.n_query_groups, T, generator=torch.Generator().manual_seed(13))
    return SoftEviction(gates, CONFIG.rope_n_elem, TAU, True, straight_through, noise.double())


def _token_weight() -> torch.Tensor:
    weight = torch.ones(B, T, dtype=torch.float64)
    weight[1, 20:] = 5.0
    return weight


class _Recording(SoftEviction):
    """Keeps every call's keep fractions (the reference's compression term)."""

    calls: list

    def attend_cached(self, layer, q, keys, values, k_pos, q_pos, scale, window):
        out = super().attend_cached(layer, q, keys, values, k_pos, q_pos, scale, window)
        self.calls.append((q_pos[0], self.keep[layer]))
        return out


def _reference(model, idx, soft: SoftEviction, kv_cache: KVCacheConfig | None, target: float, teacher=nullcontext):
    """Plain autograd: the teacher is the whole dense forward (inside `teacher()`); the student the whole
    soft forward (`kv_cache` None) or `forward_chunked` through the caches with soft eviction. Gradients of
    the gates, then of the model's trainable parameters."""
    with torch.no_grad(), teacher():
        teacher = F.log_softmax(model(idx), dim=-1)
    evictable = (torch.arange(T) >= SINKS) & (torch.arange(T) < T - WINDOW)
    model.eviction_gates = soft.gates
    try:
        with soft_eviction(model, soft):
            if kv_cache is None:
                student = model(idx)
                keeps = [k[:, :, evictable] for k in soft.keep.values()]
            else:
                soft.calls = []
                student = forward_chunked(model, idx, kv_cache)
                keeps = [keep[:, :, evictable[pos]] for pos, keep in soft.calls]
    finally:
        model.eviction_gates = None
    kl = (teacher.exp() * (teacher - F.log_softmax(student, dim=-1))).sum(-1)
    weight = _token_weight()
    kl = (kl * weight).sum() / weight.sum()
    keep = torch.cat([k.flatten() for k in keeps]).mean()
    loss = kl + WEIGHT * F.relu(keep - target)
    grads = torch.autograd.grad(loss, _trained(model, soft))
    return float(loss.detach()), float(keep.detach()), grads


def _trained(model, soft: SoftEviction) -> list[torch.Tensor]:
    return [*soft.gates.parameters(), *(p for p in model.parameters() if p.requires_grad)]


def _engine(model, idx, soft: SoftEviction, kv_cache: KVCacheConfig, target: float, teacher=nullcontext):
    step = chunked_distill_backward(model, soft, idx, _token_weight(), kv_cache, WEIGHT, target, teacher)
    params = _trained(model, soft)
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return step, grads


def _close(got, want) -> bool:
    """Equal to 1e-6 of each tensor's largest entry (the tape accumulates cached-key gradients in float32)."""
    return all(float((g - w).abs().max() / w.abs().max()) < 1e-6 for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("straight_through", [True, False])
@pytest.mark.parametrize("target", [0.2, 1.0])  # compression term active / inactive
@pytest.mark.parametrize("chunk", [(5, None), (4, 9)])
def test_keep_everything_equals_whole_sequence(model, straight_through, target, chunk):
    idx = random_tokens(B, T, seed=14)
    gates = _gates()
    kv = KVCacheConfig(policy="learned", cache_length=T, chunk_size=chunk[0], prefill_length=chunk[1])
    loss, keep, want = _reference(model, idx, _soft(gates, straight_through), None, target)
    step, got = _engine(model, idx, _soft(gates, straight_through), kv, target)
    assert step.loss == pytest.approx(loss, rel=1e-10) and step.keep == pytest.approx(keep, rel=1e-12)
    assert all(g.abs().sum() > 0 for g in got)
    assert _close(got, want), [float((g - w).abs().max()) for g, w in zip(got, want, strict=True)]
    assert model.eviction_gates is None


@pytest.mark.parametrize("straight_through", [True, False])
def test_evicting_cache_equals_autograd_through_forward_chunked(model, straight_through):
    idx = random_tokens(B, T, seed=15)
    gates = _gates(16)
    kv = KVCacheConfig(policy="learned", cache_length=14, chunk_size=4, options={"recent": 5})
    soft = _Recording(gates, CONFIG.rope_n_elem, TAU, True, straight_through, _soft(gates, True).noise_table)
    loss, keep, want = _reference(model, idx, soft, kv, 0.2)
    whole_loss = _reference(model, idx, _soft(gates, straight_through), None, 0.2)[0]
    assert abs(whole_loss - loss) > 1e-3  # the cache does evict
    step, got = _engine(model, idx, _soft(gates, straight_through), kv, 0.2)
    assert step.loss == pytest.approx(loss, rel=1e-10) and step.keep == pytest.approx(keep, rel=1e-12)
    assert _close(got, want)


def test_broken_engine_is_caught(model, monkeypatch):
    """Dropping one chunk's replay, or the gradients later chunks send to cached keys, changes the gradients."""
    idx = random_tokens(B, T, seed=14)
    gates = _gates()
    kv = KVCacheConfig(policy="learned", cache_length=T, chunk_size=6)
    want = _reference(model, idx, _soft(gates, True), None, 0.2)[2]
    assert _close(_engine(model, idx, _soft(gates, True), kv, 0.2)[1], want)
    real = distill.backward_chunk

    def drop_second(model, ids, pos, tapes, chunk, loss):
        def dropped(logits):
            root, value = loss(logits)
            return root * 0.0, value

        return real(model, ids, pos, tapes, chunk, dropped if chunk == 1 else loss)

    monkeypatch.setattr(distill, "backward_chunk", drop_second)
    assert not _close(_engine(model, idx, _soft(gates, True), kv, 0.2)[1], want)
    monkeypatch.setattr(distill, "backward_chunk", real)
    monkeypatch.setattr(LayerTape, "accumulate", lambda self, positions, gk, gv: None)
    assert not _close(_engine(model, idx, _soft(gates, True), kv, 0.2)[1], want)


def test_noise_needs_a_table(model):
    soft = SoftEviction(_gates(), CONFIG.rope_n_elem, TAU)
    kv = KVCacheConfig(policy="learned", cache_length=T, chunk_size=6)
    with pytest.raises(ValueError, match="noise_table"):
        chunked_distill_backward(model, soft, random_tokens(B, T, seed=1), _token_weight(), kv, WEIGHT, 0.2)


@pytest.fixture(scope="module")
def lora_model(model):
    """The float64 model with LoRA adapters on every target of the blocks, their `lora_B` random (a fresh
    adapter is zero: the student would equal the teacher but for eviction)."""
    m = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(17)
        apply_lora(m, LoRAArgs(r=2, alpha=4.0, targets=["attn.qkv", "attn.proj", "mlp"]))
        with torch.no_grad():
            for module in m.modules():
                if isinstance(module, LoRALinear):
                    module.lora_B.normal_(0.0, 0.3)
    mark_only_lora_as_trainable(m)
    return m


def test_adapters_off_is_the_base_model(model, lora_model):
    idx = random_tokens(B, T, seed=18)
    with torch.no_grad():
        assert not torch.allclose(lora_model(idx), model(idx))
        with adapters_off(lora_model):
            assert torch.equal(lora_model(idx), model(idx))
        assert not torch.allclose(lora_model(idx), model(idx))  # switched back on


@pytest.mark.parametrize("straight_through", [True, False])
@pytest.mark.parametrize("chunk", [(5, None), (4, 9)])
def test_lora_and_gates_keep_everything_equal_whole_sequence(lora_model, straight_through, chunk):
    """Gates and adapters: the engine's gradients equal autograd on the whole sequence, the teacher being
    the model with its adapters off."""
    idx = random_tokens(B, T, seed=14)
    gates = _gates()
    kv = KVCacheConfig(policy="learned", cache_length=T, chunk_size=chunk[0], prefill_length=chunk[1])
    teacher = lambda: adapters_off(lora_model)  # noqa: E731
    loss, keep, want = _reference(lora_model, idx, _soft(gates, straight_through), None, 0.2, teacher)
    step, got = _engine(lora_model, idx, _soft(gates, straight_through), kv, 0.2, teacher)
    assert len(got) == 2 + 2 * 4 * CONFIG.n_layer  # gates; A and B of qkv, proj, fc, mlp.proj per layer
    assert step.loss == pytest.approx(loss, rel=1e-10) and step.keep == pytest.approx(keep, rel=1e-12)
    assert all(g.abs().sum() > 0 for g in got)
    assert _close(got, want), [float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True)]


def test_lora_and_gates_through_an_evicting_cache(lora_model):
    idx = random_tokens(B, T, seed=15)
    gates = _gates(16)
    kv = KVCacheConfig(policy="learned", cache_length=14, chunk_size=4, options={"recent": 5})
    teacher = lambda: adapters_off(lora_model)  # noqa: E731
    soft = _Recording(gates, CONFIG.rope_n_elem, TAU, True, True, _soft(gates, True).noise_table)
    loss, keep, want = _reference(lora_model, idx, soft, kv, 0.2, teacher)
    step, got = _engine(lora_model, idx, _soft(gates, True), kv, 0.2, teacher)
    assert step.loss == pytest.approx(loss, rel=1e-10)
    assert _close(got, want)


def test_lora_teacher_with_adapters_on_is_caught(lora_model, monkeypatch):
    """The teacher left with its adapters on, or the cached keys' gradients dropped, changes the gradients."""
    idx = random_tokens(B, T, seed=14)
    gates = _gates()
    kv = KVCacheConfig(policy="learned", cache_length=T, chunk_size=6)
    teacher = lambda: adapters_off(lora_model)  # noqa: E731
    want = _reference(lora_model, idx, _soft(gates, True), None, 0.2, teacher)[2]
    assert _close(_engine(lora_model, idx, _soft(gates, True), kv, 0.2, teacher)[1], want)
    assert not _close(_engine(lora_model, idx, _soft(gates, True), kv, 0.2)[1], want)
    monkeypatch.setattr(LayerTape, "accumulate", lambda self, positions, gk, gv: None)
    got = _engine(lora_model, idx, _soft(gates, True), kv, 0.2, teacher)[1]
    assert not _close(got[2:], want[2:])  # the adapters' gradients too
