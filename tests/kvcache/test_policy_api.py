"""The author's side of a policy (`litkv.kvcache.policy`): inputs declared once in `needs`, state returned
by `update_state` (never assigned), the call's typed memo `Candidates.once`; a policy written for the old
interface fails with one line saying what to change."""

from __future__ import annotations

import pytest
import torch

from litkv.kvcache import CacheShape, Candidates, KVCache, Placement, ScoreKVCache, SlotState
from litkv.kvcache.h2o import H2OKVCache
from litkv.kvcache.machine import SlotMachine
from litkv.modeling.config import KVCacheConfig


def _drive(cls: type[KVCache], calls: int = 3, length: int = 4) -> KVCache:
    """A 4-slot cache of `cls` (h2o's options) fed `calls` calls of 3 tokens with uniform weights."""
    cache = SlotMachine(
        cls, KVCacheConfig("h2o", cache_length=length), CacheShape(1, 1, length, 4, 4), None, torch.float32
    )
    gen = torch.Generator().manual_seed(0)
    for i in range(calls):
        pos = torch.arange(3 * i, 3 * i + 3)[None]
        _, _, k_pos = cache.attend_inputs(torch.randn(1, 1, 3, 4, generator=gen), torch.randn(1, 1, 3, 4), pos)
        cache.evict_and_store(torch.ones(k_pos.shape))
    return cache


@pytest.mark.parametrize("flag", ["needs_attn_weights", "needs_queries", "needs_rope", "needs_gates"])
def test_an_old_needs_flag_says_what_to_declare(flag: str) -> None:
    name = flag.removeprefix("needs_")
    with pytest.raises(TypeError, match=rf'^Old: declare needs = {{"{name}"}} instead of {flag} = True'):
        type("Old", (ScoreKVCache,), {flag: True, "score": lambda self, c: c.positions.float()})


def test_after_write_says_it_is_update_state() -> None:
    with pytest.raises(TypeError, match=r"^Old: after_write is now update_state\(placement, candidates\)"):

        class Old(H2OKVCache):
            def after_write(self, placement: Placement, candidates: Candidates) -> None:
                pass


def test_unknown_needs_are_named() -> None:
    with pytest.raises(TypeError, match=r"needs: unknown \['weights'\]; known: \['attn_weights', 'gates'"):
        type("Odd", (ScoreKVCache,), {"needs": {"weights"}})


def test_needs_sets_the_flags_attention_reads() -> None:
    cls = type("Both", (ScoreKVCache,), {"needs": {"attn_weights", "queries"}, "score": lambda self, c: c})
    assert cls.needs == frozenset({"attn_weights", "queries"}) and cls.needs_attn_weights and cls.needs_queries
    assert not cls.needs_rope and not cls.needs_gates and not ScoreKVCache.needs_attn_weights


def test_scratch_says_to_use_the_memo() -> None:
    cands = Candidates(torch.zeros(1, 1, 2), None, None, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4),
                       torch.zeros(1, 1, dtype=torch.long))  # fmt: skip
    with pytest.raises(AttributeError, match=r"Candidates.scratch is gone: .*candidates.once\(self.method\)"):
        cands.scratch["h2o.accumulated"] = 0


def test_memo_computes_once_per_call() -> None:
    seen = []

    class Counted(H2OKVCache):
        def accumulated(self, candidates: Candidates) -> torch.Tensor:
            return candidates.once(self.counted)

        def counted(self, candidates: Candidates) -> torch.Tensor:
            seen.append(candidates.num_new)
            return super().accumulated(candidates)

    _drive(Counted, calls=3)
    assert seen == [3, 3, 3]  # score and update_state both asked in the evicting calls; once each call
    expected = _drive(H2OKVCache, calls=3)
    assert torch.equal(_drive(Counted, calls=3).policy.attn_sums, expected.policy.attn_sums)


def test_attended_runs_in_a_full_caches_decode_steps_before_the_eviction() -> None:
    """`attended` is called in each decode step of a full cache (after attention, `attn_weights` set), not in a
    prompt's call; what it puts in the call's memo is what the eviction reads, and the cache ends as without it."""
    seen: list[tuple[str, int]] = []

    class Early(H2OKVCache):
        def attended(self, candidates: Candidates) -> None:
            assert candidates.attn_weights is not None
            seen.append(("attended", candidates.num_new))
            candidates.once(self.counted)

        def accumulated(self, candidates: Candidates) -> torch.Tensor:
            return candidates.once(self.counted)

        def counted(self, candidates: Candidates) -> torch.Tensor:
            seen.append(("computed", candidates.num_new))
            return super().accumulated(candidates)

    def drive(cls: type[KVCache]) -> SlotMachine:
        cache = SlotMachine(cls, KVCacheConfig("h2o", cache_length=4), CacheShape(1, 1, 4, 4, 4), None, torch.float32)
        gen = torch.Generator().manual_seed(0)
        for pos in ([0, 1, 2], [3, 4, 5], [6], [7], [8]):
            t = len(pos)
            _, _, k_pos = cache.attend_inputs(torch.randn(1, 1, t, 4, generator=gen), torch.randn(1, 1, t, 4),
                                              torch.tensor([pos]))  # fmt: skip
            cache.evict_and_store(torch.rand(k_pos.shape, generator=gen))
        return cache

    early, plain = drive(Early), drive(H2OKVCache)
    assert seen == [("computed", 3)] * 2 + [("attended", 1), ("computed", 1)] * 3
    assert torch.equal(early.positions, plain.positions)
    assert torch.equal(early.policy.attn_sums, plain.policy.attn_sums)


def test_state_assigned_in_the_hook_is_refused() -> None:
    class Assigning(H2OKVCache):
        def update_state(self, placement: Placement, candidates: Candidates) -> None:
            self.attn_sums = placement.carry(self.accumulated(candidates))

    with pytest.raises(AttributeError, match=r"Assigning.attn_sums is declared state: return it from update_state"):
        _drive(Assigning)


def test_undeclared_state_returned_is_named() -> None:
    class Extra(H2OKVCache):
        def update_state(self, placement: Placement, candidates: Candidates) -> dict[str, torch.Tensor]:
            return {**super().update_state(placement, candidates), "age": self.positions.float()}

    with pytest.raises(ValueError, match=r"Extra.update_state returned 'age', which is not declared in its slot_state"):
        _drive(Extra)


def test_returned_state_is_what_the_cache_holds() -> None:
    class Aged(H2OKVCache):
        slot_state = {**H2OKVCache.slot_state, "age": SlotState(-1.0)}

        def update_state(self, placement: Placement, candidates: Candidates) -> dict[str, torch.Tensor]:
            return {**super().update_state(placement, candidates), "age": self.positions.float() * 2}

    cache = _drive(Aged)
    assert torch.equal(cache.policy.age, cache.positions.float() * 2)
    assert "slot.age" in cache.state_tensors()


def test_a_policy_is_built_by_its_cache() -> None:
    """The layer cache composes the policy: the policy object carries the contract, the cache the machinery."""
    cache = _drive(H2OKVCache)
    policy = cache.policy
    assert isinstance(policy, H2OKVCache) and policy.cache is cache
    assert policy.positions is cache.positions and policy.cache_length == cache.cache_length == 4
    assert not hasattr(policy, "attend_inputs") and not hasattr(policy, "storage")
    assert not hasattr(cache, "attn_sums") and "slot.attn_sums" in cache.state_tensors()


def test_the_old_constructor_says_how_to_build() -> None:
    with pytest.raises(TypeError, match=r"^H2OKVCache is a policy, built by its layer cache: SlotMachine\(H2OKVCache"):
        H2OKVCache(KVCacheConfig("h2o", cache_length=4), CacheShape(1, 1, 4, 4, 4), None, torch.float32)


def test_a_constructor_of_the_old_signature_is_refused() -> None:
    with pytest.raises(TypeError, match=r"^Old.__init__\('config', 'shape', 'device', 'dtype'\): a policy is built"):

        class Old(H2OKVCache):
            def __init__(self, config: object, shape: object, device: object, dtype: object) -> None:
                pass


@pytest.mark.parametrize("name", ["attend_inputs", "state_tensors", "load_state_tensors", "slots_known_valid"])
def test_overriding_the_machinery_is_refused(name: str) -> None:
    with pytest.raises(TypeError, match=rf"^Old.{name} belongs to the layer cache \(SlotMachine\), which runs"):
        type("Old", (H2OKVCache,), {name: lambda self, *a: None})
