"""Meaning checks of a cache state read from a file (after its checksum): a checksum proves only that
the bytes are what someone wrote, and anyone can recompute it. See docs/state.md, "What is validated"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from litkv.kvcache.storage import CacheShape


class CheckedLayer(Protocol):
    """What is checked of one layer of a `litkv.states.state.LayerState` (typed by protocol: no import circle)."""

    shape: CacheShape
    tensors: dict[str, torch.Tensor]
    num_filled: int
    length: int


class CheckedState(Protocol):
    """What is checked of a `litkv.states.state.CacheState`."""

    layers: Sequence[CheckedLayer]
    last_pos: torch.Tensor | None
    last_hidden: torch.Tensor | None
    token_ids: list[list[int]] | None

    @property
    def batch_size(self) -> int: ...


def _fail(field: str, problem: str) -> None:
    raise ValueError(f"{field} {problem}")


def _check_rows(name: str, t: torch.Tensor | None, rows: int) -> None:
    if t is not None and (t.dim() == 0 or t.shape[0] != rows):
        _fail(name, f"must have {rows} rows (the state's), got shape {tuple(t.shape)}")


def _check_finite(name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        _fail(name, "holds non-finite values (NaN or inf)")


def _check_positions(where: str, pos: torch.Tensor, layer: CheckedLayer, last_pos: torch.Tensor | None) -> None:
    if pos.dtype != torch.int64:
        _fail(f"{where} positions", f"must be int64, got {pos.dtype}")
    if pos.numel() == 0:
        return
    if int(pos.min()) < -1:
        _fail(f"{where} positions", f"must be >= -1 (-1: empty slot), got {int(pos.min())}")
    top = torch.full((pos.shape[0],), -1, dtype=torch.int64) if last_pos is None else last_pos.to(torch.int64)
    behind = pos.amax(dim=(1, 2)) > top
    if bool(behind.any()):
        r = int(behind.nonzero()[0, 0])
        _fail(
            f"{where} positions",
            f"of row {r} go up to {int(pos[r].max())}, past last_pos {int(top[r])} (last_pos behind the cache)",
        )
    filled = (pos >= 0).sum(dim=2)
    if int(filled.max()) > layer.num_filled:
        _fail(f"{where} num_filled", f"is {layer.num_filled}, but a row holds {int(filled.max())} positions")
    ordered = pos.sort(dim=2).values
    dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(dup.any()):
        _fail(f"{where} positions", "repeat a position within one (row, head) (each slot holds a distinct token)")


def _check_recurrent_layer(where: str, layer: object, rows: int) -> None:
    """A recurrent layer's state: the tensors its shape names, of those shapes, a float dtype, finite."""
    shape = layer.shape  # type: ignore[attr-defined]
    tensors: dict[str, torch.Tensor] = layer.tensors  # type: ignore[attr-defined]
    if shape.batch_size != rows:
        _fail(f"{where} shape.batch_size", f"is {shape.batch_size}, the state has {rows} rows")
    expected = shape.tensor_shapes()
    if set(tensors) != set(expected):
        _fail(f"{where} tensors", f"must be {sorted(expected)}, got {sorted(tensors)}")
    for name, size in expected.items():
        t = tensors[name]
        if tuple(t.shape) != size or not t.is_floating_point():
            _fail(f"{where} {name}", f"must be a float tensor of shape {size}, got {t.dtype} {tuple(t.shape)}")
        _check_finite(f"{where} {name}", t)


def _check_layer(i: int, layer: CheckedLayer, rows: int, last_pos: torch.Tensor | None) -> None:
    where = f"layer {i}"
    if getattr(layer, "kind", "attention") != "attention":
        _check_recurrent_layer(where, layer, rows)
        return
    shape = layer.shape
    if shape.batch_size != rows:
        _fail(f"{where} shape.batch_size", f"is {shape.batch_size}, the state has {rows} rows")
    if not 0 <= layer.num_filled <= shape.cache_length:
        _fail(f"{where} num_filled", f"must be in [0, {shape.cache_length}], got {layer.num_filled}")
    if layer.length not in (shape.cache_length, layer.num_filled):
        _fail(f"{where} length", f"must be cache_length {shape.cache_length} or num_filled, got {layer.length}")
    pos = layer.tensors.get("positions")
    if pos is None:
        _fail(f"{where} positions", "are missing")
    lead = (rows, shape.n_query_groups)
    for name, t in layer.tensors.items():
        if name.startswith("row."):
            _check_rows(f"{where} {name}", t, rows)
        elif name == "positions" or name.startswith(("storage.", "slot.")):
            slots = layer.length if name == "positions" or name.startswith("storage.") else shape.cache_length
            if t.dim() < 3 or (*t.shape[:3],) != (*lead, slots):
                _fail(f"{where} {name}", f"must have shape ({lead[0]}, {lead[1]}, {slots}, ...), got {tuple(t.shape)}")
        else:
            _fail(f"{where} {name}", "is not a state tensor name")
        _check_finite(f"{where} {name}", t)
    if pos.dim() != 3:
        _fail(f"{where} positions", f"must have 3 dims, got shape {tuple(pos.shape)}")
    for key in ("keys", "values"):
        t = layer.tensors.get(f"storage.{key}")
        size = shape.key_size if key == "keys" else shape.value_size
        if t is not None and (t.dim() != 4 or t.shape[3] != size):
            _fail(f"{where} storage.{key}", f"must have head size {size}, got shape {tuple(t.shape)}")
    _check_positions(where, pos, layer, last_pos)


def validate_state(state: CheckedState) -> None:
    """ValueError naming the field (and layer) when the state is not one a cache could be in."""
    rows = state.batch_size
    _check_rows("last_pos", state.last_pos, rows)
    _check_rows("last_hidden", state.last_hidden, rows)
    if state.last_pos is not None:
        if state.last_pos.dim() != 1 or state.last_pos.is_floating_point():
            _fail("last_pos", f"must be a 1-D integer tensor, got {state.last_pos.dtype} {tuple(state.last_pos.shape)}")
        if state.last_pos.numel() and int(state.last_pos.min()) < -1:
            _fail("last_pos", f"must be >= -1, got {int(state.last_pos.min())}")
    if state.last_hidden is not None:
        _check_finite("last_hidden", state.last_hidden)
    if state.token_ids is not None:
        bad = [r for r in state.token_ids if not isinstance(r, list) or not all(type(t) is int for t in r)]
        if bad:
            _fail("token_ids", "must be lists of ints, one per row")
    for i, layer in enumerate(state.layers):
        _check_layer(i, layer, rows, state.last_pos)


def check_token_ids(state: CheckedState, vocab_size: int) -> None:
    """ValueError when a token id of the state is outside `[0, vocab_size)`."""
    for r, ids in enumerate(state.token_ids or []):
        out = [t for t in ids if not 0 <= t < vocab_size]
        if out:
            _fail(f"token_ids of row {r}", f"must be in [0, {vocab_size}), got {out[0]}")
