"""Compiled decode of each hybrid family: one graph, no graph break, no recompilation across steps and
generate calls, the recurrent states at fixed addresses over the compiled steps, the eager path's greedy tokens
(dynamo's "eager" backend decides breaks and recompiles)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from helpers import tiny_gpt
from hybrid_families import HYBRID_FAMILIES, VOCAB
from torch._dynamo.utils import counters

from litkv import KVCacheConfig, generate


@pytest.mark.slow
@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_compiled_decode_one_graph_eager_tokens(family: str, policy: str) -> None:
    model = tiny_gpt(5, torch.float64, config=HYBRID_FAMILIES[family]())
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (13, 29)]
    kv = KVCacheConfig(policy, cache_length=96 if policy == "dense" else 16, chunk_size=8)
    eager = generate(model, prompts, 40, kv)
    torch._dynamo.reset()
    counters.clear()
    try:
        model.compiled_decode_step(backend="eager")
        addresses: list[list[int]] = []

        def record(_: torch.Tensor) -> None:  # the recurrent states keep their addresses (CUDA graph replay)
            addresses.append([t.data_ptr() for c in model.caches.recurrent_caches for t in (c.conv, c.ssm)])

        first = generate(model, prompts, 40, kv, compile=True, on_tokens=record)
        assert len(addresses) == 40 and addresses[1] and all(a == addresses[1] for a in addresses[2:])
        second = generate(model, prompts, 40, kv, compile=True)
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()
    for ref, a, b in zip(eager, first, second, strict=True):
        assert len(ref) == 40 and torch.equal(ref, a) and torch.equal(ref, b)
