"""The research-policy walkthrough (docs/custom_policy.md): its code is the example module, and it runs."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from litkv.attention import attend, build_mask
from litkv.config import KVCacheConfig
from litkv.kvcache.registry import get_kv_cache_class
from litkv.kvcache.storage import CacheShape

DOCS = Path(__file__).resolve().parents[1] / "docs"
EXAMPLE = DOCS / "examples" / "tova_policy.py"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / "custom_policy.md").read_text(encoding="utf-8"), re.S)


@pytest.fixture
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    monkeypatch.delitem(sys.modules, "tova_policy", raising=False)


def test_walkthrough_shows_the_example_module_verbatim() -> None:
    blocks = _python_blocks()
    assert blocks[0] == EXAMPLE.read_text(encoding="utf-8")
    code_lines = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(code_lines) < 40


def test_walkthrough_runs_by_name_and_by_path(examples_on_path: None) -> None:
    namespace: dict[str, object] = {}
    for block in _python_blocks()[1:]:
        exec(compile(block, str(DOCS / "custom_policy.md"), "exec"), namespace)  # noqa: S102
    by_name, by_path = namespace["by_name"], namespace["by_path"]
    assert len(by_name[0]) == 8 and torch.equal(by_name[0], by_path[0])
    import tova_policy

    assert get_kv_cache_class("tova") is tova_policy.TOVAKVCache
    assert get_kv_cache_class("tova_policy:TOVAKVCache") is tova_policy.TOVAKVCache


def _brute_force_tova(q, k, pos, cache_length, sinks, scale):
    """float64, one (row, KV head) at a time: after each token, drop the non-sink token with the least
    attention from the newest query (summed over the group's heads). Returns kept positions per step."""
    b, heads, n, _ = q.shape
    g = k.shape[1]
    kept = [[[] for _ in range(g)] for _ in range(b)]
    history = []
    for i in range(n):
        for bi in range(b):
            for gi in range(g):
                tokens = kept[bi][gi] + [i]
                weights = torch.zeros(len(tokens), dtype=torch.float64)
                for h in range(gi * (heads // g), (gi + 1) * (heads // g)):
                    logits = torch.stack([q[bi, h, i] @ k[bi, gi, j] for j in tokens]) * scale
                    weights += torch.softmax(logits, dim=0)
                if len(tokens) > cache_length:
                    candidates = [(float(w), j) for w, j in zip(weights, tokens, strict=True) if pos[bi, j] >= sinks]
                    tokens.remove(min(candidates)[1])
                kept[bi][gi] = tokens
        history.append([[sorted(int(pos[bi, j]) for j in kept[bi][gi]) for gi in range(g)] for bi in range(b)])
    return history


def test_tova_keeps_what_the_newest_query_attends_to(examples_on_path: None) -> None:
    cls = get_kv_cache_class("tova_policy:TOVAKVCache")
    b, heads, g, hs, n, length = 2, 8, 2, 16, 30, 6
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, hs, generator=gen, dtype=torch.float64) for h in (heads, g, g))
    pos = torch.arange(n).expand(b, n)
    config = KVCacheConfig(
        "tova_policy:TOVAKVCache", cache_length=length, chunk_size=1, prefill_length=1, options=dict(sinks=1)
    )
    cache = cls(config, CacheShape(b, g, length, hs, hs), None, torch.float32)
    expected = _brute_force_tova(q, k, pos, length, sinks=1, scale=1 / math.sqrt(hs))
    for i in range(n):
        ps = pos[:, i : i + 1]
        keys, values, k_pos = cache.attend_inputs(k[:, :, i : i + 1].float(), v[:, :, i : i + 1].float(), ps)
        _, w = attend(q[:, :, i : i + 1].float(), keys, values, build_mask(ps, k_pos), 1 / math.sqrt(hs),
                      need_weights=True)  # fmt: skip
        cache.evict_and_store(w)
        held = [[sorted(p for p in cache.positions[bi, gi].tolist() if p >= 0) for gi in range(g)] for bi in range(b)]
        assert held == expected[i], f"after token {i}"
    assert expected[-1][0][0] != list(range(n - length, n))  # not simply the most recent tokens
