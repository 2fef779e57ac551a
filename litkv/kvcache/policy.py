"""What a policy author writes: the whole contract of a KV cache policy, in one place.

A policy decides which tokens keep a layer's `cache_length` (`L`) slots. Everything else (storage,
positions, the undo log, static shapes for compiled steps, snapshots, checks) is the layer cache's
machinery (`litkv.kvcache.machine.SlotMachine`), which composes the policy (an instance of a
`litkv.kvcache.base.KVCache` subclass, bound to its cache) and knows no policy by name. A policy
declares, as class attributes:

- `Options`: its options, a dataclass (fields with defaults, `check(cache_length)`; as kvpress's presses);
  the cache gets the validated instance as `self.options`;
- `needs`: the inputs that cost something, declared once: `"attn_weights"` (the call's attention-weight
  sums: attention takes its eager path), `"queries"` (the call's queries), `"rope"` (the model's RoPE
  tables, `bind_rope`), `"gates"` (the model's eviction gates, `bind_gates`);
- `slot_state`: its per-slot state, name -> `SlotState(fill, dtype)`, each a `(B, G, L)` tensor the
  machinery allocates; `row_state`: names of per-row state (batch first, `None` until first set).

and implements `select_drop(candidates)` (or, through `ScoreKVCache`, `score(candidates)`), plus
`update_state(placement, candidates)` if it keeps state: it *returns* the new values by name (never
assigns them; the machinery writes them, in place under compiled steps). What `score` computed and
`update_state` needs again goes through the call's typed memo, `candidates.once(self.method)`.

Its one-shot mode is not the policy's code: when its options ask for one (`mode="one-shot"`, `budget`), the
layer cache composes the compression its class names (`compression`: `litkv.kvcache.one_shot.OneShot` for a
`KVCache`), which ranks the slots by the policy's `oneshot_scores()`.

A policy written for the old interface (the `needs_*` flags, `after_write`, `candidates.scratch`, state
assigned in a hook, the one-shot mode's `compress`/`select_keep`) fails with one line saying what to change.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from litkv.kvcache.candidates import Candidates, Placement
from litkv.kvcache.layer_cache import CacheSettings
from litkv.kvcache.options import NoOptions, PolicyOptions
from litkv.kvcache.state_tensors import SlotState, check_slot_state

if TYPE_CHECKING:
    from litkv.gates.gate import EvictionGates

__all__ = ["NEEDS", "Compression", "Policy", "StateUpdate"]

#: The inputs a policy may ask for (`Policy.needs`).
NEEDS = frozenset({"attn_weights", "queries", "rope", "gates", "hidden"})

#: What `update_state` returns: new values of declared state by name (a tensor, or a tuple for row state).
StateUpdate = Mapping[str, torch.Tensor | tuple[torch.Tensor, ...]]

_OLD_NAMES = {
    "needs_attn_weights": 'declare needs = {"attn_weights"} instead of needs_attn_weights = True',
    "needs_queries": 'declare needs = {"queries"} instead of needs_queries = True',
    "needs_rope": 'declare needs = {"rope"} instead of needs_rope = True',
    "needs_gates": 'declare needs = {"gates"} instead of needs_gates = True',
    "after_write": "after_write is now update_state(placement, candidates), which returns the new state "
    "by name ({'name': tensor}) instead of assigning it",
    "compress": "compress belongs to the one-shot compression the cache composes (cache.one_shot, "
    "litkv.kvcache.one_shot.OneShot): implement oneshot_scores() (and compresses_across_layers())",
    "select_keep": "select_keep belongs to the one-shot compression (litkv.kvcache.one_shot.OneShot): subclass it "
    "and run the policy with one_shot(policy, YourCompression), as adakv(policy) does",
}

#: The layer cache's methods (`SlotMachine`), which a policy inherited before it was composed: defined in a
#: policy they would never be called, so a class defining one is refused.
_MACHINE_NAMES = frozenset(
    {
        "attend_inputs", "evict_and_store", "wait_for_eviction", "settle", "take_waiting", "store_staged",
        "abort_call", "advance", "nbytes", "state_tensors", "load_state_tensors", "slots_known_valid",
        "forget_valid_slots", "overflow", "journal", "waiting_call", "_set_state",
    }
)  # fmt: skip


class Compression(Protocol):
    """What the layer cache asks of the one-shot compression it composes (`litkv.kvcache.one_shot.OneShot`)."""

    budget: int
    compressed: bool

    def end_prefill(self) -> None: ...

    def check_room(self, input_pos: torch.Tensor) -> None: ...

    def flags(self) -> dict[str, bool]: ...

    def set_flags(self, flags: Mapping[str, bool]) -> None: ...


class Policy(ABC):
    """The author's side of a layer cache: declarations and the methods a policy may implement.

    Read on the instance (never assign them): `options` (the validated `Options`), `cache_length` (`L`),
    `positions` (`(B, G, L)` int64 token position of each slot, `-1` when empty), each declared state by its
    name, `config` (the `KVCacheConfig`), `cache` (the layer cache running it, `SlotMachine`).

    `oneshot_scores` and `compresses_across_layers` are what the one-shot compression asks of a policy;
    the last methods (`check_room`, `flags`, `empties_slots`, `reads_only`) are what kvzip's reconstruction
    pass asks of the machinery; a plain policy leaves them alone.
    """

    Options: ClassVar[type[PolicyOptions]] = NoOptions
    needs: ClassVar[frozenset[str]] = frozenset()
    slot_state: ClassVar[Mapping[str, SlotState]] = {}
    row_state: ClassVar[tuple[str, ...]] = ()
    #: all-zero row state means what `None` does (sums of what the calls saw; `KVCaches.copy_row` may fill zeros)
    row_state_zero_is_unset: ClassVar[bool] = False
    #: every KV head of a row holds the same tokens in the same slots (attention builds one mask per row)
    heads_share_positions: ClassVar[bool] = False
    #: the one-shot compression the cache composes when the options ask for one (`OneShot` for a `KVCache`;
    #: `one_shot(policy, compression)` sets another), called as `compression(cache, budget)`
    compression: ClassVar[Callable[[Any, int], Compression] | None] = None
    # derived from `needs` for attention and the model (a subclass never sets them)
    needs_attn_weights: ClassVar[bool] = False
    needs_queries: ClassVar[bool] = False
    needs_rope: ClassVar[bool] = False
    needs_gates: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False
    _state_names: ClassVar[frozenset[str]] = frozenset()

    options: PolicyOptions

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        for name, change in _OLD_NAMES.items():
            if name in vars(cls):
                raise TypeError(f"{cls.__name__}: {change} (docs/custom_policy.md)")
        _refuse_machinery(cls)
        needs = frozenset(cls.needs)
        if not needs <= NEEDS:
            raise TypeError(f"{cls.__name__}.needs: unknown {sorted(needs - NEEDS)}; known: {sorted(NEEDS)}")
        check_slot_state(cls.__name__, cls.slot_state)
        if not isinstance(cls.row_state, tuple):
            raise TypeError(f"{cls.__name__}.row_state must be a tuple of attribute names, got {cls.row_state!r}")
        cls.needs = needs
        for name in NEEDS:
            setattr(cls, f"needs_{name}", name in needs)
        cls._state_names = frozenset(cls.slot_state) | frozenset(cls.row_state)

    def __setattr__(self, name: str, value: object) -> None:
        # while `update_state` runs (the machinery's rebinding of tensors, serve's row views, is not refused)
        if name in type(self)._state_names and self.__dict__.get("_updating", False):
            raise AttributeError(
                f"{type(self).__name__}.{name} is declared state: return it from update_state "
                f"({{{name!r}: value}}) instead of assigning it"
            )
        object.__setattr__(self, name, value)

    @abstractmethod
    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        """Choose which `T` of the `L + T` candidates lose their slot (`ScoreKVCache`: the lowest `score`).

        Args:
            candidates: the call's record; drop empty slots and pads (position `-1`) first.

        Returns:
            `(B, G, T)` int64 distinct candidate indices to drop.
        """

    def inputs(self) -> frozenset[str]:
        """The part of `needs` this instance uses with its options (all of it unless overridden: `tova` reads
        the queries in one-shot mode only). Read once, when the cache is built."""
        return self.needs

    def update_state(self, placement: Placement, candidates: Candidates) -> StateUpdate | None:
        """The declared state after the call, by name (only what changes), once its tokens are in their slots.

        `placement.carry(per_candidate)` turns a `(B, G, L + T)` per-candidate quantity into the `(B, G, L)`
        per-slot one; `self.positions` is already updated (`-1`: still empty). Runs while the cache fills too.
        """
        return None

    def attended(self, candidates: Candidates) -> None:
        """Called in a decode step's layer call once its queries have attended (the record's `attn_weights` set),
        before its eviction waits for the other layers' (`SlotMachine.wait_for_eviction`; a full cache's step,
        the token staged in the room): a policy may compute here, into the call's memo (`candidates.once`), what
        its eviction reads of the slots' keys and values, while they are still in the CPU's caches (at the
        eviction, after every layer's weights, they are not). Nothing by default."""

    @classmethod
    def prepare_layers(cls, policies: Sequence[Policy], records: Sequence[Candidates]) -> None:
        """Before the layers' waiting decode steps that fill empty slots are written (`KVCaches.evict_waiting`;
        layers of this class with one configuration): compute what their `update_state` calls share once and
        `remember` it in each record (`learned`: every layer's gate logits in one product). Each layer must then
        get bitwise what it would compute alone. Nothing by default."""

    @classmethod
    def adjust(cls, config: CacheSettings) -> CacheSettings:
        """The settings the cache is built with, from those given (`qh2o`: float storage becomes int4)."""
        return config

    @classmethod
    def max_tokens(cls, config: CacheSettings) -> int | None:
        """Most tokens one sequence may bring through this cache, `None` when unbounded (it evicts)."""
        return None

    def fills_in_order(self) -> bool:
        """Whether `select_drop` drops, while the cache has empty slots, the lowest-numbered ones (then the call's
        pads), so that tokens take slots in index order and slots from the count of tokens taken on stay
        empty; a lossy storage's decode step then goes straight into the next slot (`SlotMachine._goes_direct`).
        `False` by default."""
        return False

    def drops_valid_by_construction(self) -> bool:
        """Whether `select_drop` returns valid indices by construction, so that their values need not be
        checked (one host sync per call). Leave `False` while the policy is young: a wrong claim corrupts."""
        return False

    def end_prefill(self) -> None:
        """Called once a prompt has been prefilled, before its first decode step; nothing by default."""

    def bind_rope(
        self, table: Callable[[int], tuple[torch.Tensor, torch.Tensor]], n_elem: int, column: int | None = None
    ) -> None:
        """Receive the model's RoPE tables (`table(length) -> (cos, sin)`) when `needs` has `"rope"`."""

    def bind_gates(self, gates: EvictionGates | None, layer: int) -> None:
        """Receive the model's eviction gates (`None` when none are loaded) and this cache's layer index when
        `needs` has `"gates"`."""

    def oneshot_scores(self) -> torch.Tensor:
        """`(B, G, L)` score of each slot's token at the end of the prompt, for the one-shot compression
        (highest kept; `inf`: always kept). `ScoreKVCache` scores the slots as a call without new tokens."""
        raise NotImplementedError(f"{type(self).__name__} has no one-shot mode: it implements no oneshot_scores()")

    def compresses_across_layers(self) -> bool:
        """Whether the one-shot compression ranks this layer's `oneshot_scores()` against the other layers'
        (`compress_all` / `KVCaches.end_prefill` then compress the layers together); `False` by default."""
        return False

    def check_room(self, input_pos: torch.Tensor) -> None:
        """Raise before attention if this policy cannot take the call's tokens (`input_pos` `(B, T)`) beyond
        what `max_tokens` says (the one-shot compression checks its own: the whole prompt must fit)."""

    def flags(self) -> dict[str, bool]:
        """Host flags saved with the cache's state (each as `"row.<name>"`, `(B,)` bool; kvzip: whether its
        reconstruction pass scored the slots); `set_flags` receives them back when a state is loaded."""
        return {}

    def set_flags(self, flags: Mapping[str, bool]) -> None:
        """Take the flags of a loaded state (the names `flags()` gives; `False` when the state had none)."""

    def empties_slots(self) -> bool:
        """Whether `update_state` may empty slots it did not overwrite (sets their position to `-1`): the
        undo log then records every slot of a call, and the cache never assumes every slot holds a token."""
        return False

    def reads_only(self) -> bool:
        """Whether the next call is one the policy reads and the cache does not keep (kvzip's reconstruction
        pass): it attends the slots plus its own tokens, `read_call` sees them, nothing is stored or evicted."""
        return False

    def read_call(
        self,
        slot_keys: torch.Tensor,
        slot_values: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        input_pos: torch.Tensor,
        queries: torch.Tensor,
    ) -> None:
        """See a call while `reads_only()`: the slots' keys and values `(B, G, L, D)`, the new tokens' as
        stored `(B, G, T, D)`, their positions `(B, T)`, the queries `(B, n_head, T, D)`."""
        raise NotImplementedError(f"{type(self).__name__}.reads_only() is true but read_call is not implemented")


def _refuse_machinery(cls: type) -> None:
    """TypeError in one line when `cls` defines a layer cache method (`_MACHINE_NAMES`) or a constructor of the
    old signature `(config, shape, device, dtype)`: neither would be called now that the cache composes it."""
    own = sorted(_MACHINE_NAMES & set(vars(cls)))
    if own:
        raise TypeError(
            f"{cls.__name__}.{own[0]} belongs to the layer cache (SlotMachine), which runs the policy: a policy "
            "implements select_drop/score, update_state and the hooks of litkv.kvcache.policy (docs/custom_policy.md)"
        )
    init = vars(cls).get("__init__")
    if init is not None:
        params = list(inspect.signature(init).parameters)[1:]
        if {"config", "shape", "device", "dtype"} & set(params):
            raise TypeError(
                f"{cls.__name__}.__init__{tuple(params)}: a policy is built by its cache as {cls.__name__}(cache) "
                "(read cache.config, cache.shape); declared state (slot_state, row_state) needs no constructor"
            )
