"""One-shot `learned` with `across_layers=True` (litkv/kvcache/learned.py, `compress_all` / `compress_layers` in
litkv/kvcache/score.py): the prompt's kept tokens are, per row, the `budget x G x n_layers` highest gate logits
over every layer and KV head (sinks and recent window kept), checked against a float64 numpy oracle on a
left-padded (ragged) batch, for gates of the pre-RoPE key and of the layer's hidden state (`input="hidden"`); the
default keeps `budget` per head; the option outside one-shot mode is refused."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import attach_random_gates

from litkv import GPT, KVCacheConfig
from litkv.inference.generate import pad_prompts
from litkv.kvcache.learned import LearnedKVCache

LENGTHS = (29, 21, 34)  # the rows' prompt lengths (left-padded into one batch)
BUDGET, SINKS, RECENT, CHUNK = 6, 1, 2, 8


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(41, torch.float64, gates=True, gate_seed=42, window=RECENT, sinks=SINKS)


@pytest.fixture(scope="module", params=["key", "hidden"])
def either_model(request: pytest.FixtureRequest, tiny_model: Callable[..., GPT]) -> GPT:
    """The model with gates of either input (the hidden-state gates drawn anew, `(n_layer, G, n_embd)`)."""
    model = tiny_model(41, torch.float64, gates=True, gate_seed=42, window=RECENT, sinks=SINKS)
    return attach_random_gates(model, 43, RECENT, SINKS, request.param) if request.param == "hidden" else model


def _config(across: bool | None) -> KVCacheConfig:
    options = {"mode": "one-shot", "budget": BUDGET, "sinks": SINKS, "recent": RECENT}
    options.update({} if across is None else {"across_layers": across})
    return KVCacheConfig("learned", cache_length=48, chunk_size=CHUNK, options=options)


def _prefill(model: GPT, across: bool | None) -> tuple[list[set[tuple[int, int, int]]], list[np.ndarray]]:
    """Prefill the ragged batch in chunks and compress (`KVCaches.end_prefill`). Returns per row the kept
    `(layer, head, position)` and per layer the float64 block inputs `(B, T, n_embd)` of the real tokens."""
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    idx, pos = pad_prompts(prompts, torch.device("cpu"))
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(model.config.n_layer)}
    model.set_kv_caches(model.build_kv_caches(_config(across), len(LENGTHS)))
    try:
        for s in range(0, idx.shape[1], CHUNK):
            hook = lambda i, x: inputs[i].append(x.detach())  # noqa: E731
            model(idx[:, s : s + CHUNK], pos[:, s : s + CHUNK], block_hook=hook)
        model.caches.end_prefill()
        kept: list[set[tuple[int, int, int]]] = [set() for _ in LENGTHS]
        for layer, cache in enumerate(model.kv_caches):
            assert cache.one_shot.compressed
            for row, head, slot in zip(*torch.nonzero(cache.positions >= 0, as_tuple=True), strict=True):
                kept[int(row)].add((layer, int(head), int(cache.positions[row, head, slot])))
    finally:
        model.set_kv_caches(None)
    return kept, [torch.cat(xs, dim=1).numpy() for _, xs in sorted(inputs.items())]


def _oracle_logits(model: GPT, inputs: list[np.ndarray]) -> np.ndarray:
    """`(n_layers, B, G, T)` float64 gate logits `k . w / sqrt(D) + b` of the pre-RoPE keys (RMSNorm and the
    qkv projection in numpy), or `h . w / sqrt(C) + b` of the normed block input `h` for hidden-state gates,
    `T` the padded length (pads included, ignored later)."""
    c, gates = model.config, model.eviction_gates
    out = []
    for layer, x in enumerate(inputs):
        block = model.transformer.h[layer]
        w_norm = block.norm_1.weight.detach().double().numpy()
        h = x / np.sqrt((x * x).mean(-1, keepdims=True) + block.norm_1.eps) * w_norm
        if gates.input == "hidden":
            w, b = gates.weight[layer].double().numpy(), gates.bias[layer].double().numpy()
            out.append(np.einsum("btc,gc->bgt", h, w) / math.sqrt(c.n_embd) + b[None, :, None])
            continue
        qkv = h @ block.attn.qkv.weight.detach().double().numpy().T
        if block.attn.qkv.bias is not None:
            qkv = qkv + block.attn.qkv.bias.detach().double().numpy()
        q_size, kv = c.n_head * c.head_size, c.n_query_groups * c.head_size
        k = qkv[..., q_size : q_size + kv].reshape(*x.shape[:2], c.n_query_groups, c.head_size)
        w, b = gates.weight[layer].double().numpy(), gates.bias[layer].double().numpy()
        out.append(np.einsum("btgd,gd->bgt", k, w) / math.sqrt(c.head_size) + b[None, :, None])
    return np.stack(out)


def _expected(logits: np.ndarray, across: bool) -> list[set[tuple[int, int, int]]]:
    """Per row: sinks and the `RECENT` newest positions of every (layer, head) kept, then the highest logits,
    `BUDGET x G x n_layers` in all over the row (`across`) or `BUDGET` per (layer, head)."""
    n, _, g, t = logits.shape
    result = []
    for row, length in enumerate(LENGTHS):
        pad = t - length  # left pads: position p sits at column pad + p
        entries = []
        for layer in range(n):
            for head in range(g):
                for p in range(length):
                    protected = p < SINKS or p >= length - RECENT
                    entries.append((math.inf if protected else logits[layer, row, head, pad + p], layer, head, p))
        entries.sort(key=lambda e: -e[0])
        if across:
            result.append({e[1:] for e in entries[: BUDGET * g * n]})
        else:
            per_head = {
                (layer, head): [e for e in entries if e[1:3] == (layer, head)]
                for layer in range(n)
                for head in range(g)
            }
            result.append({e[1:] for es in per_head.values() for e in es[:BUDGET]})
    return result


@pytest.mark.parametrize("across", [True, False])
@torch.inference_mode()
def test_kept_tokens_equal_a_float64_global_top_k(either_model: GPT, across: bool) -> None:
    model = either_model
    kept, inputs = _prefill(model, across)
    expected = _expected(_oracle_logits(model, inputs), across)
    n, g = model.config.n_layer, model.config.n_query_groups
    for row, (got, want) in enumerate(zip(kept, expected, strict=True)):
        assert len(got) == BUDGET * g * n, f"row {row}"
        assert got == want, f"row {row}: kept {sorted(got - want)} instead of {sorted(want - got)}"
    if across:  # the budget really moves between heads: some (layer, head) keeps more than BUDGET
        counts = [sum(1 for e in kept[0] if e[:2] == (layer, head)) for layer in range(n) for head in range(g)]
        assert max(counts) > BUDGET > min(counts)


@pytest.mark.parametrize("target", [None, "kvzip"])
@torch.inference_mode()
def test_gates_on_one_scale_rank_across_layers_by_default(model: GPT, target: str | None) -> None:
    """`across_layers` left unset: gates fitted to log KVzip+ (`target="kvzip"`, one scale in every layer) keep
    the float64 global top-k; gates without a common scale keep `budget` per head, as before."""
    gates = model.eviction_gates
    saved = gates.target
    gates.target = target
    try:
        kept, inputs = _prefill(model, None)
    finally:
        gates.target = saved
    expected = _expected(_oracle_logits(model, inputs), across=target == "kvzip")
    assert kept == expected
    assert kept != _expected(_oracle_logits(model, inputs), across=target != "kvzip")  # the two rules differ here


def test_across_layers_outside_one_shot_and_a_single_layer_compress_are_refused(model: GPT) -> None:
    with pytest.raises(ValueError, match="across_layers=True is for mode='one-shot'"):
        model.build_kv_caches(KVCacheConfig("learned", cache_length=16, options={"across_layers": True}), 1)
    with pytest.raises(TypeError, match="across_layers must be a bool"):
        options = {"mode": "one-shot", "budget": 4, "across_layers": "yes"}
        model.build_kv_caches(KVCacheConfig("learned", cache_length=16, options=options), 1)
    caches = model.build_kv_caches(_config(True), 1)
    model.set_kv_caches(caches)
    try:
        model(torch.arange(10)[None], torch.arange(10)[None])
        cache = model.kv_caches[0]
        assert isinstance(cache.policy, LearnedKVCache)
        with pytest.raises(RuntimeError, match="every layer at once"):
            cache.one_shot.compress()
    finally:
        model.set_kv_caches(None)
