"""Spliced blocks with `learned` gates of the layer's hidden state: a block keeps each layer's attention inputs
(the block alone) when the model's gates read them, so each spliced token's slot carries the float64 oracle
`x . w / sqrt(C) + b` of its own input; a block restored from the store's files splices bitwise the same; a
prompt of segments with blocks runs end to end (with and without recomputed tokens)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import attach_random_gates, random_tokens

from litkv import GPT, KVCacheConfig
from litkv.inference.blocks import Segment, prefill_segments, splice
from litkv.inference.generate import generate
from litkv.kvcache.config import ChunkPlan
from litkv.states.block_store import BlockStore

CFG = KVCacheConfig("learned", cache_length=64, chunk_size=8, options={"sinks": 1, "recent": 2})


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return attach_random_gates(tiny_model(33), seed=6, gate_input="hidden")


def _alone_inputs(model: GPT, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's attention input `(1, n, C)` float64 of `ids` run alone from position 0 (forward pre-hooks)."""
    inputs: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda _m, a: inputs.append(a[0].double())) for b in model.transformer.h]
    try:
        with model.kv_caches_attached(KVCacheConfig("dense", cache_length=ids.numel()), 1):
            model(ids[None], torch.arange(ids.numel())[None])
    finally:
        for hook in hooks:
            hook.remove()
    return inputs


def _spliced_logits(model: GPT, context: torch.Tensor, store: BlockStore, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's `(G, n)` slot logits of the block's tokens after `context` and the block spliced after it."""
    with model.kv_caches_attached(CFG, 1):
        prefill_segments(model, [Segment(context)], CFG)
        block = store.get(model, ids, ChunkPlan.of(CFG))
        splice(model, block, context.numel(), torch.ones(ids.numel(), dtype=torch.bool), 8)
        out = []
        for cache in model.kv_caches:
            held = cache.positions[0]  # (G, L): the context, then the block, in slot order
            assert torch.equal(held[:, : context.numel() + ids.numel()], torch.arange(context.numel() + ids.numel())
                               .expand(held.shape[0], -1))  # fmt: skip
            out.append(cache.policy.logits[0, :, context.numel() : context.numel() + ids.numel()].clone())
        return out


@torch.inference_mode()
def test_spliced_tokens_carry_the_oracle_logit_of_their_own_input(model: GPT, tmp_path: Path) -> None:
    context, ids = random_tokens(1, 4, seed=60)[0], random_tokens(1, 19, seed=61)[0]
    gates = model.eviction_gates
    store = BlockStore(1 << 24, tmp_path / "blocks")
    logits = _spliced_logits(model, context, store, ids)
    for layer, (x, got) in enumerate(zip(_alone_inputs(model, ids), logits, strict=True)):
        want = torch.einsum("btc,gc->bgt", x, gates.weight[layer].double())[0] / math.sqrt(x.shape[-1])
        want = want + gates.bias[layer].double()[:, None]
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    again = BlockStore(1 << 24, tmp_path / "blocks")  # the pieces come back from the files
    restored = _spliced_logits(model, context, again, ids)
    assert again.hits == len(ChunkPlan.of(CFG).bounds(ids.numel())) and again.misses == 0
    assert all(torch.equal(a, b) for a, b in zip(logits, restored, strict=True))


@torch.inference_mode()
@pytest.mark.parametrize("recompute", [0.0, 0.3])
def test_a_prompt_of_blocks_runs_with_hidden_state_gates(model: GPT, recompute: float) -> None:
    """Blocks spliced into an evicting `learned` cache (24 slots for 46 tokens), then decoding."""
    segments = [Segment(random_tokens(1, n, seed=70 + i)[0], b) for i, (n, b) in enumerate([(6, False), (20, True),
                (15, True), (5, False)])]  # fmt: skip
    cfg = KVCacheConfig("learned", cache_length=24, chunk_size=8, options={"sinks": 2})
    (tokens,) = generate(model, [segments], 4, cfg, block_store=BlockStore(1 << 24), recompute=recompute)
    assert tokens.shape == (4,)
