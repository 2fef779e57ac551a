"""A one-shot cache compressed to different counts per head (AdaKV, ranking across layers) holds each head's kept
tokens right-aligned before `num_filled` (`compact_slots`), so that with the tokens decode steps append they are
one run of slots per (row, KV head): a decode step on the PyTorch path attends each run with its own SDPA call
(`HeadStarts`), no mask (the C pass of a float32 step on the CPU masks the slots before each start).
Checked against a float64 oracle (attention over each head's run alone), against the masked call of the same
layout, and end to end: a model's decode steps give the logits of the steps that build their masks from positions.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from litkv import GPT, KVCacheConfig
from litkv.kvcache import CacheShape
from litkv.kvcache.config import ChunkPlan
from litkv.modeling import attention
from litkv.modeling.attention import HeadStarts, attend
from litkv.modeling.runner import run_chunks

ADAKV = "litkv.kvcache.adakv:AdaKVKNorm"


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[list[int]], scale: float) -> torch.Tensor:
    """Float64 softmax attention of each (row, query head) over its KV head's slots `[start, S)`: `(B, 1, H * hv)`."""
    b, n_head, _, _ = q.shape
    g = k.shape[1]
    out = torch.empty(b, n_head, v.shape[-1], dtype=torch.float64)
    for r in range(b):
        for h in range(n_head):
            kv = h // (n_head // g)
            keys, values = k[r, kv, starts[r][kv] :].double(), v[r, kv, starts[r][kv] :].double()
            weights = torch.softmax(keys @ q[r, h, 0].double() * scale, dim=0)
            out[r, h] = weights @ values
    return out.reshape(b, 1, -1)


@pytest.mark.parametrize("skip_all", [False, True], ids=["per-head-calls", "masked"])
def test_head_ranges_attend_each_heads_run_as_the_float64_oracle(
    monkeypatch: pytest.MonkeyPatch, skip_all: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    b, n_head, g, s, d = 2, 6, 3, 40, 16
    q = torch.randn(b, n_head, 1, d, generator=gen)
    k, v = torch.randn(2, b, g, s, d, generator=gen).unbind(0)
    host = [[0, 25, 7], [39, 12, 30]]
    layout = HeadStarts(host, torch.tensor(host))
    calls = []
    per_head = attention._attend_head_ranges
    monkeypatch.setattr(attention, "_attend_head_ranges", lambda *a: calls.append(1) or per_head(*a))
    if skip_all:  # the masked call of the same layout
        monkeypatch.setattr(attention, "HEAD_RANGES_MIN_SKIPPED", 2.0)
    y, _ = attention._attend_torch(q, k, v, layout, 0.25, None, False, None)  # the PyTorch path
    torch.testing.assert_close(y.double(), _oracle(q, k, v, host, 0.25), atol=1e-5, rtol=1e-5)
    assert len(calls) == (0 if skip_all else 1)
    y, _ = attend(q, k, v, layout, 0.25)  # where it builds, the C pass (its mask: the starts)
    torch.testing.assert_close(y.double(), _oracle(q, k, v, host, 0.25), atol=1e-5, rtol=1e-5)
    _, weights = attend(q, k, v, layout, 0.25, need_weights=True)  # the weights path: the mask of the starts
    for r in range(b):
        for h in range(g):
            assert torch.all(weights[r, h, : host[r][h]] == 0)
            torch.testing.assert_close(weights[r, h].sum(), torch.tensor(2.0))  # two query heads per KV head


def test_compression_right_aligns_each_heads_tokens() -> None:
    """Each head's kept tokens, in their slot order, fill `[num_filled - n, num_filled)`; `head_starts` says where."""
    b, g, length, d, prompt = 2, 3, 24, 8, 20
    config = KVCacheConfig(ADAKV, cache_length=length, chunk_size=8, options={"budget": 5, "alpha_safeguard": 0.2})
    cache = config.make_cache(CacheShape(b, g, length, d, d), None, torch.float32)
    gen = torch.Generator().manual_seed(3)
    pos = torch.arange(prompt).expand(b, prompt).clone()
    pos[1, :3] = -1  # a left-padded row
    for start in range(0, prompt, 8):
        keys, values = torch.randn(2, b, g, min(8, prompt - start), d, generator=gen).unbind(0)
        _, _, seen = cache.attend_inputs(keys, values, pos[:, start : start + 8])
        cache.evict_and_store(torch.rand(seen.shape, generator=gen))
    before = cache.positions.clone()
    cache.end_prefill()
    kept = [[sorted(p for p in head.tolist() if p >= 0) for head in row] for row in cache.positions]
    counts = [[len(head) for head in row] for row in kept]
    assert len({n for row in counts for n in row}) > 1  # the heads keep different counts
    filled = cache.num_filled
    assert filled == max(map(max, counts))
    host, starts = cache.head_starts
    assert host == [[filled - n for n in row] for row in counts] and starts.tolist() == host
    for r in range(b):
        for h in range(g):
            slots = cache.positions[r, h].tolist()
            in_slot_order = [p for p in before[r, h].tolist() if p in set(kept[r][h])]
            assert slots[: host[r][h]] == [-1] * host[r][h] and slots[filled:] == [-1] * (length - filled)
            assert slots[host[r][h] : filled] == in_slot_order


def _decode_logits(model: GPT, cfg: KVCacheConfig, prompts: torch.Tensor, trusted: bool, steps: int) -> torch.Tensor:
    """Prefill `prompts` `(B, T)` into one-shot caches, compress, then `steps` greedy decode steps: logits
    `(steps, B, V)`; `trusted`: the steps run as `generate`'s do (`trusted_inputs(no_pads=True)`), else checked
    (masks from positions)."""
    b, t = prompts.shape
    pos = torch.arange(t).expand(b, t)
    logits = []
    with torch.inference_mode(), model.kv_caches_attached(cfg, b):
        hidden = run_chunks(model, prompts, pos, ChunkPlan.of(cfg), lm_head=False, last_only=True)
        model.caches.end_prefill()
        assert all(c.head_starts is not None for c in model.kv_caches)
        last = model.logits(hidden[:, -1])
        for step in range(steps):
            token, step_pos = last.argmax(-1)[:, None], torch.full((b, 1), t + step)
            if trusted:
                with model.trusted_inputs(t + steps, no_pads=True):
                    last = model(token, step_pos)[:, -1]
            else:
                last = model(token, step_pos)[:, -1]
            logits.append(last)
        assert all((c.head_starts is not None) == trusted for c in model.kv_caches)  # a checked step may hold pads
    return torch.stack(logits)


@pytest.mark.parametrize(
    ("policy", "options"),
    [
        (ADAKV, {"budget": 6, "alpha_safeguard": 0.2}),
        ("learned", {"mode": "one-shot", "budget": 6, "across_layers": True}),
    ],
)
def test_decode_steps_over_uneven_heads_equal_the_masked_steps(
    tiny_model: Callable[..., GPT], monkeypatch: pytest.MonkeyPatch, policy: str, options: dict
) -> None:
    model = tiny_model(4, torch.float64, gates=True)  # learned: one budget across layers, heads keep different counts
    prompts = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(5))
    cfg = KVCacheConfig(policy, cache_length=40, chunk_size=16, options=options)
    calls = []
    per_head = attention._attend_head_ranges
    monkeypatch.setattr(attention, "_attend_head_ranges", lambda *a: calls.append(1) or per_head(*a))
    fast = _decode_logits(model, cfg, prompts, trusted=True, steps=6)
    assert calls  # the steps took each head's run
    checked = _decode_logits(model, cfg, prompts, trusted=False, steps=6)
    torch.testing.assert_close(fast, checked, atol=1e-12, rtol=1e-12)
