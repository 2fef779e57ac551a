"""litkv's hybrid model (Mamba-2 + attention) against transformers' `BambaForCausalLM` on the same random
weights, float64: prefill logits, chunked prefill, ragged batches, greedy generation."""

from __future__ import annotations

import pytest
import torch
from bamba_helpers import VOCAB, hf_in_float64, litkv_from_hf, random_hf_bamba, tiny_bamba_config

from litkv import GPT, KVCacheConfig
from litkv.inference.generate import forward_chunked, generate
from litkv.kvcache.recurrent import RecurrentCache


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, GPT]:
    hf = random_hf_bamba(tiny_bamba_config())
    return hf, litkv_from_hf(hf)


def _hf_logits(hf: torch.nn.Module, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad(), hf_in_float64():
        return hf(idx, attention_mask=mask).logits


def test_layer_kinds(pair: tuple[torch.nn.Module, GPT]) -> None:
    _, model = pair
    assert model.config.layer_kinds == ("mamba2", "attention", "mamba2", "attention")
    caches = model.build_kv_caches(KVCacheConfig(cache_length=8), batch_size=2)
    assert [isinstance(c, RecurrentCache) for c in caches] == [True, False, True, False]


def test_prefill_logits(pair: tuple[torch.nn.Module, GPT]) -> None:
    hf, model = pair
    idx = torch.randint(0, VOCAB, (2, 21))  # 21: blocks of 8 with a ragged last one
    expected = _hf_logits(hf, idx)
    with torch.no_grad():
        got = model(idx)
    torch.testing.assert_close(got, expected, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("chunk", [1, 3, 8, 13])
def test_chunked_prefill(pair: tuple[torch.nn.Module, GPT], chunk: int) -> None:
    """Calls of `chunk` tokens (1: the recurrent step) carry the state: the logits of the whole sequence."""
    hf, model = pair
    idx = torch.randint(0, VOCAB, (2, 26))
    expected = _hf_logits(hf, idx)
    with torch.no_grad():
        got = forward_chunked(model, idx, KVCacheConfig(policy="dense", cache_length=32, chunk_size=chunk))
    torch.testing.assert_close(got, expected, atol=1e-11, rtol=1e-11)


def test_ragged_batch_rows_equal_rows_alone(pair: tuple[torch.nn.Module, GPT]) -> None:
    """Left padding (and chunks that are all pads for a short row) never touches a row's state."""
    hf, model = pair
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (19, 4, 11)]
    cfg = KVCacheConfig(policy="dense", cache_length=48, chunk_size=5)
    batch = generate(model, prompts, 8, cfg)
    for prompt, tokens in zip(prompts, batch, strict=True):
        alone = generate(model, [prompt], 8, cfg)[0]
        assert torch.equal(tokens, alone)
        with torch.no_grad():
            full = torch.cat((prompt, tokens))[None]
            logits = model(full)[0, len(prompt) - 1 : -1]
        assert torch.equal(logits.argmax(-1), tokens)
        # and the left-padded batch's prefill logits, row by row, against transformers' row alone
    lengths = [len(p) for p in prompts]
    t = max(lengths)
    idx = torch.zeros(len(prompts), t, dtype=torch.long)
    pos = torch.full((len(prompts), t), -1)
    for i, p in enumerate(prompts):
        idx[i, t - len(p) :] = p
        pos[i, t - len(p) :] = torch.arange(len(p))
    with torch.no_grad():
        got = forward_chunked(model, idx, cfg, input_pos=pos)
    for i, p in enumerate(prompts):
        expected = _hf_logits(hf, p[None])[0]
        torch.testing.assert_close(got[i, t - len(p) :], expected, atol=1e-11, rtol=1e-11)


def test_greedy_generation_matches_transformers(pair: tuple[torch.nn.Module, GPT]) -> None:
    hf, model = pair
    prompt = torch.randint(1, VOCAB, (9,))
    with torch.no_grad(), hf_in_float64():
        out = hf.generate(prompt[None], max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = out[0, len(prompt) :]
    got = generate(model, [prompt], 12, KVCacheConfig(policy="dense", cache_length=32, chunk_size=4))[0]
    assert torch.equal(got, expected)
