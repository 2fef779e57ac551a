"""Roll back the last tokens of a model's caches: an undo log of the last calls, and `truncate`.

A cache calls its `journal` once per call, before it changes anything, with the slots the call will
overwrite. `UndoLog` records, per call and layer, what those slots hold (storage and positions), a copy
of the policy's slot and row state and `num_filled`, plus the model's `last_pos` after the call; undoing
a call writes them back. Dense caches (no policy state, no eviction) need no log: their slots are
emptied. The recurrent (Mamba-2) layers of a hybrid model cannot be rolled back token by token: the log
keeps their state as it was before each recorded call (a checkpoint at every call boundary), and undoing
the call brings it back; a roll-back that ends inside a call, or goes past the log, is an error. See
docs/state.md.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from litkv.core.validation import require_int
from litkv.kvcache.caches import KVCaches
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.recurrent import RecurrentCache
from litkv.modeling.model import GPT

__all__ = ["UndoLog", "attached_caches", "keep_undo_log", "truncate", "undo_log_of", "writing_mode"]


def attached_caches(model: GPT) -> list[SlotMachine | RecurrentCache]:
    """The model's attached layer caches (`SlotMachine`, and `RecurrentCache` in a hybrid model), one per layer;
    ValueError when none are attached."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a litkv GPT, got {type(model).__name__}")
    caches = model.kv_caches
    if any(not isinstance(c, (SlotMachine, RecurrentCache)) for c in caches):
        raise ValueError("the model has no KV caches attached: call model.set_kv_caches(model.build_kv_caches(...))")
    return caches  # type: ignore[return-value]


def writing_mode(caches: Sequence[object]) -> contextlib.AbstractContextManager:
    """`torch.inference_mode()` when a cache holds inference tensors (it ran under inference mode: they
    can be written in place only there), else `torch.no_grad()`."""
    live = (t for c in caches if isinstance(c, SlotMachine) for t in c.state_tensors().values())
    return torch.inference_mode() if any(t.is_inference() for t in live) else torch.no_grad()


def _gather_slots(t: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """`t` `(B, G, L, *rest)` at slots `dest` `(B, G, T)` -> `(B, G, T, *rest)`."""
    rest = t.shape[3:]
    return t.gather(2, dest.view(*dest.shape, *([1] * len(rest))).expand(*dest.shape, *rest))


@dataclass
class _Record:
    """What one call changes in one layer's cache, recorded before the change."""

    dest: torch.Tensor  # (B, G, T) slots the call overwrites
    at_dest: dict[str, torch.Tensor]  # positions and storage tensors at `dest`, (B, G, T, ...)
    whole: dict[str, torch.Tensor]  # slot state (changes everywhere) and row state, cloned
    num_filled: int


class _LayerJournal:
    """`SlotMachine.journal` of one layer: records into the undo log."""

    def __init__(self, log: UndoLog, layer: int) -> None:
        self.log = log
        self.layer = layer

    def __call__(self, cache: SlotMachine, dest: torch.Tensor) -> None:
        self.log._record(self.layer, cache, dest)


class UndoLog:
    """The last `depth` calls through a model's caches, enough to undo them exactly (see `truncate`).

    A call's record holds the slots it overwrites (storage and positions at those slots), a copy of the
    policy's slot and row state, `num_filled`, and the model's `last_pos` after the call.
    """

    def __init__(self, depth: int) -> None:
        require_int("undo log depth", depth, 1, note=" (calls kept)")
        self.depth = depth
        self.entries: deque[tuple[list[_Record], torch.Tensor | None]] = deque()
        self.base_last_pos: torch.Tensor | None = None  # last_pos before the oldest entry
        # per entry, the recurrent layers' states before its call (references: a `RecurrentCache` rebinds,
        # never writes in place)
        self.recurrent: deque[list[dict[str, torch.Tensor]]] = deque()
        self._pending: list[dict[str, torch.Tensor]] = []
        self._caches: KVCaches | None = None

    def attach(self, caches: KVCaches) -> None:
        """Record the calls through `caches` (it becomes their `undo_log`); forget earlier records."""
        self._caches = caches
        caches.undo_log = self
        for i, cache in enumerate(caches.policy_caches):
            cache.journal = _LayerJournal(self, i)
        self.clear(caches.last_pos)

    def before_call(self, caches: KVCaches) -> None:
        """Keep the recurrent layers' states before the call (the checkpoint its undo restores)."""
        self._pending = [dict(cache.state_tensors()) for cache in caches.recurrent_caches]

    def clear(self, last_pos: torch.Tensor | None) -> None:
        self.entries.clear()
        self.recurrent.clear()
        self.base_last_pos = None if last_pos is None else last_pos.clone()

    def nbytes(self) -> int:
        tensors = [t for records, _ in self.entries for r in records for t in (*r.at_dest.values(), *r.whole.values())]
        tensors += [t for states in self.recurrent for state in states for t in state.values()]
        return sum(t.nbytes for t in tensors)

    @torch.no_grad()
    def _record(self, layer: int, cache: SlotMachine, dest: torch.Tensor) -> None:
        last_pos = None if self._caches is None else self._caches.last_pos
        if layer == 0:
            after = None if last_pos is None else last_pos.clone()
            self.entries.append(([], after))
            self.recurrent.append(self._pending)
            if len(self.entries) > self.depth:
                _, dropped_after = self.entries.popleft()
                self.recurrent.popleft()
                self.base_last_pos = dropped_after
        if not self.entries:
            return
        at_dest, whole = {}, {}
        for name, t in cache.state_tensors().items():
            if name == "positions" or name.startswith("storage."):
                at_dest[name] = _gather_slots(t, dest)
            else:
                whole[name] = t.clone()
        self.entries[-1][0].append(_Record(dest.clone(), at_dest, whole, cache.num_filled))

    def undo_last(self, caches: Sequence[SlotMachine | RecurrentCache]) -> None:
        """Undo the newest recorded call in every layer (recurrent layers: their state before the call)."""
        records, _ = self.entries.pop()
        states = self.recurrent.pop()
        recurrent = [c for c in caches if isinstance(c, RecurrentCache)]
        if len(states) != len(recurrent):
            raise ValueError(
                f"the undo log holds {len(states)} recurrent states, the model has {len(recurrent)} layers"
            )
        with writing_mode(caches):
            self._undo([c for c in caches if isinstance(c, SlotMachine)], records)
        for cache, state in zip(recurrent, states, strict=True):
            cache.load_state_tensors(state)

    @staticmethod
    def _undo(caches: Sequence[SlotMachine], records: list[_Record]) -> None:
        for cache, record in zip(caches, records, strict=True):
            tensors = {}
            for name, t in cache.state_tensors().items():
                if name in record.at_dest:
                    index = record.dest.view(*record.dest.shape, *([1] * (t.dim() - 3))).expand_as(record.at_dest[name])
                    tensors[name] = t.clone().scatter_(2, index, record.at_dest[name])
            tensors.update(record.whole)
            cache.load_state_tensors(tensors, record.num_filled)


def keep_undo_log(model: GPT, depth: int = 64) -> UndoLog:
    """Record the last `depth` calls through the model's attached caches so that `truncate` can undo them.

    A call is one forward (a prefill chunk or a decode step). `restore` keeps the log attached (emptied);
    caches attached later with `set_kv_caches` are not recorded.
    """
    attached_caches(model)  # ValueError when none are attached
    log = UndoLog(depth)
    log.attach(model.caches)
    return log


def undo_log_of(model: GPT) -> UndoLog | None:
    """The undo log recording the model's attached caches, if any."""
    log = None if model.caches is None else model.caches.undo_log
    return log if isinstance(log, UndoLog) else None


def _is_dense_like(cache: SlotMachine) -> bool:
    """No policy state and a token limit (never evicts): rolling back only empties slots."""
    cls = type(cache.policy)
    return not cls.slot_state and not cls.row_state and cls.max_tokens(cache.config) is not None


@torch.no_grad()
def truncate(model: GPT, n: int) -> None:
    """Roll back the last `n` tokens of each row (positions > `last_pos - n` are forgotten).

    Exact for caches that never evict and keep no policy state (dense): their slots are emptied. Other
    caches, and every cache of a hybrid model (its recurrent layers' state cannot be cut token by token),
    are rolled back call by call with the undo log (`keep_undo_log`): exact within its depth; `n` must end
    on a call boundary (whole prefill chunks, decode steps), else ValueError and nothing changes.

    Raises:
        ValueError: `n` is not an int >= 0, goes back past the first token, past what the undo log
            holds, or into the middle of a call; no undo log is kept for an evicting cache.
    """
    require_int("n", n, 0, note=" (tokens to roll back)")
    caches = attached_caches(model)
    if n == 0:
        return
    if model.last_pos is None:
        raise ValueError(f"cannot roll back {n} tokens: the caches have seen no token yet")
    target = model.last_pos - n
    if bool((target < -1).any()):
        row = int((target < -1).nonzero()[0])
        raise ValueError(f"cannot roll back {n} tokens: row {row} has seen {int(model.last_pos[row]) + 1}")
    log = undo_log_of(model)
    recurrent = any(isinstance(c, RecurrentCache) for c in caches)
    if recurrent and log is None:
        raise ValueError(
            "cannot roll back a hybrid model without an undo log: its recurrent (Mamba-2) layers' state is "
            "restored from checkpoints taken at call boundaries; call litkv.keep_undo_log(model, depth) first"
        )
    if not recurrent and all(_is_dense_like(c) for c in caches):  # type: ignore[arg-type]
        _truncate_dense(caches, target)
        model.last_pos = target
        if log is not None:
            log.clear(target)
        return
    if log is None:
        raise ValueError(
            f"cannot roll back {caches[0].name} caches without an undo log: call "
            "litkv.keep_undo_log(model, depth) before the calls to roll back"
        )
    count = _calls_to_undo(log, model.last_pos, target, n)
    for _ in range(count):
        log.undo_last(caches)
    model.last_pos = target


def _calls_to_undo(log: UndoLog, last_pos: torch.Tensor, target: torch.Tensor, n: int) -> int:
    """How many of the newest calls cover exactly the last `n` tokens of every row (no state changed)."""
    afters = [after for _, after in log.entries]
    current, count = last_pos, 0
    while bool((current > target).any()):
        if count == len(afters):
            raise ValueError(
                f"cannot roll back {n} tokens: the undo log holds the last {len(afters)} calls only "
                f"(depth={log.depth}); keep a deeper log (keep_undo_log(model, depth=...))"
            )
        count += 1
        before = afters[-count - 1] if count < len(afters) else log.base_last_pos
        current = torch.full_like(last_pos, -1) if before is None else before
    if not torch.equal(current, target):
        raise ValueError(
            f"cannot roll back {n} tokens: that ends inside a call of several tokens (a prefill chunk); "
            f"the calls recorded end at positions {current.tolist()} per row"
        )
    return count


def _truncate_dense(caches: Sequence[SlotMachine], target: torch.Tensor) -> None:
    with writing_mode(caches):
        _empty_slots_after(caches, target)


def _empty_slots_after(caches: Sequence[SlotMachine], target: torch.Tensor) -> None:
    for cache in caches:
        tensors = dict(cache.state_tensors())
        positions = tensors["positions"]
        keep = positions <= target.to(positions.device)[:, None, None]
        tensors["positions"] = torch.where(keep, positions, -1)
        held = (tensors["positions"] >= 0).flatten(0, 1).any(dim=0).nonzero()
        num_filled = int(held[-1]) + 1 if len(held) else 0
        cache.load_state_tensors({k: v.clone() for k, v in tensors.items()}, num_filled)
