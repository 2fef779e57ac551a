"""The research-policy walkthrough (docs/custom_policy.md): its code is the example modules, its snippets
run, and the examples' rules are what the layer-level cache does (float64 brute force, and decayed H2O
against the built-in H2O and TOVA at its two ends)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from litkv.kvcache import CacheShape, KVCache, registry
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.registry import get_kv_cache_class, known_policies
from litkv.modeling.attention import attend, build_mask

DOCS = Path(__file__).resolve().parents[2] / "docs"
EXAMPLES = DOCS / "examples"
VALUE_NORM = "value_norm_policy:ValueNormKVCache"
DECAYED_H2O = "decayed_h2o_policy:DecayedH2OKVCache"
MODULES = [EXAMPLES / "value_norm_policy.py", EXAMPLES / "decayed_h2o_policy.py"]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / "custom_policy.md").read_text(encoding="utf-8"), re.S)


@pytest.fixture
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_walkthrough_shows_the_example_modules_verbatim() -> None:
    blocks = _python_blocks()
    assert blocks[0] == MODULES[0].read_text(encoding="utf-8")  # the first block is the policy
    assert MODULES[1].read_text(encoding="utf-8") in blocks
    code_lines = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(code_lines) < 40


def test_walkthrough_runs_by_name_and_by_path(examples_on_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    modules = {path.read_text(encoding="utf-8") for path in MODULES}
    snippets = [block for block in _python_blocks() if block not in modules]
    # by name, by path, one-shot and adakv, the chat template (test_walkthrough_chat_ids_are_the_clis)
    assert len(snippets) == 4
    import value_norm_policy  # registered in the registry itself, before the copy the snippets run under

    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())  # the one-shot snippet registers a name
    namespace: dict[str, object] = {}
    for block in snippets[:3]:
        exec(compile(block, str(DOCS / "custom_policy.md"), "exec"), namespace)  # noqa: S102
    by_name, by_path = namespace["by_name"], namespace["by_path"]
    assert len(by_name[0]) == 8 and torch.equal(by_name[0], by_path[0])
    one_shot_tokens, adakv_tokens = namespace["one_shot_tokens"], namespace["adakv_tokens"]
    assert len(one_shot_tokens[0]) == len(adakv_tokens[0]) == 8
    assert get_kv_cache_class("value-norm-adakv").__name__ == "AdaKVValueNorm"
    assert get_kv_cache_class("value-norm") is value_norm_policy.ValueNormKVCache
    assert get_kv_cache_class(VALUE_NORM) is value_norm_policy.ValueNormKVCache


def test_walkthrough_chat_ids_are_the_clis() -> None:
    """The page's chat snippet gives the ids `litkv generate` feeds for one user message (its chat template
    rendered, as `litkv.cli.generate_cmd` builds a prompt's ids), on the real model's checkpoint."""
    from litkv.checkpoints.download import cache_dir

    if not (cache_dir("smollm2-135m-instruct") / "model.safetensors").is_file():
        pytest.skip("the shipped model is not downloaded (`litkv download smollm2-135m-instruct`)")
    namespace: dict[str, object] = {"torch": torch}
    exec(compile(_python_blocks()[-1], str(DOCS / "custom_policy.md"), "exec"), namespace)  # noqa: S102
    ids, tokenizer, checkpoint = namespace["chat_ids"], namespace["tokenizer"], namespace["checkpoint"]
    from litkv.cli.generate_cmd import _encode
    from litkv.inference.chat_template import load_format

    cli_ids = _encode(load_format(checkpoint, tokenizer, None), tokenizer, "Name three colours.", torch.device("cpu"))
    assert torch.equal(ids, cli_ids)
    text = tokenizer.decode(ids)
    assert text.startswith("system\n") and text.endswith("\nuser\nName three colours.\nassistant\n")
    assert int((ids == tokenizer.token_to_id("<|im_start|>")).sum()) == 3  # system, user, the generation prompt


def test_example_names_are_not_built_in(examples_on_path: None) -> None:
    """Registering under a taken name is a ValueError, so the docs must not reuse a built-in's name."""
    for path, name in ((VALUE_NORM, "value-norm"), (DECAYED_H2O, "decayed-h2o")):
        cls = get_kv_cache_class(path)
        assert name in known_policies() and get_kv_cache_class(name).__qualname__ == cls.__qualname__
        assert not cls.__module__.startswith("litkv")


def test_decay_is_an_option_checked_by_name(examples_on_path: None) -> None:
    assert KVCacheConfig(DECAYED_H2O, cache_length=8, options=dict(decay=0.5)).policy_options.decay == 0.5
    with pytest.raises(ValueError, match=r"decay must be in \[0.0, 1.0\], got 1.5"):
        KVCacheConfig(DECAYED_H2O, cache_length=8, options=dict(decay=1.5))
    with pytest.raises(ValueError, match="has no option 'decays'; its options: sinks, recent, mode, budget, decay"):
        KVCacheConfig(DECAYED_H2O, cache_length=8, options=dict(decays=0.5))


# -- the rules, against the layer-level cache ------------------------------------------------------


def _held(cache: KVCache) -> list[list[list[int]]]:
    """Sorted positions held per (row, KV head)."""
    return [[sorted(p for p in head.tolist() if p >= 0) for head in row] for row in cache.positions]


def _brute_force_value_norm(
    v: torch.Tensor, bounds: list[tuple[int, int]], cache_length: int, sinks: int, recent: int
) -> list[list[list[list[int]]]]:
    """float64, one (row, KV head) at a time. `v`: `(B, G, n, hs)`. After each chunk, while more than
    `cache_length` tokens are held, drop the one with the smallest value norm that is neither a sink
    nor among the `recent` newest. Returns the sorted kept positions per chunk, row and head."""
    b, g = v.shape[:2]
    kept = [[[] for _ in range(g)] for _ in range(b)]
    history = []
    for start, end in bounds:
        for bi in range(b):
            for gi in range(g):
                tokens = kept[bi][gi] + list(range(start, end))
                newest = sorted(tokens)[len(tokens) - recent :]
                free = sorted(
                    (float(v[bi, gi, j].norm()), j) for j in tokens if j >= sinks and j not in newest
                )  # fmt: skip
                dropped = {j for _, j in free[: max(0, len(tokens) - cache_length)]}
                kept[bi][gi] = [j for j in tokens if j not in dropped]
        history.append([[sorted(kept[bi][gi]) for gi in range(g)] for bi in range(b)])
    return history


@pytest.mark.parametrize(("sinks", "recent"), [(0, 0), (1, 2)])
def test_value_norm_keeps_the_largest_values(examples_on_path: None, sinks: int, recent: int) -> None:
    b, g, hs, n, length = 2, 2, 16, 30, 8
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(b, g, n, hs, generator=gen)
    v = torch.randn(b, g, n, hs, generator=gen) * torch.rand(b, g, n, 1, generator=gen)  # spread the norms
    config = KVCacheConfig(
        VALUE_NORM, cache_length=length, chunk_size=3, prefill_length=5, options=dict(sinks=sinks, recent=recent)
    )
    cache = SlotMachine(get_kv_cache_class(VALUE_NORM), config, CacheShape(b, g, length, hs, hs), None, torch.float32)
    bounds = ChunkPlan.of(config).bounds(n)
    expected = _brute_force_value_norm(v.double(), bounds, length, sinks, recent)
    for (start, end), kept in zip(bounds, expected, strict=True):
        cache.attend_inputs(k[:, :, start:end], v[:, :, start:end], torch.arange(start, end).expand(b, end - start))
        cache.evict_and_store(None)  # needs_attn_weights is False
        assert _held(cache) == kept, f"after tokens {start}..{end}"
    assert expected[-1][0][0] != list(range(n - length, n))  # not simply the most recent tokens


def _run_with_attention(
    policy: str, options: dict[str, object], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Iterator[list[list[list[int]]]]:
    """Drive an 8-slot cache of `policy` with real attention weights, chunks of 3 after a prefill of 5.
    `q`: `(B, n_head, n, hs)`, `k`, `v`: `(B, G, n, hs)`. Yields the held positions after each chunk."""
    b, heads, n, hs = q.shape
    g, length = k.shape[1], 8
    config = KVCacheConfig(policy, cache_length=length, chunk_size=3, prefill_length=5, options=options)
    cache = SlotMachine(get_kv_cache_class(policy), config, CacheShape(b, g, length, hs, hs), None, torch.float32)
    for start, end in ChunkPlan.of(config).bounds(n):
        pos = torch.arange(start, end).expand(b, end - start)
        keys, values, k_pos = cache.attend_inputs(k[:, :, start:end], v[:, :, start:end], pos)
        _, weights = attend(q[:, :, start:end], keys, values, build_mask(pos, k_pos), 1 / math.sqrt(hs),
                            need_weights=True)  # fmt: skip
        cache.evict_and_store(weights)
        yield _held(cache)


def test_decayed_h2o_ends_are_h2o_and_tova(examples_on_path: None) -> None:
    """decay=1 keeps what h2o keeps, decay=0 what tova keeps, after every chunk; in between, neither."""
    b, heads, g, hs, n = 2, 4, 2, 16, 40
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, h, n, hs, generator=gen) * 2 for h in (heads, g, g))
    args = (q, k, v)
    common = dict(sinks=1, recent=2)
    h2o = list(_run_with_attention("h2o", common, *args))
    tova = list(_run_with_attention("tova", common, *args))
    assert list(_run_with_attention(DECAYED_H2O, {**common, "decay": 1.0}, *args)) == h2o
    assert list(_run_with_attention(DECAYED_H2O, {**common, "decay": 0.0}, *args)) == tova
    assert h2o != tova
    halfway = list(_run_with_attention(DECAYED_H2O, {**common, "decay": 0.5}, *args))
    assert halfway != h2o and halfway != tova
