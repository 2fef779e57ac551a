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

import litkv.modeling.model as model_module
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


def test_causal_suffix_refuses_more_queries_than_keys() -> None:
    q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 3, 8)
    with pytest.raises(ValueError, match="4 queries over 3 keys"):
        attend_causal_suffix(q, k, k, 1.0)


def _model() -> model_module.GPT:
    return tiny_gpt(11, overrides={"block_size": 512})


@pytest.mark.parametrize("policy", ["dense", "last-recent"])
def test_chunked_prefill_takes_the_suffix_path_and_matches_float64(policy: str, monkeypatch) -> None:  # noqa: ANN001
    """Default-sized chunks over a 600-token prompt: every chunk after the first takes the mask-free path (no
    `build_mask`), and the logits are the float64 reference's (dense: plain causal)."""
    calls = {"suffix": 0, "mask": 0}
    suffix, mask = model_module.attend_causal_suffix, model_module.build_mask

    def spy_suffix(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["suffix"] += 1
        return suffix(*args, **kwargs)

    def spy_mask(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["mask"] += 1
        return mask(*args, **kwargs)

    monkeypatch.setattr(model_module, "attend_causal_suffix", spy_suffix)
    monkeypatch.setattr(model_module, "build_mask", spy_mask)
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
