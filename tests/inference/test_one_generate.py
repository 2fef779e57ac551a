"""One `generate` for token-id and segment prompts, one `Sampling` value (issue 43 item 3).

References: a batch of segment prompts gives each prompt alone (greedy); a prompt's token ids
and the same ids as one text segment (prefilled by `prefill_segments`, not `run_chunks`) or as one block
at position 0 (spliced from the block store) give the same tokens; a mixed batch's rows are those of each
prompt alone. Greedy and seeded sampling, dense and evicting caches, ragged rows."""

from __future__ import annotations

import pytest
import torch
from helpers import random_tokens, tiny_gpt

from litkv import GPT, BlockStore, KVCacheConfig, PrefixCache, Sampling, Segment, generate

CACHES = {
    "dense": KVCacheConfig("dense", cache_length=96, chunk_size=8),
    "h2o": KVCacheConfig("h2o", cache_length=24, chunk_size=8),
    "snapkv-int8": KVCacheConfig("snapkv", cache_length=24, chunk_size=8, storage="int8", quant_group_size=8),
}
SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 1.3, "top_k": 40, "top_p": 0.95}}
STOPS = tuple(range(3, 128, 11))  # rows stop at different steps
PROMPTS = [random_tokens(1, n, seed=10 + n)[0] for n in (23, 9, 31)]
DOCS = [random_tokens(1, n, seed=90 + i)[0] for i, n in enumerate((20, 13))]


def _segment_prompts() -> list[list[Segment]]:
    text = [random_tokens(1, 5, seed=95 + i)[0] for i in range(3)]
    return [
        [Segment(text[0]), Segment(DOCS[0], True), Segment(DOCS[1], True), Segment(text[1])],
        [Segment(DOCS[1], True), Segment(text[2])],
    ]


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_gpt(33, config="SmolLM2-135M", gates=True)


def _sampling(options: dict) -> Sampling:
    return Sampling(**options, stop_tokens=STOPS, seed=7)


@torch.inference_mode()
@pytest.mark.parametrize(
    ("cache", "sampling"), [("dense", "greedy"), ("dense", "seeded"), ("h2o", "greedy"), ("snapkv-int8", "seeded")]
)
def test_a_batch_of_segment_prompts_gives_each_prompt_alone(model: GPT, cache: str, sampling: str) -> None:
    """Rows of segment prompts (blocks spliced, 30% recomputed) against each prompt alone: greedy rows are
    bitwise those of the prompt alone; seeded rows draw from one generator, so only their lengths are bounded."""
    cfg, options = CACHES[cache], SAMPLINGS[sampling]
    prompts = _segment_prompts()
    new_batch = generate(model, prompts, 10, cfg, _sampling(options), block_store=BlockStore(1 << 24), recompute=0.3)
    assert all(0 < len(t) <= 10 for t in new_batch)
    alone_rows = []
    for segments in prompts:
        (alone,) = generate(model, [segments], 10, cfg, _sampling(options), recompute=0.3)
        alone_rows.append(alone.tolist())
    if sampling == "greedy":  # batched rows are each prompt alone (sampled rows draw from one generator)
        assert [t.tolist() for t in new_batch] == alone_rows


@torch.inference_mode()
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("cache", ["dense", "h2o"])
def test_token_ids_a_text_segment_and_a_block_at_zero_give_equal_tokens(model: GPT, cache: str, sampling: str) -> None:
    """Three prefills of one prompt: `run_chunks` (token ids), `prefill_segments` of one text segment, and
    the prompt as a block at position 0 (computed alone, spliced without rotation: the same calls)."""
    cfg, ids = CACHES[cache], PROMPTS[2]
    as_ids = generate(model, [ids], 12, cfg, _sampling(SAMPLINGS[sampling]))[0]
    as_text = generate(model, [[Segment(ids)]], 12, cfg, _sampling(SAMPLINGS[sampling]))[0]
    assert as_text.tolist() == as_ids.tolist()
    if cache == "dense":  # h2o asks for attention weights: a block's are those of zero queries
        store = BlockStore(1 << 24)
        as_block = generate(model, [[Segment(ids, True)]], 12, cfg, _sampling(SAMPLINGS[sampling]), block_store=store)
        assert as_block[0].tolist() == as_ids.tolist()


@torch.inference_mode()
def test_a_batch_of_token_ids_and_segments_gives_each_prompt_alone(model: GPT) -> None:
    cfg = CACHES["h2o"]
    prompts: list = [PROMPTS[0], _segment_prompts()[0], PROMPTS[1]]
    got = generate(model, prompts, 8, cfg, Sampling(stop_tokens=(5,)))
    for prompt, row in zip(prompts, got, strict=True):
        assert row.tolist() == generate(model, [prompt], 8, cfg, Sampling(stop_tokens=(5,)))[0].tolist()


@torch.inference_mode()
def test_a_seed_gives_the_same_tokens_at_every_call(model: GPT) -> None:
    seeded = Sampling(temperature=1.5, seed=3)
    first = generate(model, PROMPTS, 8, CACHES["dense"], seeded)
    assert [t.tolist() for t in generate(model, PROMPTS, 8, CACHES["dense"], seeded)] == [t.tolist() for t in first]
    same = Sampling(temperature=1.5, generator=torch.Generator().manual_seed(3))
    assert [t.tolist() for t in generate(model, PROMPTS, 8, CACHES["dense"], same)] == [t.tolist() for t in first]


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"stop_tokens": 5}, TypeError, "stop_tokens must be a sequence of token ids, got int"),
        ({"stop_tokens": (1, -2)}, ValueError, "a stop token must be an int in \\[0, 9223372036854775807\\], got -2"),
        ({"stop_tokens": (1.5,)}, ValueError, "a stop token must be an int in \\[0, 9223372036854775807\\], got 1.5"),
        ({"seed": 2**64}, ValueError, r"seed must be an int in \[-9223372036854775808, .* got 1844"),
        ({"seed": "1"}, ValueError, "seed must be an int in .* got '1'"),
        ({"seed": 1, "generator": torch.Generator()}, ValueError, "a generator or a seed, not both"),
        ({"generator": 3}, TypeError, "generator must be a torch.Generator or None, got int"),
    ],
)
def test_bad_sampling_values_are_refused(options: dict, error: type[Exception], named: str) -> None:
    with pytest.raises(error, match=named):
        Sampling(**options)


def test_sampling_must_be_a_sampling_value(model: GPT) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'temperature'"):
        generate(model, PROMPTS, 2, CACHES["dense"], temperature=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="sampling must be a litkv.Sampling .* got float 0.8"):
        generate(model, PROMPTS, 2, CACHES["dense"], 0.8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix_cache serves token-id prompts"):
        generate(model, [_segment_prompts()[0]], 2, CACHES["dense"], prefix_cache=PrefixCache(1 << 20))
