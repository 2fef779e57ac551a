"""Prefill chunks on SDPA's fast kernels without a `(B, G, T, S)` mask (`attention.attend_causal_suffix`).

A chunk without pads over a cache whose slots are all filled attends with a lower-right causal bias: on the CPU
SDPA's flash kernel with a `(T, S)` mask, on CUDA expanded keys and `causal_lower_right` (exercised here on the
CPU with `expand=True`). Checked against a float64 brute-force oracle, the chunked model against the float64
reference forward, and the dense prefill's profile against SDPA's math kernel.
"""

from __future__ import annotations

import pytest
import torch
from helpers import max_diff, random_tokens, reference_forward, tiny_gpt
from torch.profiler import ProfilerActivity, profile

import litkv.modeling.attention as attention
import litkv.modeling.model as model_module
import litkv.modeling.self_attention as self_attention
from litkv import KVCacheConfig, forward_chunked
from litkv.modeling.attention import attend_causal_suffix


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 softmax attention, query `i` seeing keys `0 .. S - T + i`, by explicit loops over the heads."""
    b, h, t, _ = q.shape
    g, s = k.shape[1], k.shape[2]
    out = torch.zeros(b, t, h, v.shape[-1], dtype=torch.float64)
    for head in range(h):
        kh, vh = k[:, head // (h // g)].double(), v[:, head // (h // g)].double()
        scores = q[:, head].double() @ kh.transpose(-1, -2) * scale  # (B, T, S)
        allowed = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
        out[:, :, head] = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ vh
    return out.reshape(b, t, h * v.shape[-1])


@pytest.mark.parametrize("expand", [False, True], ids=["cpu-way", "cuda-way"])
@pytest.mark.parametrize(("t", "s"), [(1, 1), (5, 5), (7, 40), (16, 300)])
def test_causal_suffix_matches_float64(expand: bool, t: int, s: int) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + s)
    b, h, g, hs = 2, 9, 3, 16
    q, k, v = (torch.randn(b, n, m, hs, generator=gen) for n, m in ((h, t), (g, s), (g, s)))
    got = attend_causal_suffix(q, k, v, hs**-0.5, expand=expand)
    ref = _oracle(q, k, v, hs**-0.5)
    assert got.shape == (b, t, h * hs)
    assert max_diff(got, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
def test_causal_suffix_kept_mask_gives_the_boolean_masks_bits(dtype: torch.dtype) -> None:
    """The CPU way's additive mask, kept from one layer to the next, gives SDPA's bits with the boolean mask; kept
    from an inference-mode call, it still serves a call with gradients."""
    gen = torch.Generator().manual_seed(5)
    t, s, hs = 24, 90, 16
    q, k, v = (torch.randn(2, n, m, hs, generator=gen).to(dtype) for n, m in ((9, t), (3, s), (3, s)))
    allowed = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    expected = expected.transpose(1, 2).reshape(2, t, 9 * hs)
    with torch.inference_mode():
        assert torch.equal(attend_causal_suffix(q, k, v, 1 / hs**0.5), expected)
    leaf = q.detach().requires_grad_()
    attend_causal_suffix(leaf, k, v, 1 / hs**0.5).sum().backward()
    assert leaf.grad is not None and bool(leaf.grad.isfinite().all())


def test_causal_suffix_refuses_more_queries_than_keys() -> None:
    q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 3, 8)
    with pytest.raises(ValueError, match="4 queries over 3 keys"):
        attend_causal_suffix(q, k, k, 1.0)


def _model() -> model_module.GPT:
    return tiny_gpt(11, overrides={"block_size": 512})


@pytest.mark.parametrize("policy", ["dense", "last-recent", "h2o"])
def test_chunked_prefill_takes_the_suffix_path_and_matches_float64(policy: str, monkeypatch) -> None:  # noqa: ANN001
    """Default-sized chunks over a 600-token prompt: every chunk after the first takes the mask-free path (no
    `build_mask`), and the logits are the float64 reference's (dense: plain causal). h2o reads weights: its output
    comes from SDPA as on an accelerator (forced here; on the CPU the weights pass gives it, still without a mask)."""
    monkeypatch.setattr(attention, "weights_in_one_pass", lambda device: False)
    calls = {"suffix": 0, "mask": 0}
    suffix, mask = attention.attend_causal_suffix, self_attention.build_mask

    def spy_suffix(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["suffix"] += 1
        return suffix(*args, **kwargs)

    def spy_mask(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["mask"] += 1
        return mask(*args, **kwargs)

    monkeypatch.setattr(attention, "attend_causal_suffix", spy_suffix)
    monkeypatch.setattr(self_attention, "build_mask", spy_mask)
    model = _model()
    model.config.block_size = 1024
    idx = random_tokens(2, 600, seed=2)
    length = 700 if policy == "dense" else 256
    cfg = KVCacheConfig(policy, cache_length=length, chunk_size=128)
    with torch.inference_mode():
        got = forward_chunked(model, idx, cfg)
    chunks = -(-600 // 128)
    assert calls == {"suffix": (chunks - 1) * model.config.n_layer, "mask": 0}, calls
    if policy == "dense":
        ref = reference_forward(model, idx).logits
        assert max_diff(got, ref) < 1e-4 * ref.abs().max().item()


def test_ragged_prefill_still_masks() -> None:
    """A left-padded batch cannot take the mask-free path (pad keys): the masked one gives the row alone."""
    model = _model()
    long, short = random_tokens(1, 300, seed=3)[0], random_tokens(1, 200, seed=4)[0]
    cfg = KVCacheConfig("dense", cache_length=300, chunk_size=64)
    idx = torch.zeros(2, 300, dtype=torch.long)
    idx[0], idx[1, 100:] = long, short
    pos = torch.arange(300).expand(2, 300).clone()
    pos[1, :100], pos[1, 100:] = -1, torch.arange(200)
    with torch.inference_mode():
        both = forward_chunked(model, idx, cfg, pos)
        alone = forward_chunked(model, short[None], cfg)
    assert max_diff(both[1, 100:], alone[0]) < 1e-4 * alone.abs().max().item()


def test_dense_prefill_profile_shows_flash_not_math() -> None:
    """A dense prefill of several chunks: every attention call runs SDPA's CPU flash kernel, none the math one."""
    model = _model()
    idx = random_tokens(1, 512, seed=5)
    cfg = KVCacheConfig("dense", cache_length=512, chunk_size=128)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_chunked(model, idx, cfg)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::_scaled_dot_product_flash_attention_for_cpu", 0) == 4 * model.config.n_layer, counts
    assert not any("math" in name for name in counts), [name for name in counts if "math" in name]


def _weights_oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 outputs `(B, T, H * hv)` and weight sums `(B, G, S)`, one head at a time: query `i` sees keys
    `0 .. S - T + i` (`causal`) or every key."""
    b, h, t, _ = q.shape
    g, s = k.shape[1], k.shape[2]
    out = torch.zeros(b, t, h, v.shape[-1], dtype=torch.float64)
    sums = torch.zeros(b, g, s, dtype=torch.float64)
    allowed = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t) if causal else torch.ones(t, s) > 0
    for head in range(h):
        kh, vh = k[:, head // (h // g)].double(), v[:, head // (h // g)].double()
        scores = q[:, head].double() @ kh.transpose(-1, -2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[:, :, head] = probs @ vh
        sums[:, head // (h // g)] += probs.sum(dim=1)
    return out.reshape(b, t, h * v.shape[-1]), sums


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "sdpa+scores"])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize(("t", "s", "layout"), [(1, 1, "causal"), (6, 6, "causal"), (7, 40, "causal"),
                                                (1, 33, "none"), (5, 20, "none")])  # fmt: skip
def test_weights_path_without_a_mask_matches_float64(t: int, s: int, layout: str, softcap: float | None,
                                                     one_pass: bool, monkeypatch) -> None:  # noqa: ANN001  # fmt: skip
    """The path for calls that need weights, with the layouts that build no mask (`CAUSAL`: a prefill chunk,
    `None`: a decode step over valid slots), in blocks of a few queries, output from the weights pass (the CPU's
    way) or from SDPA (the accelerators'): outputs and weight sums as float64's."""
    monkeypatch.setattr(attention, "WEIGHTS_BLOCK_ELEMENTS", 2 * 9 * s)  # blocks of 2 queries
    monkeypatch.setattr(attention, "weights_in_one_pass", lambda device: one_pass)
    gen = torch.Generator().manual_seed(t * 100 + s)
    b, h, g, hs = 2, 9, 3, 16
    q, k, v = (torch.randn(b, n, m, hs, generator=gen) * 2 for n, m in ((h, t), (g, s), (g, s)))
    mask = attention.CAUSAL if layout == "causal" else None
    y, sums = attention.attend(q, k, v, mask, hs**-0.5, softcap, need_weights=True)
    y_ref, sums_ref = _weights_oracle(q, k, v, hs**-0.5, layout == "causal", softcap)
    assert max_diff(y, y_ref) < 1e-5
    torch.testing.assert_close(sums.double(), sums_ref, rtol=1e-5, atol=1e-6)
    assert abs(float(sums.sum()) - b * h * t) < 1e-3  # every query spreads one per head


def _flash_and_math(model: model_module.GPT, idx: torch.Tensor, cfg: KVCacheConfig) -> tuple[int, list[str]]:
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_chunked(model, idx, cfg)
    counts = {e.key: e.count for e in prof.key_averages()}
    return counts.get("aten::_scaled_dot_product_flash_attention_for_cpu", 0), [n for n in counts if "math" in n]


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_weight_policies_prefill_on_flash(policy: str, monkeypatch) -> None:  # noqa: ANN001
    """h2o / tova read attention weights: with the accelerators' two passes (forced here on the CPU), their
    prefill's outputs come from SDPA's flash kernel, every chunk (the first, those filling the cache, those
    evicting), none from the math kernel."""
    monkeypatch.setattr(attention, "weights_in_one_pass", lambda device: False)
    model = _model()
    idx = random_tokens(1, 512, seed=6)
    flash, math_kernels = _flash_and_math(model, idx, KVCacheConfig(policy, cache_length=192, chunk_size=64))
    assert flash == (512 // 64) * model.config.n_layer
    assert not math_kernels, math_kernels


@pytest.mark.parametrize("policy", ["h2o", "tova", "last-recent"])
def test_decode_over_full_slots_builds_no_mask(policy: str, monkeypatch) -> None:  # noqa: ANN001
    """A decode step of an evicting cache whose slots all hold a token attends without a mask (no `build_mask`)
    and gives the masked path's tokens; a ragged batch (pads in the slots) keeps its mask."""
    from litkv import generate

    model = _model()
    prompt = random_tokens(1, 96, seed=7)
    cfg = KVCacheConfig(policy, cache_length=48, chunk_size=32)
    built, spy = _mask_spy()
    monkeypatch.setattr(self_attention, "build_mask", spy)
    with torch.inference_mode():
        fast = generate(model, [prompt[0]], max_new_tokens=6, kv_cache=cfg)
    assert 1 not in built, built  # no decode step built a mask
    monkeypatch.setattr(self_attention.CausalSelfAttention, "_layout", _masked_layout)
    with torch.inference_mode():
        masked = generate(model, [prompt[0]], max_new_tokens=6, kv_cache=cfg)
    assert fast[0].tolist() == masked[0].tolist()
    built.clear()
    monkeypatch.undo()
    monkeypatch.setattr(self_attention, "build_mask", spy)
    short = random_tokens(1, 20, seed=8)[0]
    with torch.inference_mode():
        generate(model, [prompt[0], short], max_new_tokens=3, kv_cache=KVCacheConfig(policy, cache_length=48))
    assert 1 in built  # the short row's slots are not all filled: masked


def _mask_spy() -> tuple[list[int], object]:
    """`build_mask` that records each call's query count, and the list it records into."""
    built: list[int] = []
    real = self_attention.build_mask

    def spy(q_pos, k_pos, window=None):  # noqa: ANN001, ANN202
        built.append(q_pos.shape[-1])
        return real(q_pos, k_pos, window)

    return built, spy


def _masked_layout(self, cache, keys, k_pos, input_pos, no_pads):  # noqa: ANN001, ANN202
    """The layout with a mask built from positions for every call (the reference of the mask-free paths)."""
    return self_attention.build_mask(input_pos, k_pos, self.window)


def test_dense_decode_with_room_builds_no_mask(monkeypatch) -> None:  # noqa: ANN001
    """A dense cache with room: after a prefill without pads every decode step attends its filled slots without a
    mask (their prefix is known on the host) and gives the masked path's tokens; a ragged batch, whose slots hold
    pads, and a cache whose slots were handed out (`state_tensors`) keep the mask."""
    from litkv import generate

    model = _model()
    prompt = random_tokens(1, 70, seed=9)[0]
    cfg = KVCacheConfig("dense", cache_length=96, chunk_size=32)
    built, spy = _mask_spy()
    monkeypatch.setattr(self_attention, "build_mask", spy)
    with torch.inference_mode():
        fast = generate(model, [prompt, prompt.flip(0)], max_new_tokens=8, kv_cache=cfg)
    assert built == [], built
    monkeypatch.setattr(self_attention.CausalSelfAttention, "_layout", _masked_layout)
    with torch.inference_mode():
        masked = generate(model, [prompt, prompt.flip(0)], max_new_tokens=8, kv_cache=cfg)
    assert [f.tolist() for f in fast] == [m.tolist() for m in masked]
    monkeypatch.undo()
    monkeypatch.setattr(self_attention, "build_mask", spy)
    with torch.inference_mode():
        generate(model, [prompt, prompt[:30]], max_new_tokens=3, kv_cache=cfg)
    assert 1 in built  # the short row's pads sit among the slots: masked
    built.clear()
    with torch.inference_mode(), model.kv_caches_attached(cfg, 1) as caches, model.trusted_inputs(40, no_pads=True):
        model(prompt[None, :32], torch.arange(32)[None])
        model(prompt[None, 32:33], torch.tensor([[32]]))
        assert built == []
        for cache in caches.policy_caches:
            cache.state_tensors()  # the caller may write the slots
        model(prompt[None, 33:34], torch.tensor([[33]]))
        assert built == [1] * model.config.n_layer
