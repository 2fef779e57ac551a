"""`model.generate(..., past_key_values=litkv.hf.Cache(...))`: the greedy tokens of litkv's `generate` on the same
weights (ragged left-padded batches, chunked prefill through transformers' `prefill_chunk_size` too), sampled
generation, rows equal to the same prompts alone, and beam search refused in one line."""

from __future__ import annotations

import pytest
import torch
from hf_pairs import hf_and_litkv

from litkv import GPT, KVCacheConfig, generate

transformers = pytest.importorskip("transformers")
hf_mod = pytest.importorskip("litkv.hf")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, GPT]:
    return hf_and_litkv("llama", tmp_path_factory.mktemp("hf"))


def _prompts(lengths: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen) for n in lengths]


def _left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.numel() :] = p
        mask[row, width - p.numel() :] = 1
    return ids, mask


def _hf_generate(hf, prompts, cfg, new: int, **kwargs) -> tuple[torch.Tensor, object]:
    ids, mask = _left_pad(prompts)
    cache = hf_mod.Cache(hf, cfg)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, pad_token_id=0,
                          **kwargs)  # fmt: skip
    return out[:, ids.shape[1] :], cache


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv", "last-recent", "expected-attention"])
def test_greedy_tokens_equal_litkv_generate(pair, policy: str) -> None:
    hf, model = pair
    prompts = _prompts([70, 45, 12], seed=3)
    cfg = KVCacheConfig(policy=policy, cache_length=32, chunk_size=8)
    with torch.no_grad():
        expected = generate(model, prompts, max_new_tokens=24, kv_cache=cfg)
    ours, cache = _hf_generate(hf, prompts, cfg, 24, do_sample=False)
    for row, want in enumerate(expected):
        assert ours[row].tolist() == want.tolist(), f"row {row}"
    assert cache.get_seq_length() == 70 + 24 - 1  # columns seen (the last token is never fed)
    assert all(c.positions.shape[-1] == 32 for c in cache.kv_caches)


def test_transformers_prefill_chunking_equals_litkv(pair) -> None:
    """transformers' `prefill_chunk_size` cuts the prompt into calls; the adapter cuts each call by the config."""
    hf, model = pair
    prompts = _prompts([64, 64], seed=4)
    cfg = KVCacheConfig(policy="h2o", cache_length=32, chunk_size=8)
    with torch.no_grad():
        expected = generate(model, prompts, max_new_tokens=12, kv_cache=cfg)
    ours, _ = _hf_generate(hf, prompts, cfg, 12, do_sample=False, prefill_chunk_size=16)
    assert ours.tolist() == [t.tolist() for t in expected]


def test_rows_equal_the_prompts_alone(pair) -> None:
    hf, _ = pair
    prompts = _prompts([66, 30, 9], seed=5)
    cfg = KVCacheConfig(policy="h2o", cache_length=24, chunk_size=6)
    batch, _ = _hf_generate(hf, prompts, cfg, 16, do_sample=False)
    for row, prompt in enumerate(prompts):
        alone, _ = _hf_generate(hf, [prompt], cfg, 16, do_sample=False)
        assert batch[row].tolist() == alone[0].tolist(), f"row {row}"


def test_sampled_generation_draws_as_transformers_own_cache(pair) -> None:
    """A cache that never fills is dense attention: sampled tokens equal transformers' dynamic cache's draws."""
    hf, _ = pair
    prompts = _prompts([40, 40], seed=6)
    ids, mask = _left_pad(prompts)
    cfg = KVCacheConfig(policy="h2o", cache_length=128, chunk_size=16)
    torch.manual_seed(11)
    ours, _ = _hf_generate(hf, prompts, cfg, 20, do_sample=True, temperature=1.0, top_k=50)
    hf.set_attn_implementation("sdpa")
    torch.manual_seed(11)
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=True, temperature=1.0, top_k=50,
                          pad_token_id=0)[:, ids.shape[1] :]  # fmt: skip
    assert ours.tolist() == ref.tolist()
    assert len(set(ours[0].tolist())) > 5  # real draws, not a repeated token


def test_sampled_generation_with_eviction_runs(pair) -> None:
    hf, _ = pair
    torch.manual_seed(0)
    ours, cache = _hf_generate(hf, _prompts([90], seed=7), KVCacheConfig(policy="tova", cache_length=16), 30,
                               do_sample=True, temperature=0.8)  # fmt: skip
    assert ours.shape == (1, 30) and bool(((ours >= 0) & (ours < 320)).all())
    assert cache.get_seq_length() == 90 + 29


def test_beam_search_is_refused_in_one_line(pair) -> None:
    hf, _ = pair
    with pytest.raises(ValueError, match="beam search") as err:
        _hf_generate(hf, _prompts([20], seed=8), KVCacheConfig(policy="h2o", cache_length=16), 4, num_beams=2)
    assert "\n" not in str(err.value)
