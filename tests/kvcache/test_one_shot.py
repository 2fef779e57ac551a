"""The one-shot compression as a component (`litkv.kvcache.one_shot`): `one_shot(policy)` and `adakv(policy)` keep
what an independent brute force keeps from the policy's own `oneshot_scores()`; `options={"mode": "one-shot"}` is
the same run as the wrapper; a policy written the old way (a `OneShot` subclass, `compress`/`select_keep` of its
own) fails with one line saying what to change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from litkv.kvcache import CacheShape, SlotMachine
from litkv.kvcache.adakv import AdaKV, AdaKVKNorm, adakv
from litkv.kvcache.dense import DenseKVCache
from litkv.kvcache.keydiff import KeyDiffKVCache
from litkv.kvcache.knorm import KNormKVCache
from litkv.kvcache.last_recent import LastRecentKVCache
from litkv.kvcache.one_shot import OneShot, compress_all, one_shot
from litkv.kvcache.score import ScoreKVCache
from litkv.modeling.config import KVCacheConfig

B, G, L, D, PROMPT = 2, 3, 24, 8, 20


class KeepLowest(OneShot):
    """A compression of the test's own: the `budget` lowest scores, with an option."""

    option_fields = (("flip", bool, True),)

    @classmethod
    def check_options(cls, options: object) -> None:
        if not isinstance(options.flip, bool):  # type: ignore[attr-defined]
            raise TypeError("flip must be a bool")

    def select_keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().select_keep(-scores if self.options.flip else scores, positions)  # type: ignore[attr-defined]


OneShotKNorm = one_shot(KNormKVCache, module=__name__)
OneShotLastRecent = one_shot(LastRecentKVCache, module=__name__)
KeepLowestKeyDiff = one_shot(KeyDiffKVCache, KeepLowest, module=__name__)
AdaKVLastRecent = adakv(LastRecentKVCache)


def _cache(policy: str, options: dict) -> SlotMachine:
    config = KVCacheConfig(policy, cache_length=L, chunk_size=8, options=options)
    return config.make_cache(CacheShape(B, G, L, D, D), None, torch.float32)


def _prefill(cache: SlotMachine, seed: int = 0) -> None:
    """`PROMPT` tokens per row in chunks of 8 (row 1 two tokens shorter: pads), random keys and values."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(PROMPT).expand(B, PROMPT).clone()
    pos[1, -2:] = -1
    for start in range(0, PROMPT, 8):
        t = min(8, PROMPT - start)
        keys, values = torch.randn(2, B, G, t, D, generator=gen).unbind(0)
        _, _, seen = cache.attend_inputs(keys, values, pos[:, start : start + t])
        cache.evict_and_store(torch.rand(seen.shape, generator=gen))


def _kept(cache: SlotMachine) -> list[list[set[int]]]:
    return [[{p for p in head.tolist() if p >= 0} for head in row] for row in cache.positions]


def _by_position(cache: SlotMachine, scores: torch.Tensor) -> list[list[dict[int, float]]]:
    """`[row][head] {position: float64 score}` of the filled slots."""
    out = []
    for row_pos, row_scores in zip(cache.positions, scores.double(), strict=True):
        heads = zip(row_pos.tolist(), row_scores.tolist(), strict=True)
        out.append([{p: s for p, s in zip(hp, hs, strict=True) if p >= 0} for hp, hs in heads])
    return out


def _top(scores: dict[int, float], k: int) -> set[int]:
    """The `k` highest, equal scores broken by position (the newer kept)."""
    return set(sorted(scores, key=lambda p: (scores[p], p), reverse=True)[:k])


def _ref_adakv(per_head: list[dict[int, float]], budget: int, alpha: float) -> list[set[int]]:
    """AdaKV by brute force: each head's `max(1, int(budget alpha))` best, then the best other tokens of all
    heads until `budget x heads`."""
    safe = max(1, int(budget * alpha))
    chosen = [_top(sc, safe) for sc in per_head]
    rest = sorted(((sc[p], h, p) for h, sc in enumerate(per_head) for p in sc if p not in chosen[h]), reverse=True)
    for _, h, p in rest[: budget * len(per_head) - sum(map(len, chosen))]:
        chosen[h].add(p)
    return chosen


@pytest.mark.parametrize(
    ("policy", "options"),
    [(f"{__name__}:OneShotKNorm", {"budget": 7}), (f"{__name__}:OneShotLastRecent", {"budget": 6, "sinks": 2})],
)
def test_one_shot_keeps_the_brute_force_top_k_of_its_scores(policy: str, options: dict) -> None:
    cache = _cache(policy, options)
    _prefill(cache)
    assert cache.one_shot is not None and not cache.one_shot.compressed
    scores = _by_position(cache, cache.policy.oneshot_scores().to(torch.float32))
    cache.end_prefill()
    assert cache.one_shot.compressed and cache.state_tensors()["row.one_shot_compressed"].all()
    assert _kept(cache) == [[_top(head, options["budget"]) for head in row] for row in scores]


@pytest.mark.parametrize("policy", ["knorm", "last-recent"])
def test_the_mode_option_is_the_wrapper(policy: str) -> None:
    """`options={"mode": "one-shot"}` on the policy and `one_shot(policy)` run the same: every state tensor equal
    after the prompt, the compression and decode steps until the cache evicts again."""
    extra = {"sinks": 2} if policy == "last-recent" else {}
    wrapped = f"{__name__}:{'OneShotKNorm' if policy == 'knorm' else 'OneShotLastRecent'}"
    states = []
    for name, options in ((policy, {"mode": "one-shot", "budget": 8, **extra}), (wrapped, {"budget": 8, **extra})):
        cache = _cache(name, options)
        _prefill(cache)
        compress_all([cache])
        gen = torch.Generator().manual_seed(1)
        for step in range(L - 8 + 2):  # past the cache's end: evicting again
            keys, values = torch.randn(2, B, G, 1, D, generator=gen).unbind(0)
            _, _, seen = cache.attend_inputs(keys, values, torch.full((B, 1), PROMPT + step))
            cache.evict_and_store(torch.rand(seen.shape, generator=gen))
        states.append(cache.state_tensors())
    assert states[0].keys() == states[1].keys()
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name


@pytest.mark.parametrize(("budget", "alpha"), [(5, 0.2), (4, 0.5)])
def test_adakv_keeps_the_brute_force_allocation(budget: int, alpha: float) -> None:
    cache = _cache("litkv.kvcache.adakv:AdaKVKNorm", {"budget": budget, "alpha_safeguard": alpha})
    assert isinstance(cache.one_shot, AdaKV) and isinstance(cache.policy, KNormKVCache)
    _prefill(cache, seed=3)
    scores = _by_position(cache, cache.policy.oneshot_scores().to(torch.float32))
    cache.end_prefill()
    want = [_ref_adakv(row, budget, alpha) for row in scores]
    assert _kept(cache) == want
    assert cache.one_shot.used_slots().tolist() == [[len(head) for head in row] for row in want]
    assert len({len(head) for row in want for head in row}) > 1  # the heads did get different budgets


def test_adakv_of_last_recent_and_the_names_by_path() -> None:
    """`adakv` wraps any policy with a one-shot mode; the classes of `litkv.kvcache.adakv` keep their names."""
    assert AdaKVKNorm.__name__ == "AdaKVKNorm" and AdaKVKNorm.__module__ == "litkv.kvcache.adakv"
    assert issubclass(AdaKVKNorm, KNormKVCache) and AdaKVKNorm.compression is AdaKV
    cache = _cache(f"{__name__}:AdaKVLastRecent", {"budget": 4, "sinks": 1})
    _prefill(cache)
    cache.end_prefill()
    assert int(cache.one_shot.used_slots().sum()) == B * G * 4


def test_a_compression_of_ones_own_adds_its_options() -> None:
    fields = [f.name for f in dataclasses.fields(KeepLowestKeyDiff.Options)]
    assert fields[-1] == "flip" and KeepLowestKeyDiff.__name__ == "KeepLowestKeyDiff"
    with pytest.raises(TypeError, match="flip must be a bool"):
        KVCacheConfig(f"{__name__}:KeepLowestKeyDiff", cache_length=L, options={"budget": 6, "flip": 1})
    cache = _cache(f"{__name__}:KeepLowestKeyDiff", {"budget": 6, "recent": 0})
    _prefill(cache)
    scores = _by_position(cache, -cache.policy.oneshot_scores().to(torch.float32))
    cache.end_prefill()
    assert _kept(cache) == [[_top(head, 6) for head in row] for row in scores]


def test_one_shot_refuses_what_it_cannot_wrap_and_the_continuous_mode() -> None:
    with pytest.raises(TypeError, match="one_shot needs a policy with a one-shot mode"):
        one_shot(DenseKVCache)
    with pytest.raises(TypeError, match="OneShot subclass"):
        one_shot(KNormKVCache, object)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="OneShotKNorm runs one-shot only: mode must be 'one-shot'"):
        KVCacheConfig(f"{__name__}:OneShotKNorm", cache_length=L, options={"mode": "continuous"})
    assert _cache("knorm", {}).one_shot is None


def test_a_policy_written_the_old_way_fails_in_one_line() -> None:
    with pytest.raises(ImportError, match="OneShot is gone: a policy no longer subclasses OneShot") as err:
        from litkv.kvcache.score import OneShot as _  # noqa: F401
    assert "\n" not in str(err.value)
    with pytest.raises(ImportError, match="moved to litkv.kvcache.one_shot.compress_all"):
        from litkv.kvcache.score import compress_all as _  # noqa: F401, F811
    for method in ("select_keep", "compress"):
        with pytest.raises(TypeError, match=rf"^Old: {method} belongs to the one-shot compression") as err:
            type("Old", (ScoreKVCache,), {method: lambda self, *a: None, "score": lambda self, c: c.positions.float()})
        assert "\n" not in str(err.value)
