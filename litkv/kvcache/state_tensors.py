"""A layer cache's state as named tensors (`SlotMachine.state_tensors` / `load_state_tensors`), and the
policy's own state declared as data (`KVCache.slot_state`, `KVCache.row_state`): checked when a policy class
is defined, allocated on the policy when it is bound to its cache, listed, loaded, and set in place under
static shapes.

The names: `"positions"`, `"storage.<name>"` and `"slot.<name>"` (the policy's `slot_state`) are
`(B, G, L, ...)` with the slot index on dim 2; `"row.<name>"` (or `"row.<name>.<i>"` for a tuple) are the
policy's `row_state`, batch first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, NamedTuple, Protocol

import torch

from litkv.kvcache.storage import KVStorage, load_into

__all__ = [
    "Declared",
    "SlotState",
    "StateHolder",
    "allocate",
    "check_slot_state",
    "load_named",
    "named_tensors",
    "set_named",
]


class SlotState(NamedTuple):
    """One per-slot state tensor a policy declares (`KVCache.slot_state`): its cache allocates it `(B, G, L)`,
    filled with `fill`, of `dtype`; the policy returns its new value (`update_state`)."""

    fill: float = 0.0
    dtype: torch.dtype = torch.float32


class Declared(Protocol):
    """A policy's declarations (`litkv.kvcache.policy.Policy`); its declared state lives in its attributes."""

    slot_state: ClassVar[Mapping[str, SlotState]]
    row_state: ClassVar[tuple[str, ...]]


class StateHolder(Protocol):
    """What these functions read of a layer cache (`SlotMachine`): its slots, and the policy it runs."""

    positions: torch.Tensor  # (B, G, L)
    storage: KVStorage
    static_shapes: bool

    @property
    def policy(self) -> Declared: ...


def check_slot_state(owner: str, declared: object) -> None:
    """Raise TypeError unless `declared` maps attribute names to `SlotState`s (`owner`: the class's name)."""
    if not isinstance(declared, Mapping) or not all(
        isinstance(k, str) and isinstance(v, SlotState) for k, v in declared.items()
    ):
        raise TypeError(f"{owner}.slot_state must map attribute names to SlotState(fill, dtype), got {declared!r}")


def allocate(policy: Declared, positions: torch.Tensor) -> None:
    """Set each declared `slot_state` attribute of `policy` to a tensor like `positions` `(B, G, L)` filled with
    its `fill`, each `row_state` attribute to `None` (not set yet)."""
    for name, (fill, dtype) in policy.slot_state.items():
        object.__setattr__(policy, name, torch.full_like(positions, fill, dtype=dtype))
    for name in policy.row_state:
        object.__setattr__(policy, name, None)


def named_tensors(cache: StateHolder) -> dict[str, torch.Tensor]:
    """The cache's state by name (views of the live tensors); row state not set yet is left out."""
    out = {"positions": cache.positions}
    out.update({f"storage.{k}": v for k, v in cache.storage.state_tensors().items()})
    policy = cache.policy
    out.update({f"slot.{name}": getattr(policy, name) for name in policy.slot_state})
    for name in policy.row_state:
        value = getattr(policy, name)
        if isinstance(value, torch.Tensor):
            out[f"row.{name}"] = value
        elif isinstance(value, tuple):
            out.update({f"row.{name}.{i}": part for i, part in enumerate(value)})
    return out


def load_named(cache: StateHolder, tensors: dict[str, torch.Tensor]) -> None:
    """Copy the storage, positions and slot state of `tensors` into the cache's live tensors; assign its row
    state (cloned; a name left out is `None`). Raises ValueError naming the tensor and the expected and actual
    shapes when they do not match."""
    policy = cache.policy
    owner = type(policy).__name__
    storage = {k[len("storage.") :]: v for k, v in tensors.items() if k.startswith("storage.")}
    cache.storage.load_state_tensors(storage)
    slots = {k: v for k, v in tensors.items() if k == "positions" or k.startswith("slot.")}
    live = {k: v for k, v in named_tensors(cache).items() if k == "positions" or k.startswith("slot.")}
    load_into(owner, live, slots)
    for attr in policy.row_state:
        parts = sorted((k for k in tensors if k == f"row.{attr}" or k.startswith(f"row.{attr}.")), key=len)
        if not parts:
            object.__setattr__(policy, attr, None)
        elif parts == [f"row.{attr}"]:
            object.__setattr__(policy, attr, tensors[parts[0]].clone())
        else:
            object.__setattr__(policy, attr, tuple(tensors[f"row.{attr}.{i}"].clone() for i in range(len(parts))))


def set_named(cache: StateHolder, name: str, value: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
    """Set the policy's state attribute `name` to `value` (a tensor or a tuple of them): with `static_shapes`
    copied into the tensor(s) there when each has the same shape and dtype (addresses kept); otherwise the
    attribute is rebound."""
    current = getattr(cache.policy, name, None)
    parts, now = (value, current) if isinstance(value, tuple) else ((value,), (current,))
    if cache.static_shapes and isinstance(now, tuple) and _same_layout(now, parts):
        for old, new in zip(now, parts, strict=True):
            old.copy_(new)
    else:
        object.__setattr__(cache.policy, name, value)  # past the policy's guard on its declared state


def _same_layout(old: tuple[object, ...], new: tuple[torch.Tensor, ...]) -> bool:
    """Whether `new` can be copied into `old` tensor by tensor: as many tensors, each of the same shape and dtype."""
    return len(old) == len(new) and all(
        isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype for a, b in zip(old, new, strict=True)
    )
