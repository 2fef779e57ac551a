"""`SlotMachine`: the layer cache that runs a policy. One object per attention layer, `cache_length` slots
per (row, KV head); it composes the policy (`litkv.kvcache.base.KVCache`, the author's side) and knows no
policy by name.

A call brings `T` new tokens per row. Attention runs in two steps around the cache:

1. `attend_inputs(keys, values, input_pos, queries, hidden)` returns what the new queries attend to: every
   cached token plus the new tokens themselves, with the token position of each (`-1`: empty slot
   or pad).
2. `evict_and_store(attn_weights)` runs after attention: the policy decides which of the
   `cache_length + T` candidates keep the `cache_length` slots (attend, then evict), and the
   surviving new tokens are written into the freed slots.

The machine does the bookkeeping: checks, the fast path while the cache fills, pairing freed slots with
surviving new tokens (`Placement`) and writing them into the storage it is composed with (the second step's
code is `litkv.kvcache.eviction`), the undo journal, static shapes for compiled steps, the state as named
tensors. Besides the policy it composes, in one-shot mode, the compression its class names
(`cache.one_shot`, `litkv.kvcache.one_shot.OneShot`). It asks the policy `select_drop`, hands it
the placement (`update_state`) and writes the state it returns. What a policy sees of a call is one record,
`Candidates`; the inputs that cost something (attention-weight sums, the call's queries) are filled only
when the policy asks for them (`needs`), so that other policies keep the fast attention path.
"""

from __future__ import annotations

import torch

from litkv.core.validation import require_int
from litkv.kvcache.call_checks import check_call_inputs, check_full, row_overflow
from litkv.kvcache.candidates import Candidates, OpenCall, PackedCandidates, Placement
from litkv.kvcache.eviction import Journal, evict, store_staged
from litkv.kvcache.layer_cache import CacheSettings
from litkv.kvcache.policy import NEEDS, Compression, Policy
from litkv.kvcache.state_tensors import load_named, named_tensors, set_named
from litkv.kvcache.storage import ROOM, CacheShape, KVStorage, PackedSlots, needs_functional
from litkv.kvcache.storage_kinds import make_storage

__all__ = ["Journal", "SlotMachine"]


class SlotMachine:
    """The layer cache: storage, positions, the fast paths, the journal, static shapes, snapshots and checks,
    around one policy (`policy`, an instance of a `KVCache` subclass built for this cache).

    Attributes:
        policy: the policy this cache runs (its declared state lives there, by name).
        one_shot: the one-shot compression (`policy.compression`) when the options ask for one
            (`options.one_shot_budget`), else `None`.
        positions: `(B, G, L)` int64, token position held by each slot, `-1` when empty.
        num_filled: Host counter of tokens taken so far, capped at `L`. While the storage is lossless and
            no eviction has happened, or the policy fills the lowest-numbered empty slots
            (`Policy.fills_in_order`), slots `[num_filled, L)` are empty (the direct path relies on it).
        needs_attn_weights, needs_queries, needs_rope, needs_gates, needs_hidden: what the policy uses
            (`Policy.inputs`), read by attention and the model.
    """

    def __init__(
        self,
        policy: type[Policy],
        config: CacheSettings,
        shape: CacheShape,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> None:
        if shape.cache_length != config.cache_length:
            raise ValueError(f"shape.cache_length={shape.cache_length} != config.cache_length={config.cache_length}")
        if not (isinstance(policy, type) and issubclass(policy, Policy)):
            raise TypeError(f"SlotMachine expects a policy class (a KVCache subclass), got {policy!r}")
        config = policy.adjust(config)
        self.config = config
        self.shape = shape
        self.cache_length = config.cache_length
        self.dtype = dtype
        self.storage: KVStorage = make_storage(config.storage, shape, device, dtype, config.quant_group_size)
        self.pos_buffer = torch.full(
            (shape.batch_size, shape.n_query_groups, shape.cache_length + ROOM), -1, dtype=torch.long, device=device
        )
        self.positions = self.pos_buffer[:, :, : shape.cache_length]
        # Every call attends all `L` slots and leaves `num_filled` to `advance()` (for compiled steps).
        self.static_shapes = False
        self.num_filled = 0
        self._call: OpenCall | None = None  # the call between attend_inputs and the end of its eviction
        # Host-known: every slot holds a token (`None`: not known; `slots_known_valid` reads it once)
        self._slots_valid: bool | None = None
        # The same, fixed for a run of compiled steps when `KVCaches.static_shapes` turns on (one graph)
        self.static_slots_valid = False
        # The keys the last `attend_inputs` returned all hold a token, known on the host (attention needs no mask)
        self.attended_keys_valid = False
        # Host-known: slots `[0, n)` hold the tokens of direct calls without pads (`direct_prefix_valid`); `None`:
        # not known (a call that may hold a pad, another path, or slots written from outside)
        self._valid_prefix: int | None = 0
        # After a one-shot compression (`compact_slots`): per (row, KV head) the first filled slot, every slot from
        # there on holding a token, on the host and as a `(B, G)` tensor (`direct_head_starts`); `None` when not known
        self.head_starts: tuple[list[list[int]], torch.Tensor] | None = None
        self._journal: Journal | None = None
        self.one_shot = self._compose_one_shot(policy)
        self.policy: Policy = policy(self)  # binds itself to this cache, allocates its declared state
        inputs = self.policy.inputs()
        for name in NEEDS:  # what attention and the model read, per instance
            setattr(self, f"needs_{name}", name in inputs)
        self.heads_share_positions = policy.heads_share_positions
        # whether the policy overrides `update_state` (else no `Placement` is built: nothing would read it)
        self.keeps_state = type(self.policy).update_state is not Policy.update_state
        self.empties = self.policy.empties_slots()

    def _compose_one_shot(self, policy: type[Policy]) -> Compression | None:
        """The one-shot compression of `policy.compression` when the options name a budget, else `None`."""
        budget = self.config.policy_options.one_shot_budget(self.cache_length)
        if budget is None:
            return None
        if policy.compression is None:
            raise TypeError(f"{policy.__name__} has no one-shot compression (compression=None)")
        return policy.compression(self, budget)

    @property
    def name(self) -> str:
        """The policy's class name, for messages."""
        return type(self.policy).__name__

    @property
    def journal(self) -> Journal | None:
        """Called once per call before the cache changes, with the `(B, G, T)` slots the call will overwrite
        (an undo log records what they held); `None`: nothing is recorded. For a policy that empties slots
        it does not overwrite (`Policy.empties_slots`) every slot of a call is recorded."""
        return self._journal

    @journal.setter
    def journal(self, value: Journal | None) -> None:
        wrap = value is not None and self.empties and not isinstance(value, _AllSlots)
        self._journal = _AllSlots(value) if wrap else value

    def end_prefill(self) -> None:
        """A prompt has been prefilled, before its first decode step: the one-shot compression (if any), then
        the policy's `end_prefill`."""
        if self.one_shot is not None:
            self.one_shot.end_prefill()
        self.policy.end_prefill()

    def check_idle(self, what: str) -> None:
        """RuntimeError naming `what` when a call is between `attend_inputs` and its eviction (a waiting
        eviction is settled first)."""
        self.settle()
        if self._call is not None:
            raise RuntimeError(f"{what} called between attend_inputs() and evict_and_store()")

    def set_state(self, name: str, value: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """Set the policy's declared state `name` (a `slot_state` tensor or a `row_state` tensor or tuple) to
        `value`. With `static_shapes` (compiled decode steps) the tensors there are overwritten in place, so
        they keep their addresses from step to step (a CUDA graph replays on fixed addresses); otherwise the
        attribute is rebound (a snapshot may hold the old tensors)."""
        set_named(self, name, value)

    def check_room(self, input_pos: torch.Tensor) -> None:
        """Raise before attention if the call's tokens (`input_pos` `(B, T)`, `-1` at pads) cannot be taken (a
        call the policy only reads, `Policy.reads_only`, takes no slot)."""
        if self.policy.reads_only():
            return
        limit = self.policy.max_tokens(self.config)
        if limit is not None:
            check_full(self.name, self.cache_length, self.overflow(input_pos, limit))
        if self.one_shot is not None:
            self.one_shot.check_room(input_pos)
        self.policy.check_room(input_pos)

    def overflow(self, input_pos: torch.Tensor, limit: int) -> tuple[int, int, int] | None:
        """`(row, tokens held, tokens needed)` of a row whose own tokens would exceed `limit` with this call.

        Pads never take a slot, so a ragged batch fits where each row fits (`call_checks.row_overflow`).
        """
        return row_overflow(self.positions, self.num_filled, input_pos, limit)

    def slots_known_valid(self) -> bool:
        """Whether every slot holds a token (position `>= 0`), known on the host without reading the device on
        a decode step: read once (one device read) when a full cache does not know it, then kept over the
        evictions of a policy whose own `select_drop` drops pads and empty slots first (every call then keeps a
        token in every slot); forgotten when slots are written otherwise (tokens written into empty slots,
        `load_state_tensors`, `state_tensors`, whose live tensors the caller may write). With `static_shapes`
        (compiled steps) the answer is the one `KVCaches.static_shapes` fixed when the steps began
        (`static_slots_valid`), so that a run of steps keeps one graph; always `False` for a policy whose drops
        are not its own, or that empties slots (`Policy.empties_slots`)."""
        if self.static_shapes:
            return self.static_slots_valid
        if self.num_filled < self.cache_length or self.empties or not self.policy.drops_valid_by_construction():
            return False
        if self._slots_valid is None:
            self._slots_valid = bool((self.positions >= 0).all())
        return self._slots_valid

    def forget_valid_slots(self) -> None:
        """Slots were emptied outside the eviction (`slots_known_valid` reads them again when asked; compiled
        steps keep the mask from then on; the compression's `head_starts` are dropped)."""
        self._slots_valid = None
        self.static_slots_valid = False
        self.head_starts = None
        self._valid_prefix = None

    def direct_head_starts(self, no_pads: bool) -> tuple[list[list[int]], torch.Tensor] | None:
        """For the call just attended: per (row, KV head) the first of the attended slots, every one from there to
        the last holding a token earlier than the call's (`head_starts`, as a host list `B x G` and a `(B, G)` int64
        tensor), or `None`. Known only for a direct call (new tokens appended after every head's slots) after a
        one-shot compression, while no call held a pad; a call that may hold one (`no_pads` false) ends it (its
        pad's slot would sit inside the range), so attention asks after every call."""
        if self._call is None or self._call.path != "direct" or not no_pads:
            self.head_starts = None
        return self.head_starts

    def direct_prefix_valid(self, no_pads: bool) -> bool:
        """For the call just attended: whether every attended slot holds a token, known on the host without reading
        the device. True for a direct call without pads (`no_pads`) when every call since the cache was empty was
        one too: slots `[0, num_filled)` then hold their tokens in order. A call that may hold a pad, one of another
        path, or slots written from outside (`forget_valid_slots`) end it until the cache is empty again, so
        attention asks after every call (asking again for the same call gives the same answer)."""
        call = self._call
        direct = call is not None and call.path == "direct"
        if direct and no_pads and self._valid_prefix in (call.start, self.num_filled):
            self._valid_prefix = self.num_filled
            return True
        self._valid_prefix = None
        return False

    # -- contract -------------------------------------------------------------------------------

    def attend_inputs(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        input_pos: torch.Tensor,
        queries: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | PackedSlots, torch.Tensor | PackedSlots, torch.Tensor]:
        """What the new queries attend to: cached tokens plus the new ones.

        Three named paths, by what the call allows, invisible to policies: `_attend_direct` while a
        cache has empty slots for the whole call and `_goes_direct` (the new tokens go straight into them,
        nothing to choose); `_attend_staged` for a call of at most `ROOM` tokens (a decode step: staged
        in the room after the slots and attended from there, so the step copies nothing of the cache);
        `_attend_concat` for a longer call (a prefill chunk, or any call while autograd records). With
        `static_shapes` every call takes one of the last two paths and attends all `L` slots (empty
        ones masked), so shapes do not change from step to step.

        Args:
            keys: `(B, G, T, key_size)` new keys (after RoPE).
            values: `(B, G, T, value_size)` new values.
            input_pos: `(B, T)` int64 token positions, `-1` for padding.
            queries: `(B, n_head, T, key_size)` the call's queries (after RoPE); kept only when the policy
                sets `needs_queries`.
            hidden: `(B, T, n_embd)` the layer's attention input (the normed hidden state the keys are made from);
                kept only when the policy sets `needs_hidden`, `None` where the caller has none.

        Returns:
            keys `(B, G, S, key_size)`, values `(B, G, S, value_size)`, positions `(B, G, S)`; a staged
            decode step of a storage with `read_packed` (int8/int4) gives its `PackedSlots` as both keys
            and values, which `attention.attend` reads without unpacking.
        """
        self.settle()
        if self._call is not None:
            raise RuntimeError("attend_inputs() called twice without evict_and_store() in between")
        if self.policy.reads_only():
            return self._attend_read_only(keys, values, input_pos, queries)
        check_call_inputs(self.shape, self.dtype, keys, values, input_pos)
        if self.needs_queries and queries is None:
            raise ValueError(f"{self.name} needs the call's queries, got None")
        b, g, t = keys.shape[:3]
        new_pos = input_pos[:, None, :].expand(b, g, t)
        self.attended_keys_valid = False
        kept_queries = queries if self.needs_queries else None
        if not self.static_shapes and self.num_filled + t <= self.cache_length and self._goes_direct(t):
            attended = self._attend_direct(keys, values, new_pos, input_pos, kept_queries)
        else:
            self.head_starts = None  # slots are chosen again: the compression's layout is gone
            self._valid_prefix = None
            if not self.static_shapes:
                self.check_room(input_pos)
            if t <= ROOM and not needs_functional(keys, values):
                attended = self._attend_staged(keys, values, new_pos, input_pos, kept_queries)
            else:
                attended = self._attend_concat(keys, values, new_pos, input_pos, kept_queries)
        if self.needs_hidden and self._call is not None:
            self._call.candidates.hidden = hidden
        return attended

    def _goes_direct(self, t: int) -> bool:
        """Whether a call of `t` tokens, with room for them, goes straight into slots `[num_filled, num_filled +
        T)`: always with a lossless storage; with a lossy one (whose new tokens attention must see as stored)
        only a decode step read packed (`read_packed`) of a policy without state that fills the lowest-numbered
        empty slots (`Policy.fills_in_order`: dense), whose staged path would store the same bits in an empty
        slot too (perhaps a pad's, which the direct path leaves empty)."""
        if self.storage.lossless:
            return True
        return self.storage.reads_packed and t <= ROOM and not self.keeps_state and self.policy.fills_in_order()

    def _attend_read_only(
        self, keys: torch.Tensor, values: torch.Tensor, input_pos: torch.Tensor, queries: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A call the policy reads and the cache does not keep (`Policy.reads_only`: kvzip's reconstruction
        pass): the slots plus the new tokens as stored, handed to `Policy.read_call`; nothing is stored or
        evicted (`evict_and_store` does nothing)."""
        if queries is None:
            raise ValueError(f"{self.name} needs the call's queries, got None")
        slot_keys, slot_values = self.storage.read()
        seen_keys, seen_values = self.storage.as_stored(keys, values)
        self.policy.read_call(slot_keys, slot_values, seen_keys, seen_values, input_pos, queries)
        b, g, t = keys.shape[:3]
        positions = torch.cat((self.positions, input_pos[:, None, :].expand(b, g, t)), dim=2)
        return torch.cat((slot_keys, seen_keys), dim=2), torch.cat((slot_values, seen_values), dim=2), positions

    def _attend_staged(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        new_pos: torch.Tensor,
        input_pos: torch.Tensor,
        queries: torch.Tensor | None,
    ) -> tuple[torch.Tensor | PackedSlots, torch.Tensor | PackedSlots, torch.Tensor]:
        """A decode step: the token waits in the room after the slots; attend a view of slots + room.

        A storage whose format attention reads directly (`read_packed`: quantised codes) hands
        over its packed slots as keys and values; the record unpacks them only if a policy reads them."""
        length, t = self.cache_length, keys.shape[2]
        # the room holds the call's own token: a pad there is seen by its own pad query only
        self.attended_keys_valid = self.slots_known_valid()
        self.storage.stage(keys, values)
        packed = self.storage.read_packed(length + t)
        all_keys, all_values = self.storage.read_staged(t) if packed is None else (packed, packed)
        self.pos_buffer[:, :, length : length + t] = new_pos
        positions = self.pos_buffer[:, :, : length + t]
        # the record's positions are a copy: the slots' positions change before `update_state` reads it
        record = Candidates if packed is None else PackedCandidates
        candidates = record(positions.clone(), all_keys, all_values, keys, values, input_pos, queries=queries)
        self._call = OpenCall("staged", 0, candidates)
        return all_keys, all_values, positions

    def _attend_concat(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        new_pos: torch.Tensor,
        input_pos: torch.Tensor,
        queries: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A longer call (a prefill chunk, or any call under autograd): the slots then the new tokens as stored."""
        old_keys, old_values = self.storage.read()
        seen_keys, seen_values = self.storage.as_stored(keys, values)
        all_keys, all_values = torch.cat((old_keys, seen_keys), dim=2), torch.cat((old_values, seen_values), dim=2)
        positions = torch.cat((self.positions, new_pos), dim=2)
        candidates = Candidates(positions, all_keys, all_values, keys, values, input_pos, queries=queries)
        self._call = OpenCall("concat", 0, candidates)
        return all_keys, all_values, positions

    def _attend_direct(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        new_pos: torch.Tensor,
        input_pos: torch.Tensor,
        queries: torch.Tensor | None,
    ) -> tuple[torch.Tensor | PackedSlots, torch.Tensor | PackedSlots, torch.Tensor]:
        """The new tokens go into the empty slots `[num_filled, num_filled + T)`; attend the filled prefix (packed
        where the storage reads so: `_goes_direct`)."""
        b, g, t = new_pos.shape
        start = self.num_filled
        # the record is built only for a policy with state
        positions = torch.cat((self.positions, new_pos), dim=2) if self.keeps_state else new_pos
        if self.journal is not None:
            self.journal(self, torch.arange(start, start + t, device=keys.device).expand(b, g, t))
        self.storage.write_range(start, keys, values)
        self.positions[:, :, start : start + t] = new_pos
        starts, prefix = self.head_starts, self._valid_prefix
        self.forget_valid_slots()  # the new tokens may be pads
        # appended after every head's slots, and after the known prefix (a pad ends them: `direct_head_starts`,
        # `direct_prefix_valid`)
        self.head_starts, self._valid_prefix = starts, prefix
        self.num_filled = start + t
        candidates = Candidates(positions, None, None, keys, values, input_pos, queries=queries)
        self._call = OpenCall("direct", start, candidates)
        packed = self.storage.read_packed(start + t)
        all_keys, all_values = self.storage.read_prefix(start + t) if packed is None else (packed, packed)
        return all_keys, all_values, self.positions[:, :, : start + t]

    def evict_and_store(self, attn_weights: torch.Tensor | None) -> None:
        """After the call's queries have attended: evict and write the surviving new tokens.

        Args:
            attn_weights: `(B, G, S)` float32 weight sums over the attended tokens (`S` as returned by
                `attend_inputs`), or `None` when the policy does not use `needs_attn_weights`.
        """
        if self.policy.reads_only():
            return
        self.wait_for_eviction(attn_weights)
        self.settle()

    def wait_for_eviction(self, attn_weights: torch.Tensor | None) -> None:
        """After the call's queries have attended: keep their weight sums with the call, whose eviction
        waits (a decode step under `KVCaches`: `KVCaches.evict_waiting` evicts every layer's at once after
        the block loop; `settle` evicts this one alone). Arguments as `evict_and_store`."""
        if self.policy.reads_only():
            return
        call = self._call
        if call is None or call.waiting:
            raise RuntimeError(
                f"{self.name}: evict_and_store() or wait_for_eviction() called without a preceding attend_inputs()"
            )
        if self.needs_attn_weights and attn_weights is None:
            raise ValueError(f"{self.name} needs attention weights, got None")
        call.candidates.attn_weights = attn_weights
        if call.path == "staged":
            self.policy.attended(call.candidates)
        call.waiting = True

    @property
    def waiting_call(self) -> OpenCall | None:
        """The call whose eviction waits (attention done, `wait_for_eviction`), else `None`."""
        call = self._call
        return call if call is not None and call.waiting else None

    def take_waiting(self) -> Candidates:
        """The waiting call's record, handed to a batched eviction (`KVCaches.evict_waiting`), which then
        writes its choice with `store_staged`; the cache no longer holds the call."""
        call = self.waiting_call
        if call is None:
            raise RuntimeError(f"{self.name}.take_waiting(): no call waits for its eviction")
        self._call = None
        return call.candidates

    def settle(self) -> None:
        """Evict the waiting call alone, if one waits (a cache read before `KVCaches.evict_waiting`, or a
        layer that is not evicted with others); the result is bitwise that of the batched eviction."""
        call = self.waiting_call
        if call is None:
            return
        self._call = None
        evict(self, call)

    def store_staged(self, placement: Placement, cand: Candidates) -> None:
        """Write a staged call's choice (`eviction.store_staged`; `KVCaches.evict_waiting`'s batched one)."""
        store_staged(self, placement, cand)

    def abort_call(self) -> None:
        """Forget a call interrupted between `attend_inputs` and its eviction (its eviction is not done)."""
        self._call = None

    def advance(self, num_new: int) -> None:
        """Count `num_new` tokens taken by an evicting call. Calls made with `static_shapes` leave this to
        their caller, so that a compiled step does not depend on a changing host counter."""
        self.num_filled = min(self.cache_length, self.num_filled + num_new)

    def nbytes(self) -> int:
        """Bytes held by the keys and values (scales and offsets included for quantised storage)."""
        return self.storage.nbytes()

    # -- state ----------------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything a call may change, by name; views of the live tensors (a snapshot clones them).

        `"positions"` and `"storage.<name>"` and `"slot.<name>"` (the policy's `slot_state`) are
        `(B, G, L, ...)` with the slot index on dim 2; `"row.<name>"` (or `"row.<name>.<i>"` for a
        tuple) are the policy's `row_state`, batch first, and the host flags of the one-shot compression and
        the policy (their `flags()`, `"row.<name>"` `(B,)` bool). Row state not set yet is left out. The host
        counter `num_filled` is not a tensor: read it from the attribute.
        """
        self.settle()
        self.forget_valid_slots()  # the caller may write the live tensors
        out = named_tensors(self)
        b = self.shape.batch_size
        out.update({f"row.{name}": torch.full((b,), flag) for name, flag in self._flags().items()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], num_filled: int) -> None:
        """Set the cache to a state shaped as `state_tensors()` returns it (copied in; row state assigned).

        Raises ValueError naming the tensor and the expected and actual shapes when they do not match.
        """
        if self._call is not None and not self._call.waiting:
            raise RuntimeError("load_state_tensors() called between attend_inputs() and evict_and_store()")
        require_int("num_filled", num_filled, 0, self.cache_length)
        self._call = None  # a waiting eviction is overwritten with the rest of the state
        self.forget_valid_slots()
        load_named(self, tensors)
        self.num_filled = num_filled
        for holder in (self.one_shot, self.policy):
            if holder is not None:
                given = {name: tensors.get(f"row.{name}") for name in holder.flags()}
                holder.set_flags({name: flag is not None and bool(flag.all()) for name, flag in given.items()})

    def _flags(self) -> dict[str, bool]:
        """The host flags of the state: the one-shot compression's (`one_shot_compressed`), then the policy's."""
        return {**(self.one_shot.flags() if self.one_shot is not None else {}), **self.policy.flags()}


class _AllSlots:
    """A journal that records every slot of a call (a policy that empties slots it does not overwrite)."""

    def __init__(self, inner: Journal) -> None:
        self.inner = inner

    def __call__(self, cache: SlotMachine, dest: torch.Tensor) -> None:
        b, g, _ = dest.shape
        length = cache.cache_length
        self.inner(cache, torch.arange(length, device=dest.device).expand(b, g, length))
