"""litkv.hf keeps exactly litkv's choices: an HF model with `litkv.hf.Cache` and litkv's GPT with the same
weights and `KVCacheConfig` hold the same slots (positions) in every layer, row and KV head, and give logits
within 1e-5 relative (float32), after a prompt longer than the cache and over decode steps; every built-in
policy x storage x three chunkings on Llama, the main policies on every family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_pairs import FAMILY_NAMES, hf_and_litkv

from litkv import GPT, KVCacheConfig
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_compress
from litkv.kvcache.config import ChunkPlan
from litkv.modeling.runner import run_chunks

transformers = pytest.importorskip("transformers")
hf_mod = pytest.importorskip("litkv.hf")

RTOL = 1e-5
# learned (gates bound to a checkpoint's weights) and kvzip (its reconstruction pass): tests/hf/test_gates_kvzip.py
POLICIES = ["dense", "last-recent", "h2o", "qh2o", "tova", "knorm", "keydiff", "snapkv", "expected-attention"]
ONE_SHOT = ["h2o", "snapkv", "expected-attention", "litkv.kvcache.adakv:AdaKVExpectedAttention"]
STORAGES = ["float", "int8", "int4"]
CHUNKS = [(8, None), (5, 16), (32, 3)]  # (chunk_size, prefill_length)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, GPT]]:
    tmp = tmp_path_factory.mktemp("hf")
    return {family: hf_and_litkv(family, tmp) for family in FAMILY_NAMES}


def _config(policy: str, storage: str, chunk: tuple[int, int | None], one_shot: bool = False) -> KVCacheConfig:
    cache_length = 96 if policy == "dense" else 32
    options = {"mode": "one-shot", "budget": 24} if one_shot else {}
    if one_shot:
        cache_length = 96
    if policy == "qh2o" and storage == "float":
        storage = "int8"
    return KVCacheConfig(policy=policy, cache_length=cache_length, chunk_size=chunk[0], prefill_length=chunk[1],
                         storage=storage, options=options)  # fmt: skip


def _litkv_run(
    model: GPT,
    idx: torch.Tensor,
    input_pos: torch.Tensor,
    steps: torch.Tensor,
    cfg: KVCacheConfig,
    repeat: RepeatPrompt | None = None,
):
    """litkv's GPT: the chunked prompt (`repeat`: then kvzip's reconstruction pass and compression), then one-token
    steps; logits and every layer's positions after each."""
    logits, slots = [], []
    with model.kv_caches_attached(cfg, idx.shape[0]) as caches:
        logits.append(run_chunks(model, idx, input_pos, ChunkPlan.of(cfg)))
        if repeat is not None:
            kvzip_compress(model, [ids[pos >= 0] for ids, pos in zip(idx, input_pos, strict=True)], repeat)
        slots.append([c.positions.clone() for c in caches.policy_caches])
        caches.end_prefill()
        nxt = input_pos.amax(dim=1) + 1
        for j in range(steps.shape[1]):
            logits.append(model(steps[:, j : j + 1], (nxt + j)[:, None]))
            slots.append([c.positions.clone() for c in caches.policy_caches])
    return logits, slots


def _hf_run(
    hf: torch.nn.Module,
    idx: torch.Tensor,
    mask: torch.Tensor,
    steps: torch.Tensor,
    cfg: KVCacheConfig,
    gates: Path | None = None,
    repeat: RepeatPrompt | None = None,
):
    """The same through transformers with litkv.hf.Cache (positions from the padding mask, as generate's; `gates`:
    the checkpoint directory of `learned`'s gates; `repeat`: `litkv.hf.kvzip_compress` after the prompt)."""
    cache = hf_mod.Cache(hf, cfg, gates=gates)
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = [hf(input_ids=idx, attention_mask=mask, position_ids=position_ids, past_key_values=cache).logits]
    if repeat is not None:
        hf_mod.kvzip_compress(hf, cache, idx, mask, repeat)
    slots = [[c.positions.clone() for c in cache.kv_caches]]
    nxt = mask.sum(dim=1)
    for j in range(steps.shape[1]):
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
        out = hf(input_ids=steps[:, j : j + 1], attention_mask=mask, position_ids=(nxt + j)[:, None],
                 past_key_values=cache)  # fmt: skip
        logits.append(out.logits)
        slots.append([c.positions.clone() for c in cache.kv_caches])
    return logits, slots, cache


def _check_same(
    family: str,
    pairs,
    cfg: KVCacheConfig,
    lengths: list[int],
    n_steps: int = 6,
    gates: Path | None = None,
    repeat: RepeatPrompt | None = None,
) -> None:
    """Same logits and slots through both (`gates`: `learned`'s checkpoint directory, the GPT of `pairs` holding
    those gates; `repeat`: kvzip's reconstruction prompt)."""
    hf, model = pairs[family]
    gen = torch.Generator().manual_seed(sum(lengths))
    width = max(lengths)
    idx = torch.randint(3, 300, (len(lengths), width), generator=gen)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    idx = idx * mask
    input_pos = torch.where(mask.bool(), mask.cumsum(dim=1) - 1, -1)
    steps = torch.randint(3, 300, (len(lengths), n_steps), generator=gen)
    # litkv's kvzip_score runs under inference mode: its scores are inference tensors, written in place afterwards
    with torch.inference_mode() if repeat is not None else torch.no_grad():
        ref_logits, ref_slots = _litkv_run(model, idx, input_pos, steps, cfg, repeat)
        logits, slots, _ = _hf_run(hf, idx, mask, steps, cfg, gates, repeat)
    valid = mask.bool()
    for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        a, b = (a[valid], b[valid]) if step == 0 else (a, b)
        rel = float((a - b).abs().max() / b.abs().max())
        assert rel <= RTOL, f"step {step}: logits differ by {rel:.3g} relative"
    for step, (ours, ref) in enumerate(zip(slots, ref_slots, strict=True)):
        for layer, (p, q) in enumerate(zip(ours, ref, strict=True)):
            assert torch.equal(p, q), f"step {step}, layer {layer}: other slots kept"
    kept = ref_slots[-1][0]
    if cfg.policy != "dense" and cfg.cache_length < width:
        assert (kept[0] >= 0).all() and kept[0].amax() >= width  # the longest row: a full cache that has evicted


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk{c[0]}-prefill{c[1]}")
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("policy", POLICIES)
def test_llama_every_policy_and_storage(pairs, policy: str, storage: str, chunk) -> None:
    _check_same("llama", pairs, _config(policy, storage, chunk), [70, 70])


@pytest.mark.parametrize("policy", ONE_SHOT)
def test_one_shot_compression(pairs, policy: str) -> None:
    _check_same("llama", pairs, _config(policy, "float", (8, None), one_shot=True), [70, 70])


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv", "expected-attention", "last-recent"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_families(pairs, family: str, policy: str) -> None:
    _check_same(family, pairs, _config(policy, "float", (8, None)), [70, 70])


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv", "expected-attention", "dense"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_ragged_left_padded_batch(pairs, family: str, policy: str) -> None:
    """Rows of different lengths, left-padded: litkv cuts each from its own first token, the adapter too."""
    _check_same(family, pairs, _config(policy, "float", (8, None)), [70, 41, 9])
