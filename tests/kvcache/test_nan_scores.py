"""A policy whose `score()` returns NaN is refused naming the policy (issue 61 item 7), not run with an
arbitrary eviction: checked on a prompt chunk's eviction and at the one-shot compression, where one host
read costs nothing next to the chunk, and in eager decode steps on the CPU (no device queue to stall); not in
an accelerator's decode steps nor in compiled ones (no host sync added there)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import random_tokens, tiny_gpt

from litkv import GPT, KVCacheConfig, generate, register_kv_cache
from litkv.kvcache import Candidates, ScoreKVCache, registry


class NaNScoreKVCache(ScoreKVCache):
    """Value norms, with NaN for every candidate of KV head 0 when `poison` is set."""

    poison = True

    def score(self, candidates: Candidates) -> torch.Tensor:
        scores = candidates.values.float().norm(dim=-1)
        if self.poison:
            scores[:, 0] = float("nan")
        return scores


@pytest.fixture(scope="module")
def model() -> Iterator[GPT]:
    """A tiny model, with the policy registered for this module only (other tests list the policies)."""
    register_kv_cache("test-nan-score")(NaNScoreKVCache)
    yield tiny_gpt(3, config="SmolLM2-135M")
    registry._REGISTRY._entries.pop("test-nan-score")


PROMPT = random_tokens(1, 40, seed=4)[0]
OPTIONS = {"continuous": ({}, 16), "one-shot": ({"mode": "one-shot", "budget": 8}, 64)}


@pytest.mark.parametrize("mode", sorted(OPTIONS))
def test_nan_scores_are_refused_naming_the_policy(model: GPT, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    options, length = OPTIONS[mode]
    kv = KVCacheConfig("test-nan-score", cache_length=length, chunk_size=8, options=options)
    with pytest.raises(ValueError, match=r"NaNScoreKVCache\.(score|oneshot_scores) returned NaN scores"):
        generate(model, [PROMPT], 4, kv)
    monkeypatch.setattr(NaNScoreKVCache, "poison", False)  # the same policy with finite scores runs
    assert generate(model, [PROMPT], 4, kv)[0].numel() == 4


def test_nan_scores_in_cpu_decode_steps_are_refused(model: GPT, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt that fits its cache (no eviction while it is prefilled): the first eviction is a decode step's."""
    kv = KVCacheConfig("test-nan-score", cache_length=16, chunk_size=8)
    with pytest.raises(ValueError, match=r"NaNScoreKVCache\.score returned NaN scores"):
        generate(model, [PROMPT[:10]], 12, kv)
    monkeypatch.setattr(NaNScoreKVCache, "poison", False)
    assert generate(model, [PROMPT[:10]], 12, kv)[0].numel() == 12
