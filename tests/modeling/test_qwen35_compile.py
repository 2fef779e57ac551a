"""Compiled decode of a Gated DeltaNet hybrid (Qwen3.5): one graph, no graph break, no recompilation across
steps and generate calls, the eager path's greedy tokens (dynamo's "eager" backend decides breaks and
recompiles)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from helpers import tiny_gpt
from qwen35_helpers import VOCAB, qwen35_config
from torch._dynamo.utils import counters

from litkv import KVCacheConfig, generate


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_compiled_decode_one_graph_eager_tokens(policy: str) -> None:
    model = tiny_gpt(5, torch.float64, config=qwen35_config())
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (13, 29)]
    kv = KVCacheConfig(policy, cache_length=96 if policy == "dense" else 16, chunk_size=8)
    eager = generate(model, prompts, 40, kv)
    torch._dynamo.reset()
    counters.clear()
    try:
        model.compiled_decode_step(backend="eager")
        first = generate(model, prompts, 40, kv, compile=True)
        second = generate(model, prompts, 40, kv, compile=True)
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()
    for ref, a, b in zip(eager, first, second, strict=True):
        assert len(ref) == 40 and torch.equal(ref, a) and torch.equal(ref, b)
