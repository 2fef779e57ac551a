"""`scripts/needle_layers.py`: per layer and KV head, what a one-shot policy keeps of a planted needle, its
rank in the policy's scores, and the share of attention dense's last queries give it (against float64)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import load_script

from litkv.eval.evaluate import cache_config
from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.modeling.runner import run_chunks

REPEAT = RepeatPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10, 11), prefix_length=2, overlap=4)
TEMPLATE = KVCacheConfig(chunk_size=9)


def _load():
    return load_script("needle_layers")


def _brute_reads(model, ids: torch.Tensor, start: int, needle: list[int]) -> list[list[float]]:
    """float64 loops: per layer and KV head, the mean over queries >= start and the group's query heads of the
    softmax weight summed over the needle's keys."""
    inputs = []
    hooks = [b.attn.register_forward_hook(lambda m, i, o: inputs.append((m, i))) for b in model.transformer.h]
    with torch.no_grad():
        model(ids[None])
    for h in hooks:
        h.remove()
    out = []
    for module, (x, cos, sin, *_) in inputs:
        with torch.no_grad():
            q, k, _ = module._qkv(x.double(), cos.double(), sin.double())
        n_head, g, t = q.shape[1], k.shape[1], q.shape[2]
        per_group = [0.0] * g
        for head in range(n_head):
            group = head // (n_head // g)
            for i in range(start, t):
                logits = [float(q[0, head, i] @ k[0, group, j]) * module.scale for j in range(i + 1)]
                top = max(logits)
                weights = [2.718281828459045 ** (v - top) for v in logits]
                per_group[group] += sum(weights[j] for j in needle if j <= i) / sum(weights)
        out.append([v / ((n_head // g) * (t - start)) for v in per_group])
    return out


def test_dense_reads_match_float64_brute_force(tiny_model) -> None:
    nl = _load()
    model = tiny_model(3, torch.float64)
    ids = torch.randint(12, 128, (24,), generator=torch.Generator().manual_seed(5))
    needle = [4, 5, 11]
    got = nl.dense_reads(model, ids, 18, needle)
    want = _brute_reads(model, ids, 18, needle)
    assert len(got) == len(model.transformer.h)
    f64 = torch.float64
    torch.testing.assert_close(torch.tensor(got, dtype=f64), torch.tensor(want, dtype=f64), atol=1e-6, rtol=1e-5)
    assert min(min(r) for r in got) > 0.0  # the needle is read, not a trivial zero


def test_policy_layers_keep_and_rank_a_planted_needle(tiny_model) -> None:
    nl = _load()
    model = tiny_model(7)
    context = torch.randperm(116, generator=torch.Generator().manual_seed(9))[:40] + 12  # distinct: no tied scores
    for policy in ("keydiff", "kvzip"):
        configs = {b: cache_config(TEMPLATE, policy, 48, {"mode": "one-shot", "budget": b}) for b in (8, 16)}
        positions, scores, kept = nl.policy_layers(model, context, configs, REPEAT)
        layers, g = len(positions), positions[0].shape[0]
        total = sum(int((k >= 0).sum()) for k in kept[8])
        assert total == 8 * g * layers  # every (layer, head) keeps its budget; kvzip: the sum over layers
        # the shared prefill keeps what a separate compression of that budget keeps (non-kvzip: end_prefill)
        if policy == "keydiff":
            with torch.inference_mode(), model.kv_caches_attached(configs[8], 1):
                run_chunks(model, context[None], torch.arange(40)[None], ChunkPlan.of(configs[8]), lm_head=False)
                model.caches.end_prefill()
                alone = [c.positions[0].clone() for c in model.caches]
            for a, b in zip(alone, kept[8], strict=True):
                assert torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)
        # plant the needle on the best and on the worst evictable token of layer 0, head 0
        s, p = scores[0][0], positions[0][0]
        free = torch.isfinite(s) & (p >= 0)
        best, worst = int(p[free][s[free].argmax()]), int(p[free][s[free].argmin()])
        ranks, counts = nl.needle_stats(positions[0], scores[0], [best])
        assert ranks[0] == 0 and counts[0] == int(free.sum()) > 16
        assert nl.needle_stats(positions[0], scores[0], [worst])[0][0] == counts[0] - 1
        assert nl.needle_stats(positions[0], scores[0], [best, worst, worst])[0][0] == counts[0] - 1
        if policy == "keydiff":  # per (layer, head) top-budget: the best is kept, the worst is not
            assert nl.kept_share(kept[16][0], [best, worst])[0] == 0.5


def test_needle_positions_first_occurrence_in_context() -> None:
    nl = _load()
    ids = [1, 2, 3, 4, 2, 3, 9, 2, 3]
    assert nl.needle_positions(ids, [[2, 3], [9]], 7) == [1, 2, 6]
    try:
        nl.needle_positions(ids, [[9, 2]], 7)
    except ValueError as e:
        assert "do not occur" in str(e)
    else:
        raise AssertionError("a needle outside the context must raise")


def test_summarize_weights_kept_shares_by_dense_reads(tmp_path: Path) -> None:
    nl = _load()
    head = {"task": "t", "sample": 0, "needle": [3], "wall_s": 1, "cpu_s": 1}
    lines = [
        {**head, "policy": "dense", "reads": [[0.0, 0.0], [0.3, 0.1]]},
        {**head, "policy": "p", "rank": [[9, 7], [0, 2]], "evictable": [10, 10], "kept": {"4": [[0, 0], [1, 0]]}},
    ]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    table = nl.summarize([path], 4).splitlines()
    assert "| 0 | 0.000 | 0.00 | 8 |" in table  # layer 0: nothing read, nothing kept, median rank of 9 and 7
    assert "| 1 | 0.200 | 0.50 | 1 |" in table
    assert "| t 0 | 0.25 (0.75) |" in table  # kept 1 of 4 (layer, head) pairs; 0.3 of the 0.4 read
    assert table[-4:-1] == ["| 1, 0 | 0.300 | 1.00 |", "| 1, 1 | 0.100 | 0.00 |", "| 0, 0 | 0.000 | 0.00 |"]
