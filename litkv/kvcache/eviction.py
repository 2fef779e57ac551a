"""A call's eviction, the second half of a layer cache's call (`SlotMachine.attend_inputs`, then this): the
policy's drops checked, paired with the surviving new tokens (`Placement`) and written: positions, the undo
journal, the policy's declared state (what `update_state` returns), the storage.

One function per path a call took (`OpenCall.path`): `direct` (the tokens went into empty slots while
attending: only the policy's state is left), `staged` (a decode step whose token waits in the room after
the slots), `concat` (a longer call). `evict(cache, call)` picks it; `store_staged` is also what
`KVCaches.evict_waiting` calls with a batched choice. What these functions read of the cache is `Slots`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from litkv.kvcache.call_checks import check_drops
from litkv.kvcache.candidates import Candidates, OpenCall, Placement, pair_drops, placement_of, staged_placement
from litkv.kvcache.policy import Policy
from litkv.kvcache.state_tensors import set_named
from litkv.kvcache.storage import KVStorage

__all__ = ["Journal", "Slots", "evict", "store_staged", "write_state"]

#: The undo log's recorder: called once per call before the cache changes, with the `(B, G, T)` slots it overwrites.
Journal = Callable[[Any, torch.Tensor], None]


class Slots(Protocol):
    """What the eviction reads and writes of a layer cache (`SlotMachine`)."""

    cache_length: int
    positions: torch.Tensor  # (B, G, L), a view of `pos_buffer`
    pos_buffer: torch.Tensor  # (B, G, L + ROOM): the slots' positions, then the room's
    storage: KVStorage
    static_shapes: bool
    keeps_state: bool  # the policy overrides `update_state`
    empties: bool  # `Policy.empties_slots`

    @property
    def policy(self) -> Policy: ...

    @property
    def name(self) -> str: ...

    @property
    def journal(self) -> Journal | None: ...

    def advance(self, num_new: int) -> None: ...

    def forget_valid_slots(self) -> None: ...


def evict(cache: Slots, call: OpenCall) -> None:
    """Evict and write a call whose queries have attended (`attn_weights` set on its record)."""
    cand = call.candidates
    if call.path == "direct":
        _after_direct(cache, call.start, cand)
    elif call.path == "staged":
        drop = cache.policy.select_drop(cand)
        _check_drop(cache, drop, 1)
        store_staged(cache, staged_placement(drop, cache.cache_length, cache.keeps_state), cand)
    else:
        _evict_concat(cache, cand)


def _evict_concat(cache: Slots, cand: Candidates) -> None:
    """Evict for a longer call: `T` candidates lose their slot, the surviving new tokens take them."""
    length, t = cache.cache_length, cand.num_new
    drop = cache.policy.select_drop(cand)
    _check_drop(cache, drop, t)
    dest, src, valid = pair_drops(drop, length)
    if cache.journal is not None:
        cache.journal(cache, dest)
    new_pos = cand.positions[..., length:].gather(2, src)
    cache.positions.scatter_(2, dest, torch.where(valid, new_pos, cache.positions.gather(2, dest)))
    if not cache.static_shapes:
        cache.advance(t)
    if cache.keeps_state:
        write_state(cache, placement_of(dest, src, valid, length), cand)
    cache.storage.write(dest, _gather_tokens(cand.new_keys, src), _gather_tokens(cand.new_values, src), valid)


def store_staged(cache: Slots, placement: Placement, cand: Candidates) -> None:
    """Write a staged call's choice (`staged_placement`): its token moves into the dropped slot, or stays in
    the room (overwritten by the next call) when it is the one dropped; positions, the policy's state, the
    storage."""
    length = cache.cache_length
    if cache.journal is not None:
        cache.journal(cache, placement.dest)
    target = torch.where(placement.valid, placement.dest, length)  # a dropped token stays in the room
    cache.pos_buffer.scatter_(2, target, cand.positions[..., length:])
    if not cache.static_shapes:
        cache.advance(1)
    if cache.keeps_state:  # before the storage write: `cand.keys` are views of the slots
        write_state(cache, placement, cand)
    cache.storage.commit_staged(target)


def _after_direct(cache: Slots, start: int, cand: Candidates) -> None:
    """`update_state` for a call whose tokens went into the empty slots `[start, start + T)`."""
    if not cache.keeps_state:
        return
    length, t = cache.cache_length, cand.num_new
    weights = cand.attn_weights
    if weights is not None:  # (B, G, start + T): cached tokens, then the new ones
        slot_part = F.pad(weights[..., :start], (0, length - start))
        cand.attn_weights = torch.cat((slot_part, weights[..., start:]), dim=2)
    slots = torch.arange(start, start + t, device=cache.positions.device)
    slots = slots.expand(*cache.positions.shape[:2], t)
    placement = Placement(slots, slots - start, torch.ones_like(slots, dtype=torch.bool), slots.new_empty(0), start)
    write_state(cache, placement, cand)


def write_state(cache: Slots, placement: Placement, cand: Candidates) -> None:
    """Run the policy's `update_state` and write what it returns (declared names only)."""
    policy = cache.policy
    object.__setattr__(policy, "_updating", True)  # declared state assigned in the hook is refused
    try:
        update = policy.update_state(placement, cand)
    finally:
        object.__setattr__(policy, "_updating", False)
    if cache.empties:  # `update_state` may have emptied slots
        cache.forget_valid_slots()
    if not update:
        return
    for name, value in update.items():
        if name not in policy._state_names:
            raise ValueError(
                f"{cache.name}.update_state returned {name!r}, which is not declared in its "
                f"slot_state {sorted(policy.slot_state)} or row_state {list(policy.row_state)}"
            )
        set_named(cache, name, value)


def _check_drop(cache: Slots, drop: object, t: int) -> None:
    """Raise naming the policy if `drop` is not `(B, G, T)` int64 distinct indices in `[0, L + T)` (the values
    are read only for a policy whose drops are not valid by construction)."""
    expected = (*cache.positions.shape[:2], t)
    check_drops(cache.name, drop, expected, cache.cache_length, not cache.policy.drops_valid_by_construction())


def _gather_tokens(tokens: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`tokens` `(B, G, T, D)` gathered along T by `src` `(B, G, T')` -> `(B, G, T', D)`."""
    index = src[..., None].expand(*src.shape, tokens.shape[-1])
    return tokens.gather(2, index)
