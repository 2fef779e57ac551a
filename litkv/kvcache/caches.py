"""`KVCaches`: the KV caches of one model run, as one object (like Hugging Face's `Cache`).

It owns the layer caches (one per attention layer), the last position each row has seen, the undo
log recording the calls (if one is kept) and the compile mode; whole-model operations are loops over
the layers. It also owns a decode step's eviction: `begin_call` says whether the call's evictions wait,
and `evict_waiting`, after the model's block loop, evicts every layer at once (the policy class's
`select_drop_layers`). A conversation or a request is one such object; its value (a copy that can be saved,
forked, merged) is a `litkv.CacheState` (`litkv.snapshot` / `litkv.restore`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch._dynamo

from litkv.kvcache.base import KVCache, LayerCache
from litkv.kvcache.candidates import staged_placement
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.one_shot import compress_all
from litkv.kvcache.recurrent import RecurrentCache

__all__ = ["KVCaches", "CallRecorder"]


class CallRecorder(Protocol):
    """What records the calls through a `KVCaches` (the undo log, `litkv.states.undo.UndoLog`)."""

    def attach(self, caches: KVCaches) -> None: ...

    def before_call(self, caches: KVCaches) -> None:
        """A call is about to start (the recurrent layers' states are still those before it)."""


class KVCaches:
    """One cache per layer, plus the run's per-row state.

    Attributes:
        layers: the layer caches (`SlotMachine`, or the gradient engine's replay caches).
        last_pos: `(B,)` int64 largest position each row has seen (`-1`: none yet), `None` before the
            first call.
        undo_log: the recorder of the calls, when one is kept (`litkv.keep_undo_log`).
        evict_layers_together: a decode step's layers are evicted together after the block loop
            (`evict_waiting`); `False`: each layer in its own call (the same tokens and states, slower).
    """

    def __init__(self, layers: Sequence[LayerCache | RecurrentCache]) -> None:
        if not layers:
            raise ValueError("KVCaches needs at least one layer cache")
        self.layers: list[LayerCache | RecurrentCache] = list(layers)
        self.last_pos: torch.Tensor | None = None
        self.undo_log: CallRecorder | None = None
        self.evict_layers_together = True

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerCache | RecurrentCache]:
        return iter(self.layers)

    def __getitem__(self, layer: int) -> LayerCache | RecurrentCache:
        return self.layers[layer]

    @property
    def batch_size(self) -> int:
        first = self.layers[0]
        return first.batch_size if isinstance(first, RecurrentCache) else first.positions.shape[0]

    @property
    def recurrent_caches(self) -> list[RecurrentCache]:
        """The recurrent layers' states (Mamba-2 layers of a hybrid model; none in an attention-only one)."""
        return [cache for cache in self.layers if isinstance(cache, RecurrentCache)]

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the attention layers: the layers a cache policy covers (all, in an attention-only model)."""
        return [i for i, cache in enumerate(self.layers) if not isinstance(cache, RecurrentCache)]

    @property
    def recurrent_layers(self) -> list[int]:
        """Indices of the recurrent (Mamba-2) layers: constant-size state, no policy."""
        return [i for i, cache in enumerate(self.layers) if isinstance(cache, RecurrentCache)]

    def coverage(self) -> str:
        """One line saying which layers the cache policies cover, e.g. `policy h2o on attention layers [2]
        of 3; recurrent layers [0, 1] hold a constant-size state (no policy)`."""
        policies = sorted({cache.config.policy for cache in self.policy_caches})
        named = f"policy {', '.join(policies)}" if policies else "attention caches"
        attention, recurrent = self.attention_layers, self.recurrent_layers
        if not recurrent:
            return f"{named} on all {len(self)} layers"
        held = f"recurrent layers {recurrent} hold a constant-size state (no policy)"
        return f"{named} on attention layers {attention} of {len(self)}; {held}"

    @property
    def policy_caches(self) -> list[SlotMachine]:
        """The layers that are policy caches (all of them, except during the gradient engine's replay)."""
        return [cache for cache in self.layers if isinstance(cache, SlotMachine)]

    # -- compile mode ---------------------------------------------------------------------------

    @property
    def static_shapes(self) -> bool:
        """Every call attends all slots and leaves the host counters to `advance` (compiled decode)."""
        return any(cache.static_shapes for cache in self.policy_caches)

    @static_shapes.setter
    def static_shapes(self, value: bool) -> None:
        """Turning it on also fixes, per layer, whether its slots all hold a token for the steps to come
        (`SlotMachine.static_slots_valid`, read before: a decode step then attends without a mask)."""
        for cache in self.policy_caches:
            if not value:
                cache.static_slots_valid = False
            elif not cache.static_shapes:
                cache.static_slots_valid = cache.slots_known_valid()
            cache.static_shapes = value
        for recurrent in self.recurrent_caches:
            recurrent.in_place = value

    def advance(self, num_new: int) -> None:
        """Count `num_new` tokens per row in every layer's host counter (after a compiled step)."""
        for cache in self.policy_caches:
            cache.advance(num_new)

    def mark_static_addresses(self) -> None:
        """Tell `torch.compile` that the caches' tensors keep their addresses from step to step (every tensor
        attribute of each layer cache and its storage, the recurrent states, and `last_pos`): a CUDA graph then
        reads and writes them where they are instead of copying them in before each replay, and allows the
        in-place writes. No guard on the address: other caches (another `generate` call) re-record the graph,
        they do not recompile the step. Compiled steps keep the addresses (`static_shapes`: state updated in
        place)."""
        tensors: list[torch.Tensor] = [] if self.last_pos is None else [self.last_pos]
        tensors += [t for recurrent in self.recurrent_caches for t in (recurrent.conv, recurrent.ssm)]
        for cache in self.policy_caches:
            for holder in (cache, cache.storage, cache.policy):
                for value in vars(holder).values():
                    parts = value if isinstance(value, tuple) else (value,)
                    tensors.extend(t for t in parts if isinstance(t, torch.Tensor))
        for t in tensors:
            torch._dynamo.mark_static_address(t, guard=False)

    def end_prefill(self) -> None:
        """The prompt is in: every layer's `end_prefill` (one-shot policies compress to their budget; those
        that rank across layers, together: `compress_all`)."""
        caches = self.policy_caches
        compress_all(caches)
        for cache in caches:
            if cache.one_shot is None:
                cache.end_prefill()

    # -- a model call's evictions --------------------------------------------------------------

    def begin_call(self, num_new: int) -> bool:
        """Start a model call of `num_new` tokens per row. Returns whether its layers' evictions wait for
        `evict_waiting` (the model then calls `SlotMachine.wait_for_eviction`, not `evict_and_store`).

        What an interrupted call left (an exception between a layer's attention and `evict_waiting`) is
        settled first: a layer whose eviction waits is evicted alone (as `evict_waiting` would have), an
        attended-to but never evicted call is forgotten (`abort_call`), so the caches take the next call.

        The conditions under which a call's evictions wait, in one place: a decode step (one token), not
        compiled (`static_shapes`: inductor fuses the per-layer work anyway), not recorded by an undo log
        (it records each layer's writes as they happen), not under autograd (such a call attends a
        concatenation, no staged token), every attention layer a policy cache, and `evict_layers_together`.
        """
        policy_caches = self.policy_caches
        for cache in policy_caches:
            cache.settle()
            cache.abort_call()
        if self.undo_log is not None:
            self.undo_log.before_call(self)
        return (
            num_new == 1
            and self.evict_layers_together
            and not any(cache.static_shapes for cache in policy_caches)
            and self.undo_log is None
            and not torch.is_grad_enabled()
            and len(policy_caches) + len(self.recurrent_caches) == len(self.layers)
        )

    def evict_waiting(self) -> None:
        """The end of a model call whose evictions wait (`begin_call`): every layer's eviction.

        Staged decode steps of layers of one class that opted in (`select_drop_layers`, with the
        `select_drop` it stands for) and share their settings and shapes are evicted together: the class
        chooses the drops of all of them over their stacked candidates, one placement is built, each layer
        writes its part (`store_staged`). Every other waiting layer is evicted alone (`settle`). Tokens and
        states are bitwise those of evicting each layer in its own call (tests/kvcache/test_policy_conformance.py).
        """
        self._prepare_direct()
        together: list[SlotMachine] = []
        for cache in self.policy_caches:
            call = cache.waiting_call
            if call is None:
                continue
            if call.path != "staged" or not _selects_layers_together(type(cache.policy)):
                cache.settle()
                continue
            together.append(cache)
        for group in _alike_groups(together):
            if len(group) == 1:
                group[0].settle()
                continue
            first = group[0]
            calls = [cache.take_waiting() for cache in group]
            policies = [cache.policy for cache in group]
            drops = type(first.policy).select_drop_layers(policies, calls)  # type: ignore[attr-defined]  # (n, B, G, 1)
            placement = staged_placement(drops, first.cache_length, first.keeps_state)
            for i, (cache, cand) in enumerate(zip(group, calls, strict=True)):
                cache.store_staged(placement.layer(i), cand)

    def _prepare_direct(self) -> None:
        """The waiting decode steps that go into empty slots (a cache still filling, or compressed one-shot):
        the policy class's `prepare_layers` over each group of alike layers, before each layer writes its own."""
        direct = [
            cache
            for cache in self.policy_caches
            if cache.keeps_state and (call := cache.waiting_call) is not None and call.path == "direct"
        ]
        for group in _alike_groups(direct):
            records = [cache.waiting_call.candidates for cache in group]  # type: ignore[union-attr]
            type(group[0].policy).prepare_layers([cache.policy for cache in group], records)

    # -- positions ------------------------------------------------------------------------------

    def observe(self, input_pos: torch.Tensor, check: bool) -> None:
        """Take note of a call's positions `(B, T)` (`-1` at pads): `last_pos` moves to each row's largest.

        Args:
            input_pos: the call's positions.
            check: raise ValueError naming row, index and values unless the row's positions increase
                across calls, or when a layer's cache has no room for the call (before anything changes;
                host reads, skipped for trusted decode steps).
        """
        if check:
            self._check_increasing(input_pos)
            if self.recurrent_caches:  # a recurrent layer before the refusing one would have moved on
                self._check_call_length(input_pos.shape[1])
            for cache in self.policy_caches:  # a call a cache refuses changes nothing, last_pos included
                if not cache.static_shapes and input_pos.shape[1] <= cache.cache_length:  # else: a longer error
                    cache.check_room(input_pos)
        last = input_pos.amax(dim=1)
        if self.last_pos is None:
            self.last_pos = last
        elif self.static_shapes:  # in place: a compiled step's tensors keep their addresses (CUDA graphs)
            self.last_pos.copy_(torch.maximum(self.last_pos, last))
        else:
            self.last_pos = torch.maximum(self.last_pos, last)

    def _check_call_length(self, num_new: int) -> None:
        for i, cache in enumerate(self.layers):
            if isinstance(cache, SlotMachine) and not cache.static_shapes and num_new > cache.cache_length:
                raise ValueError(
                    f"chunk of {num_new} tokens is longer than allowed: at most cache_length={cache.cache_length} "
                    f"new tokens per call (layer {i})"
                )

    def _check_increasing(self, input_pos: torch.Tensor) -> None:
        running = torch.cummax(input_pos, dim=1).values
        before = torch.full_like(input_pos[:, :1], -1) if self.last_pos is None else self.last_pos[:, None]
        previous = torch.cat((before, running[:, :-1]), dim=1).clamp(min=before)
        bad = (input_pos >= 0) & (input_pos <= previous)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"positions must increase: row {row} has position {int(input_pos[row, col])} at index {col} "
                f"after position {int(previous[row, col])}"
            )

    # -- rows -----------------------------------------------------------------------------------

    @torch.no_grad()
    def copy_row(self, row: int, source: KVCaches, source_row: int = 0) -> None:
        """Write row `source_row` of `source` (caches of the same configs and slots) into row `row`:
        every layer's state tensors (in place; a recurrent layer's rebound to a written copy, as its calls
        rebind them, so that references the undo log keeps stay as they were) and `last_pos`; the other rows
        are not touched or copied. Host counters (`num_filled`) are shared by the rows and left as they are."""
        if len(source) != len(self):
            raise ValueError(f"copy_row: the source has {len(source)} layers, these caches {len(self)}")
        for dst_r, src_r in zip(self.recurrent_caches, source.recurrent_caches, strict=True):
            given = src_r.state_tensors()
            fresh = {name: t.clone() for name, t in dst_r.state_tensors().items()}
            for name, t in fresh.items():
                t[row].copy_(given[name][source_row])
            dst_r.update(fresh["conv"], fresh["ssm"])
        for i, (dst, src) in enumerate(zip(self.policy_caches, source.policy_caches, strict=True)):
            zero_is_unset = dst.policy.row_state_zero_is_unset
            if zero_is_unset:
                _zero_unset_row_state(dst, src)
            live, given = dst.state_tensors(), src.state_tensors()
            unset = set(live) - set(given) if zero_is_unset else set()
            if set(live) - unset != set(given):
                raise ValueError(f"copy_row: layer {i} holds {sorted(live)}, the source {sorted(given)}")
            for name, t in live.items():
                if name in unset:
                    t[row].zero_()
                else:
                    t[row].copy_(given[name][source_row])
        if source.last_pos is not None or self.last_pos is not None:
            if self.last_pos is None:
                device = next(iter(self[0].state_tensors().values())).device
                self.last_pos = torch.full((self.batch_size,), -1, dtype=torch.long, device=device)
            self.last_pos[row] = -1 if source.last_pos is None else source.last_pos[source_row]

    # -- sizes ----------------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes held by all layers: keys and values (quantised: codes, scales and offsets) and recurrent states."""
        return sum(cache.nbytes() for cache in self.layers)


def _zero_unset_row_state(dst: SlotMachine, src: SlotMachine) -> None:
    """Give `dst` all-zero row state `(B, ...)` where `src` has row state and `dst` none yet (a policy whose
    zero row state means unset: `Policy.row_state_zero_is_unset`)."""
    batch = dst.positions.shape[0]
    for name in dst.policy.row_state:
        have, given = getattr(dst.policy, name), getattr(src.policy, name)
        if have is not None or given is None:
            continue
        parts = given if isinstance(given, tuple) else (given,)
        zeros = tuple(t.new_zeros((batch, *t.shape[1:])) for t in parts)
        dst.set_state(name, zeros if isinstance(given, tuple) else zeros[0])


@functools.cache
def _selects_layers_together(cls: type[KVCache]) -> bool:
    """Whether `cls` opted in to the batched decode step: a class of its MRO defines `select_drop_layers`
    and `cls` keeps that class's `select_drop` (a subclass with its own `select_drop` is evicted alone)."""
    owner = next((k for k in cls.__mro__ if "select_drop_layers" in vars(k)), None)
    return owner is not None and cls.select_drop is owner.select_drop  # type: ignore[attr-defined]


def _alike_groups(caches: Sequence[SlotMachine]) -> list[list[SlotMachine]]:
    """`caches` in groups of `_alike` layers, each group and each layer in it in the order given."""
    groups: list[list[SlotMachine]] = []
    for cache in caches:
        group = next((g for g in groups if _alike(g[0], cache)), None)
        if group is None:
            groups.append([cache])
        else:
            group.append(cache)
    return groups


def _alike(a: SlotMachine, b: SlotMachine) -> bool:
    """Whether two layers' decode steps may be chosen in one stacked selection: one policy class, one
    configuration (so the same options, sinks and recent window), one shape, dtype and device."""
    return (
        type(a.policy) is type(b.policy)
        and (a.config is b.config or a.config == b.config)
        and (a.shape is b.shape or a.shape == b.shape)
        and a.dtype == b.dtype
        and a.positions.device == b.positions.device
    )
