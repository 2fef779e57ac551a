"""The decode step's eviction, owned by `KVCaches`: when the layers wait (`begin_call`, its fall-back
conditions), who chooses (the one opt-in classmethod `select_drop_layers`), what an exception in the
middle of a model call leaves, and per-slot state declared as data (`SlotState`, allocated by the base).

The reference of every comparison is the same run with each layer evicted in its own call
(`KVCaches.evict_layers_together = False`), the path every policy took before the batched step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from litkv import GPT, KVCacheConfig, keep_undo_log, snapshot
from litkv.kvcache import CacheShape, Candidates, KVCache, LastRecentKVCache, SlotState
from litkv.kvcache.h2o import H2OKVCache
from litkv.kvcache.machine import SlotMachine

N_LAYER = 4


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(5, overrides={"n_layer": N_LAYER}, gates=True)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 30 tokens, row 1 left-padded by 3."""
    idx = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(30).expand(2, 30).clone()
    pos[1, :3] = -1
    return idx, pos


def _states(model: GPT) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in cache.state_tensors().items()} for cache in model.kv_caches]


def _assert_same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    for layer, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys()
        for name in x:
            assert torch.equal(x[name], y[name]), f"layer {layer}: {name} differs"


# -- the fall-back conditions, written once ---------------------------------------------------------


@torch.inference_mode()
def test_begin_call_batches_plain_decode_steps_only(model: GPT) -> None:
    """A one-token call waits for `evict_waiting`; a longer call, a compiled (static-shapes) step, a call
    an undo log records and a call under autograd evict layer by layer."""
    cfg = KVCacheConfig("h2o", cache_length=8)
    caches = model.set_kv_caches(model.build_kv_caches(cfg, 1))
    try:
        assert caches.begin_call(1) and not caches.begin_call(2)
        caches.static_shapes = True
        assert not caches.begin_call(1)
        caches.static_shapes = False
        caches.evict_layers_together = False
        assert not caches.begin_call(1)
        caches.evict_layers_together = True
        with torch.inference_mode(False), torch.enable_grad():
            assert not caches.begin_call(1)
        keep_undo_log(model)
        assert not caches.begin_call(1)
    finally:
        model.set_kv_caches(None)


class _CountingLastRecent(LastRecentKVCache):
    """last-recent counting its batched choices (`select_drop_layers`) and its per-layer ones."""

    layer_batches: list[int] = []

    @classmethod
    def select_drop_layers(cls, caches: Sequence[LastRecentKVCache], calls: Sequence[Candidates]) -> torch.Tensor:
        cls.layer_batches.append(len(caches))
        return super().select_drop_layers(caches, calls)


class _OwnSelectDrop(_CountingLastRecent):
    """A subclass with its own `select_drop` (the same rule): it must be evicted layer by layer."""

    alone: int = 0

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        type(self).alone += 1
        return super().select_drop(candidates)


def _run_with(model: GPT, cls: type[KVCache], together: bool) -> tuple[list[torch.Tensor], list]:
    idx, pos = _inputs()
    cfg = KVCacheConfig("last-recent", cache_length=10, options={"sinks": 2})
    shape = model.build_kv_caches(cfg, 2)[0].shape
    model.set_kv_caches([SlotMachine(cls, cfg, shape, None, torch.float32) for _ in range(N_LAYER)])
    try:
        model.caches.evict_layers_together = together
        logits = [model(idx[:, :10], pos[:, :10])]
        logits += [model(idx[:, i : i + 1], pos[:, i : i + 1]) for i in range(10, 30)]
        return logits, _states(model)
    finally:
        model.set_kv_caches(None)


@torch.inference_mode()
def test_opted_in_class_chooses_for_all_layers_once_per_step(model: GPT) -> None:
    """20 decode steps of 4 layers: 20 calls of `select_drop_layers` with the 4 layers (the fill step
    too: the cache is full after the prompt), tokens and states those of each layer alone."""
    _CountingLastRecent.layer_batches = []
    together = _run_with(model, _CountingLastRecent, True)
    assert _CountingLastRecent.layer_batches == [N_LAYER] * 20
    _CountingLastRecent.layer_batches = []
    alone = _run_with(model, _CountingLastRecent, False)
    assert _CountingLastRecent.layer_batches == []
    for a, b in zip(together[0], alone[0], strict=True):
        assert torch.equal(a, b)
    _assert_same(together[1], alone[1])


@torch.inference_mode()
def test_subclass_with_its_own_select_drop_is_evicted_layer_by_layer(model: GPT) -> None:
    _OwnSelectDrop.layer_batches, _OwnSelectDrop.alone = [], 0
    together = _run_with(model, _OwnSelectDrop, True)
    assert _OwnSelectDrop.layer_batches == [] and _OwnSelectDrop.alone == 20 * N_LAYER
    reference = _run_with(model, LastRecentKVCache, False)
    for a, b in zip(together[0], reference[0], strict=True):
        assert torch.equal(a, b)
    _assert_same(together[1], reference[1])


# -- an exception in the middle of a model call --------------------------------------------------


class _Stop(Exception):
    pass


class _FailAfterAttention(SlotMachine):
    """A layer cache whose attention raises once, after `attend_inputs` (the call is open and never evicted)."""

    fail_next = False

    def attend_inputs(self, keys, values, input_pos, queries=None):  # noqa: ANN001, ANN201
        out = super().attend_inputs(keys, values, input_pos, queries)
        if type(self).fail_next:
            type(self).fail_next = False
            raise _Stop
        return out


def _interrupted_run(model: GPT, together: bool, where: str) -> tuple[list[torch.Tensor], list, list, list]:
    """Prompt, 3 decode steps, a 4th interrupted at layer 2 (`where`: by a block hook before its
    attention, or by the layer right after it attended), then 6 more steps. Returns the logits of the
    steps after it, the states before and after the interrupted step, and the final states."""
    idx, pos = _inputs()
    cfg = KVCacheConfig("h2o", cache_length=10)
    shape = model.build_kv_caches(cfg, 2)[0].shape
    model.set_kv_caches([_FailAfterAttention(H2OKVCache, cfg, shape, None, torch.float32) for _ in range(N_LAYER)])
    try:
        model.caches.evict_layers_together = together
        model(idx[:, :10], pos[:, :10])
        for i in range(10, 13):
            model(idx[:, i : i + 1], pos[:, i : i + 1])
        before = _states(model)

        def hook(layer: int, x: torch.Tensor) -> None:
            if layer == 2 and where == "hook":
                raise _Stop
            if layer == 2 and where == "attention":
                _FailAfterAttention.fail_next = True  # layer 2 raises right after its attention

        with pytest.raises(_Stop):
            model(idx[:, 13:14], pos[:, 13:14], block_hook=hook)
        after = _states(model)  # a read settles what waits
        logits = [model(idx[:, i : i + 1], pos[:, i : i + 1]) for i in range(14, 20)]
        return logits, before, after, _states(model)
    finally:
        _FailAfterAttention.fail_next = False
        model.set_kv_caches(None)


@pytest.mark.parametrize("where", ["hook", "attention"])
@torch.inference_mode()
def test_exception_mid_call_leaves_caches_consistent(model: GPT, where: str) -> None:
    """The layers before the failure have taken the token (their waiting evictions are settled, as each
    layer alone would have evicted), the failing layer and those after it are as before the call, and the
    next calls run: bitwise the run that evicts each layer in its own call."""
    together = _interrupted_run(model, True, where)
    alone = _interrupted_run(model, False, where)
    logits, before, after, final = together
    for layer in range(N_LAYER):
        unchanged = all(torch.equal(before[layer][k], after[layer][k]) for k in before[layer])
        assert unchanged == (layer >= 2), f"layer {layer}: changed={not unchanged}"
    _assert_same(after, alone[2])
    for a, b in zip(logits, alone[0], strict=True):
        assert torch.equal(a, b)
    _assert_same(final, alone[3])


# -- per-slot state declared as data ---------------------------------------------------------------


class _DeclaredState(LastRecentKVCache):
    """last-recent with declared state and no constructor: an int64 per-slot age (-1 when empty), a
    float one, and a per-row counter."""

    slot_state = {"age": SlotState(fill=-1, dtype=torch.int64), "mass": SlotState()}
    row_state = ("calls",)


def test_declared_slot_state_is_allocated_by_the_base() -> None:
    cfg = KVCacheConfig("last-recent", cache_length=6)
    cache = SlotMachine(_DeclaredState, cfg, CacheShape(3, 2, 6, 8, 8), None, torch.float32)
    assert cache.policy.age.dtype == torch.int64 and tuple(cache.policy.age.shape) == (3, 2, 6)
    assert bool((cache.policy.age == -1).all())
    assert cache.policy.mass.dtype == torch.float32 and not bool(cache.policy.mass.any())
    assert cache.policy.calls is None
    assert {"slot.age", "slot.mass"} <= set(cache.state_tensors()) and "row.calls" not in cache.state_tensors()


@torch.inference_mode()
def test_declared_slot_state_travels_in_snapshots(model: GPT) -> None:
    cfg = KVCacheConfig("last-recent", cache_length=6)
    shape = model.build_kv_caches(cfg, 1)[0].shape
    model.set_kv_caches([SlotMachine(_DeclaredState, cfg, shape, None, torch.float32) for _ in range(N_LAYER)])
    try:
        for cache in model.kv_caches:
            cache.policy.age.fill_(7)
        state = snapshot(model)
    finally:
        model.set_kv_caches(None)
    assert all(bool((layer.tensors["slot.age"] == 7).all()) for layer in state.layers)


def test_slot_state_declared_as_names_is_refused() -> None:
    with pytest.raises(TypeError, match=r"_Names\.slot_state must map attribute names to SlotState"):

        class _Names(H2OKVCache):
            slot_state = ("attn_sums", "query_counts")  # type: ignore[assignment]
