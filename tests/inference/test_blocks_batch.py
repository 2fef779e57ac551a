"""Prompts of segments decoded together (`generate` with several segment prompts): each row prefilled alone
(blocks spliced from one shared store), then decoded in one batch. Reference: each prompt alone
(`generate` with one): the same tokens, and logits equal up to the rounding of batched matmuls."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import random_tokens

from litkv import GPT, KVCacheConfig
from litkv.inference.blocks import Segment
from litkv.inference.generate import generate
from litkv.states.block_store import BlockStore
from litkv.states.prefix import PrefixCache

DOCS = [random_tokens(1, n, seed=90 + i)[0] for i, n in enumerate((20, 13, 17))]


def _prompts() -> list[list[Segment]]:
    """Three layouts: two documents after a text and in the other order, and a document at position 0."""
    text = [random_tokens(1, n, seed=95 + i)[0] for i, n in enumerate((5, 6, 3, 9, 4))]
    return [
        [Segment(text[0]), Segment(DOCS[0], True), Segment(DOCS[1], True), Segment(text[1])],
        [Segment(text[2]), Segment(DOCS[1], True), Segment(DOCS[0], True), Segment(text[3])],
        [Segment(DOCS[2], True), Segment(text[4])],
    ]


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(33, gates=True)


def _run(model: GPT, call: Callable[[], object]) -> tuple[object, list[torch.Tensor]]:
    """`call()` with every `model.logits` output recorded."""
    seen: list[torch.Tensor] = []
    logits = model.logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        out = logits(hidden)
        seen.append(out.clone())
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "logits", record)
        return call(), seen


@torch.inference_mode()
@pytest.mark.parametrize(
    ("policy", "storage", "length"),
    [("dense", "float", 64), ("h2o", "float", 24), ("h2o", "int8", 24), ("snapkv", "float", 24)],
)
def test_batch_rows_equal_each_prompt_alone(model: GPT, policy: str, storage: str, length: int) -> None:
    kv = KVCacheConfig(policy, cache_length=length, chunk_size=8, storage=storage, quant_group_size=8)
    store = BlockStore(1 << 24)
    prompts = _prompts()
    batch, batch_logits = _run(model, lambda: generate(model, prompts, 5, kv, block_store=store, recompute=0.3))
    # pieces of 8 tokens: documents of 20, 13 and 17 tokens are 3 + 2 + 3 pieces, computed once; the second
    # prompt restores the 5 pieces of the two documents the first one computed
    assert (store.misses, store.hits) == (8, 5)
    for row, segments in enumerate(prompts):
        alone, alone_logits = _run(
            model, lambda s=segments: generate(model, [s], 5, kv, block_store=store, recompute=0.3)
        )
        assert torch.equal(batch[row], alone[0])  # type: ignore[index]
        for step, logits in enumerate(alone_logits):
            assert torch.allclose(batch_logits[step][row], logits[0], atol=1e-4, rtol=1e-4), (row, step)
    assert store.misses == 8


def test_batch_arguments_are_checked(model: GPT) -> None:
    kv = KVCacheConfig("dense", cache_length=64, chunk_size=8)
    with pytest.raises(TypeError, match="non-empty list"):
        generate(model, [], 4, kv)
    with pytest.raises(TypeError, match="prompt 1 must be .* or a non-empty list of litkv.Segment"):
        generate(model, [_prompts()[0], []], 4, kv)
    with pytest.raises(ValueError, match="recompute must be a fraction"):
        generate(model, _prompts(), 4, kv, recompute=2.0)
    with pytest.raises(TypeError, match="one KVCacheConfig"):
        generate(model, _prompts(), 4, [kv])
    with pytest.raises(ValueError, match="prefix_cache serves token-id prompts"):
        generate(model, _prompts(), 4, kv, prefix_cache=PrefixCache(1 << 20))
    assert [t.numel() for t in generate(model, _prompts(), 0, kv)] == [0, 0, 0]
