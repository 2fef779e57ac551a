"""float16 overflow in attention scores: never NaN weights or tokens.

`q . k` of a float16 model can exceed float16's range (65,504) where the softmax would still be fine:
the eager path (attention weights, soft-capping) computes those products in float32
(`attention._attend_eager`); SDPA's kernels accumulate in float32 by themselves. A model whose logits
still go non-finite (an overflow elsewhere) stops generation with a one-line error, never a token.
"""

from __future__ import annotations

import pytest
import torch
from half import half_pair
from helpers import max_diff

from litkv import KVCacheConfig, Sampling, generate
from litkv.modeling.attention import attend, build_mask

B, H, G, T, S, HS = 1, 4, 2, 5, 12, 16


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys of norm ~400 (largest `q . k` ~1.3e5 > 65,504), values ~1, a causal mask."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, HS, generator=gen, dtype=torch.float64) * 100
    k = torch.randn(B, G, S, HS, generator=gen, dtype=torch.float64) * 100
    v = torch.randn(B, G, S, HS, generator=gen, dtype=torch.float64)
    mask = build_mask(torch.arange(S - T, S).expand(B, T), torch.arange(S).expand(B, G, S))
    return q, k, v, mask


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "eager-weights"])
@pytest.mark.parametrize("shared_mask", [False, True])
def test_scores_beyond_float16_range_give_finite_attention(need_weights: bool, shared_mask: bool) -> None:
    q, k, v, mask = _inputs()
    scores = q @ k.repeat_interleave(H // G, dim=1).transpose(-1, -2)
    assert scores.abs().max() > torch.finfo(torch.float16).max  # the case is real
    mask = mask[:, :1] if shared_mask else mask
    ref_y, ref_w = attend(q, k, v, mask, 0.25, need_weights=True)
    y, w = attend(q.half(), k.half(), v.half(), mask, 0.25, need_weights=need_weights)
    assert bool(torch.isfinite(y).all())
    # float16 inputs: the rounded q, k move the (peaked) softmax by a few eps of the scores' scale.
    assert max_diff(y, ref_y) <= 64 * torch.finfo(torch.float16).eps * ref_y.abs().max().item()
    if need_weights:
        assert w is not None and w.dtype == torch.float32 and bool(torch.isfinite(w).all())
        assert max_diff(w, ref_w) <= 0.05 * T * H // G


def _largest_query_key_product(model: torch.nn.Module, prompt: torch.Tensor) -> float:
    """max |q . k| over the prompt's query/key pairs (pre-RoPE, which RoPE's rotations barely change)."""
    outputs: list[torch.Tensor] = []
    hooks = [b.attn.qkv.register_forward_hook(lambda m, i, o: outputs.append(o)) for b in model.transformer.h]
    try:
        model(prompt)
    finally:
        for hook in hooks:
            hook.remove()
    n = prompt.shape[1]
    products = []
    for out in outputs:
        q, k = out[0, :, :64].view(n, 4, 16), out[0, :, 64:96].view(n, 2, 16).repeat_interleave(2, dim=1)
        products.append(torch.einsum("thd,shd->hts", q, k).abs().max())
    return float(max(products))


def test_float16_model_with_huge_query_key_products_generates_finite_tokens() -> None:
    """q/k projections scaled by 80 (|q . k| up to ~1e5 > 65,504): h2o (eager path, weights) and dense (SDPA)
    generate finite tokens, the first one the float64 twin's."""
    model, model64 = half_pair(torch.float16)
    with torch.no_grad():
        for m in (model, model64):
            for block in m.transformer.h:
                block.attn.qkv.weight[:96].mul_(80.0)  # queries (4 heads x 16), then keys (2 groups x 16)
    prompt = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert _largest_query_key_product(model64, prompt) > torch.finfo(torch.float16).max
        for policy in ("h2o", "dense"):
            cfg = KVCacheConfig(policy, cache_length=16 if policy == "h2o" else 40, chunk_size=8)
            out = generate(model, list(prompt), max_new_tokens=8, kv_cache=cfg)[0]
            ref = generate(model64, list(prompt), max_new_tokens=8, kv_cache=cfg)[0]
            assert out.shape == (8,) and bool(((out >= 0) & (out < 128)).all())
            assert out[0] == ref[0], policy  # the first token follows the same prompt


def test_non_finite_decode_logits_stop_generation_with_one_line() -> None:
    """A decode step whose logits hold NaN (an overflow past attention): a ValueError, no tokens."""
    model, _ = half_pair(torch.float16)
    calls = []

    def poison(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return output if len(calls) == 1 else output.fill_(float("nan"))  # the prefill is fine

    handle = model.lm_head.register_forward_hook(poison)
    try:
        with torch.inference_mode(), pytest.raises(ValueError, match=r"NaN/inf logits by decode step \d+.*bf16-true"):
            generate(model, [torch.arange(5)], max_new_tokens=4, kv_cache=KVCacheConfig("h2o", cache_length=8))
    finally:
        handle.remove()


def test_non_finite_logits_stop_a_chat_reply_before_its_token(tiny_ckpt) -> None:  # noqa: ANN001
    """The conversation engine (chat, and serve's turns through the same check) refuses a reply step
    whose logits hold NaN: a one-line ValueError, no token yielded from that step."""
    from litkv.checkpoints.checkpoint import load_model, load_tokenizer
    from litkv.inference.chat_template import RawFormat
    from litkv.inference.conversation import Conversation

    model, tokenizer = load_model(tiny_ckpt), load_tokenizer(tiny_ckpt)
    conv = Conversation(model, RawFormat(tokenizer), KVCacheConfig("h2o", cache_length=32))
    messages, replies = [("user", "hello there")], [None]
    hidden = conv.feed(conv.prepare(messages, replies), messages, replies)
    calls = []

    def poison(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return output if len(calls) < 3 else output.fill_(float("nan"))  # two good steps, then NaN

    handle = model.lm_head.register_forward_hook(poison)
    tokens: list[int] = []
    try:
        with pytest.raises(ValueError, match=r"NaN/inf logits by decode step 3 .*bf16-true"):
            for token in conv.reply(hidden, 6, Sampling()):
                tokens.append(token)
    finally:
        handle.remove()
    assert len(tokens) == 2
