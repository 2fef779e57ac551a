"""Cache state: the KV caches of a model (all layers) as a value that can be taken and given back.

A `CacheState` holds, per layer, what `SlotMachine.state_tensors()` returns (slot positions, storage
tensors, the policy's per-slot and per-row state) and the host counter `num_filled`, plus the last
position of each row (`GPT.last_pos`). On it are built:

- `snapshot(model)` / `restore(model, state)`: copy out and back in, bitwise;
- `CacheState.select(rows)` / `CacheState.cat(states)`: fork rows, merge rows of different lengths;
- `CacheState.save(path)` / `CacheState.load(path)`: the file format of `litkv.states.state_file`
  (safetensors + JSON metadata with the model fingerprint of `litkv.modeling.fingerprint` and a checksum);
  nothing is unpickled.

Rolling back (`keep_undo_log`, `truncate`) is `litkv.states.undo`; the stores of states by key are
`litkv.states.state_store`.

A custom policy that declares its state (`slot_state`, `row_state`) gets all of this. The Mamba-2 layers
of a hybrid model are `RecurrentLayerState`s (convolution window and SSM state, per row) in the same list,
copied, selected, merged and filed with the attention layers. See docs/state.md.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.policy import Policy
from litkv.kvcache.recurrent import RECURRENT_STATE_KINDS, RecurrentCache, RecurrentShape
from litkv.kvcache.storage import CacheShape
from litkv.modeling.config import ATTENTION, layer_kinds
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT
from litkv.states.state_checks import check_token_ids, validate_state
from litkv.states.state_file import one_line, read_state_file, write_state_file
from litkv.states.undo import attached_caches, undo_log_of, writing_mode

__all__ = ["CacheState", "LayerState", "RecurrentLayerState", "restore", "snapshot"]

TensorFn = Callable[[str, torch.Tensor], torch.Tensor]  # (name, tensor) -> tensor
_TRIMMABLE = ("positions", "storage.")  # slot tensors whose unwritten tail is known (-1 / zeros)


def _is_slot_tensor(name: str) -> bool:
    return name == "positions" or name.startswith(("storage.", "slot."))


@dataclass
class LayerState:
    """One layer's cache state.

    Attributes:
        config: the layer's `KVCacheConfig`.
        shape: the cache's `CacheShape` (its `batch_size` is the state's).
        tensors: `SlotMachine.state_tensors()` copies. "positions" and "storage.*" may hold only the first
            `length` slots (dim 2): the others were never written (positions -1, storage zeros).
        num_filled: the cache's host counter.
        length: slots held by the trimmed tensors (`cache_length` when not trimmed).
    """

    config: KVCacheConfig
    shape: CacheShape
    tensors: dict[str, torch.Tensor]
    num_filled: int
    length: int

    def full_tensors(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The tensors with every slot, as `load_state_tensors` expects them (on `device`)."""
        out = {}
        pad = self.shape.cache_length - self.length
        for name, t in self.tensors.items():
            t = t.to(device) if device is not None else t
            if pad and name.startswith(_TRIMMABLE):
                fill = -1 if name == "positions" else 0
                t = torch.cat((t, t.new_full((*t.shape[:2], pad, *t.shape[3:]), fill)), dim=2)
            out[name] = t
        return out

    def map(self, fn: TensorFn) -> LayerState:
        """A copy with `fn(name, tensor)` applied to every tensor."""
        tensors = {k: fn(k, v) for k, v in self.tensors.items()}
        batch = tensors["positions"].shape[0]
        return dataclasses.replace(self, tensors=tensors, shape=dataclasses.replace(self.shape, batch_size=batch))


@dataclass
class RecurrentLayerState:
    """One recurrent layer's state: `tensors` `{"conv", "ssm"}` of `RecurrentCache.state_tensors()`; `kind`
    the layer's (`"mamba2"`, `"gated_deltanet"`)."""

    shape: RecurrentShape
    tensors: dict[str, torch.Tensor]
    kind: str = RecurrentCache.kind
    config: None = None  # no cache config: `CacheState.configs` compares the attention layers' only

    def full_tensors(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The tensors as `RecurrentCache.load_state_tensors` expects them (on `device`)."""
        return {k: v if device is None else v.to(device) for k, v in self.tensors.items()}

    def map(self, fn: TensorFn) -> RecurrentLayerState:
        """A copy with `fn(name, tensor)` applied to every tensor."""
        tensors = {k: fn(k, v) for k, v in self.tensors.items()}
        shape = dataclasses.replace(self.shape, batch_size=tensors["ssm"].shape[0])
        return dataclasses.replace(self, tensors=tensors, shape=shape)


AnyLayerState = LayerState | RecurrentLayerState


def state_kind(layer: AnyLayerState) -> str:
    """`"attention"` or the recurrent kind (`"mamba2"`, `"gated_deltanet"`)."""
    return layer.kind if isinstance(layer, RecurrentLayerState) else ATTENTION


class CacheState:
    """The KV caches of a model, all layers, as a value (see the module docstring).

    Attributes:
        layers: one `LayerState` per layer.
        last_pos: `(B,)` int64 last position seen per row, or `None` (nothing seen).
        fingerprint: `{"model_config": sha256, "weights": sha256}` of the model it was taken from.
        dtype: the caches' float dtype.
        token_ids: per row, the token ids the state covers, when known (else `None`).
        last_hidden: `(B, n_embd)` final hidden state of each row's last token, when kept (else `None`).
    """

    def __init__(
        self,
        layers: list[AnyLayerState],
        last_pos: torch.Tensor | None,
        fingerprint: dict[str, str],
        dtype: torch.dtype,
        token_ids: list[list[int]] | None = None,
        last_hidden: torch.Tensor | None = None,
    ) -> None:
        if not layers:
            raise ValueError("a CacheState needs at least one layer")
        self.layers = layers
        self.last_pos = last_pos
        self.fingerprint = dict(fingerprint)
        self.dtype = dtype
        self.token_ids = token_ids
        self.last_hidden = last_hidden
        b = self.batch_size
        if token_ids is not None and len(token_ids) != b:
            raise ValueError(f"token_ids must have one list per row ({b}), got {len(token_ids)}")

    @property
    def batch_size(self) -> int:
        return _rows(self.layers[0])

    @property
    def kinds(self) -> list[str]:
        """One kind per layer (`"attention"`, `"mamba2"`, `"gated_deltanet"`)."""
        return [state_kind(layer) for layer in self.layers]

    @property
    def configs(self) -> list[KVCacheConfig]:
        return [layer.config for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes held by the state's tensors."""
        total = sum(t.nbytes for layer in self.layers for t in layer.tensors.values())
        extra = [t for t in (self.last_pos, self.last_hidden) if t is not None]
        return total + sum(t.nbytes for t in extra)

    def _replace(self, fn: TensorFn, token_ids: list[list[int]] | None) -> CacheState:
        """A new state with `fn(name, tensor)` applied to every tensor (layers, last_pos, last_hidden)."""
        layers = [layer.map(fn) for layer in self.layers]
        last_pos = None if self.last_pos is None else fn("last_pos", self.last_pos)
        hidden = None if self.last_hidden is None else fn("last_hidden", self.last_hidden)
        return CacheState(layers, last_pos, self.fingerprint, self.dtype, token_ids, hidden)

    def to(self, device: torch.device | str) -> CacheState:
        """A copy on `device`."""
        return self._replace(lambda _, t: t.to(device, copy=True), self.token_ids)

    def select(self, rows: Sequence[int]) -> CacheState:
        """A state whose rows are `rows` of this one (repeats allowed: fork a prefix into N continuations).

        Args:
            rows: row indices in `[0, batch_size)`, at least one.
        """
        b = self.batch_size
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        if not isinstance(rows, (list, tuple)) or not rows:
            raise ValueError(f"rows must be a non-empty list of row indices in [0, {b}), got {rows!r:.80}")
        for r in rows:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < b:
                raise ValueError(f"rows must be ints in [0, {b}) (the state has {b} rows), got {r!r}")
        rows = list(rows)
        ids = None if self.token_ids is None else [list(self.token_ids[r]) for r in rows]

        def pick(_: str, t: torch.Tensor) -> torch.Tensor:
            return t[torch.tensor(rows, device=t.device)]

        return self._replace(pick, ids)

    @classmethod
    def cat(cls, states: Sequence[CacheState]) -> CacheState:
        """One batch from the rows of several states (same model and cache configs; lengths may differ).

        Each row keeps its own slots and positions, so each continues as it would alone (up to the
        rounding of attending over more, masked, slots). `num_filled` is the largest of the states'.
        """
        if not states or not all(isinstance(s, CacheState) for s in states):
            raise TypeError(f"cat expects a non-empty list of CacheState, got {states!r:.80}")
        first = states[0]
        for i, s in enumerate(states[1:], start=1):
            _check_same(first, s, f"states[{i}]")
        if len(states) == 1:
            return first.to(next(iter(first.layers[0].tensors.values())).device)
        layers: list[AnyLayerState] = []
        for i, layer in enumerate(first.layers):
            parts = [s.layers[i] for s in states]
            if isinstance(layer, RecurrentLayerState):
                tensors = {name: torch.cat([p.tensors[name] for p in parts], dim=0) for name in layer.tensors}
                shape = dataclasses.replace(layer.shape, batch_size=tensors["ssm"].shape[0])
                layers.append(RecurrentLayerState(shape, tensors, layer.kind))
                continue
            if any(set(p.tensors) != set(layer.tensors) for p in parts):
                raise ValueError(f"cannot cat: layer {i} has policy state set in some states, not in others")
            fulls = [p.full_tensors() for p in parts]
            tensors = {name: torch.cat([f[name] for f in fulls], dim=0) for name in layer.tensors}
            shape = dataclasses.replace(layer.shape, batch_size=tensors["positions"].shape[0])
            num_filled = max(p.num_filled for p in parts)
            layers.append(LayerState(layer.config, shape, tensors, num_filled, layer.shape.cache_length))
        sizes = [s.batch_size for s in states]
        last_pos = _cat_optional([s.last_pos for s in states], sizes, -1)  # -1: a row that has seen nothing
        hidden = _cat_optional([s.last_hidden for s in states], sizes, None)
        ids = None if any(s.token_ids is None for s in states) else [r for s in states for r in s.token_ids]
        return cls(layers, last_pos, first.fingerprint, first.dtype, ids, hidden)

    # -- files ----------------------------------------------------------------------------------

    def save(
        self,
        path: str | Path,
        extra_metadata: dict[str, str] | None = None,
        entry: dict[str, object] | None = None,
        key: bytes | None = None,
    ) -> None:
        """Write the state to one safetensors file (tensors + JSON metadata with a checksum), atomically
        (`litkv.states.state_file.write_state_file`). `extra_metadata`: more string entries of the file's
        safetensors metadata, for the writer's own use (read back with `safe_open(...).metadata()`; not
        checksummed). `entry`: a store's proof of what the state is, inside the checksummed metadata
        (read back, verified, by `load_entry`). `key`: the secret whose HMAC of the checksum the file
        carries (`litkv.states.state_file.write_state_file`; a store's)."""
        write_state_file(path, self, extra_metadata, entry, key)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> CacheState:
        """Read a state written by `save` (safetensors only: nothing is unpickled), checked for meaning.

        Raises:
            FileNotFoundError: no such file.
            ValueError: `path` is a directory.
            ValueError: one line, for a file that is not a litkv cache state, has another format version,
                is truncated, was modified (checksum mismatch), or holds a state no cache could be in.
        """
        return cls.load_entry(path, device)[0]

    @classmethod
    def load_entry(
        cls, path: str | Path, device: torch.device | str | None = None, key: bytes | None = None
    ) -> tuple[CacheState, object]:
        """`load`, and the `entry` the file was saved with (`None` without one), verified by the checksum
        and, with `key`, by the file's mac under it (a file without one, or with another, is refused)."""
        tensors, meta = read_state_file(path, key)
        try:
            state = _from_file(tensors, meta)
            validate_state(state)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"cache state file {str(path)!r} has invalid metadata: {one_line(err)}") from None
        return (state if device is None else state.to(device)), meta.get("entry")


def _rows(layer: AnyLayerState) -> int:
    return layer.tensors["ssm" if isinstance(layer, RecurrentLayerState) else "positions"].shape[0]


def _cat_optional(parts: list[torch.Tensor | None], sizes: list[int], fill: int | None) -> torch.Tensor | None:
    """`parts` (batch first) concatenated; a missing part is `fill`ed, or the result is `None` without a fill."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts) and fill is None:
        return None  # last_hidden is kept only when every state has it
    ref = next(p for p in parts if p is not None)
    full = [p if p is not None else ref.new_full((n, *ref.shape[1:]), fill) for p, n in zip(parts, sizes, strict=True)]
    return torch.cat(full, dim=0)


def _check_same(a: CacheState, b: CacheState, what: str) -> None:
    if a.kinds != b.kinds:
        raise ValueError(f"{what} has layer kinds {b.kinds}, the first state {a.kinds}")
    if a.fingerprint != b.fingerprint:
        raise ValueError(f"{what} was taken from another model (fingerprint {b.fingerprint} != {a.fingerprint})")
    if a.configs != b.configs or a.dtype != b.dtype:
        raise ValueError(f"{what} has other cache configs or dtype ({b.configs[0]}, {b.dtype}) than the first state")


# -- snapshot / restore ---------------------------------------------------------------------------

_WARNED: set[type] = set()


def _layer_snapshot(cache: SlotMachine, device: torch.device | str | None) -> LayerState:
    cls = type(cache.policy)
    if cls.update_state is not Policy.update_state and not (cls.slot_state or cls.row_state) and cls not in _WARNED:
        _WARNED.add(cls)
        warnings.warn(
            f"{cls.__name__} overrides update_state but declares no slot_state/row_state: its own state is not "
            "part of snapshots, files or the undo log",
            stacklevel=3,
        )
    trimmed = cache.storage.lossless and cache.num_filled < cache.cache_length
    length = cache.num_filled if trimmed else cache.cache_length
    tensors = {}
    for name, t in cache.state_tensors().items():
        if trimmed and name.startswith(_TRIMMABLE):
            t = t[:, :, :length]
        tensors[name] = t.detach().to(device, copy=True)
    return LayerState(cache.config, cache.shape, tensors, cache.num_filled, length)


@torch.no_grad()
def snapshot(
    model: GPT, device: torch.device | str | None = None, token_ids: list[list[int]] | None = None
) -> CacheState:
    """A copy of the attached caches' state (all layers) and of `model.last_pos`.

    Args:
        model: a GPT with caches attached.
        device: where the copy lives (default: where the caches are; `"cpu"` for a host copy).
        token_ids: per row, the token ids the state covers (kept in the state and its file).
    """
    caches = attached_caches(model)
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"snapshot device {device!r} is not a torch device: {one_line(err)}") from None
    layers = [
        RecurrentLayerState(
            cache.shape, {k: v.detach().to(device, copy=True) for k, v in cache.state_tensors().items()}, cache.kind
        )
        if isinstance(cache, RecurrentCache)
        else _layer_snapshot(cache, device)
        for cache in caches
    ]
    last_pos = None if model.last_pos is None else model.last_pos.to(device, copy=True)
    return CacheState(layers, last_pos, model_fingerprint(model), caches[0].dtype, token_ids)


def _check_model(model: GPT, state: CacheState) -> None:
    kinds = list(layer_kinds(model.config))
    if state.kinds != kinds and set(state.kinds) | set(kinds) != {ATTENTION}:  # (layer counts: checked below)
        raise ValueError(
            f"the cache state has layer kinds {state.kinds}, the model {kinds}: it was taken from another model"
        )
    fp = model_fingerprint(model)
    if fp["model_config"] != state.fingerprint.get("model_config"):
        raise ValueError(
            f"the cache state was taken from a model with another config ({model.config.name!r} does not match "
            f"its fingerprint {state.fingerprint.get('model_config', '?')[:12]})"
        )
    if fp["weights"] != state.fingerprint.get("weights"):
        raise ValueError("the cache state was taken from a model with other weights (or another dtype)")
    learned = any(isinstance(layer, LayerState) and layer.config.policy == "learned" for layer in state.layers)
    if learned and fp.get("eviction_gates") != state.fingerprint.get("eviction_gates"):
        raise ValueError("the cache state holds `learned` caches scored by other eviction gates than the model's")
    if len(state.layers) != model.config.n_layer:
        raise ValueError(f"the cache state has {len(state.layers)} layers, the model {model.config.n_layer}")
    check_token_ids(state, model.config.vocab_size)


@torch.no_grad()
def restore(model: GPT, state: CacheState) -> list[SlotMachine | RecurrentCache]:
    """Set the model's caches to `state` (bitwise) and `model.last_pos` to the state's.

    The attached caches are reused when they have the state's configs, batch size and dtype; otherwise
    fresh ones are built and attached. An undo log kept on the model is emptied (its history is gone).

    Raises:
        ValueError: the state was taken from a model with another config or other weights.

    Returns:
        The attached caches.
    """
    if not isinstance(state, CacheState):
        raise TypeError(f"state must be a CacheState, got {type(state).__name__}")
    _check_model(model, state)
    log = undo_log_of(model)
    caches = list(model.kv_caches)
    device = model.lm_head.weight.device
    reuse = all(_fits(c, layer, state.dtype) for c, layer in zip(caches, state.layers, strict=True))
    if not reuse:
        caches = [_fresh_cache(layer, device, state.dtype) for layer in state.layers]
        model.set_kv_caches(caches)
    with writing_mode(caches):
        for cache, layer in zip(caches, state.layers, strict=True):
            if isinstance(cache, RecurrentCache):
                cache.load_state_tensors(layer.full_tensors(cache.device))
                continue
            cache.abort_call()  # a call interrupted between attend_inputs and evict_and_store
            cache.load_state_tensors(layer.full_tensors(cache.positions.device), layer.num_filled)  # type: ignore[call-arg]
    model.last_pos = None if state.last_pos is None else state.last_pos.to(device, copy=True)
    if log is not None:
        log.attach(model.caches)
    return caches  # type: ignore[return-value]


def _fits(cache: object, layer: AnyLayerState, dtype: torch.dtype) -> bool:
    """Whether an attached layer cache can take `layer`'s state in place."""
    if isinstance(layer, RecurrentLayerState):
        return (
            isinstance(cache, RecurrentCache)
            and cache.kind == layer.kind
            and cache.shape == layer.shape
            and cache.dtype == dtype
        )
    return (
        isinstance(cache, SlotMachine)
        and cache.config == layer.config
        and cache.shape == layer.shape
        and cache.dtype == dtype
    )


def _fresh_cache(layer: AnyLayerState, device: torch.device, dtype: torch.dtype) -> SlotMachine | RecurrentCache:
    if isinstance(layer, RecurrentLayerState):
        return RecurrentCache(layer.shape, device, dtype, kind=layer.kind)
    return layer.config.make_cache(layer.shape, device, dtype)


# -- files ----------------------------------------------------------------------------------------


def _from_file(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> CacheState:
    """The state described by a file's metadata (`litkv.states.state_file.encode`) and its tensors."""
    dtype = getattr(torch, str(meta["dtype"]))
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {meta['dtype']!r}")
    layers: list[AnyLayerState] = []
    for i, entry in enumerate(meta["layers"]):
        prefix = f"layer.{i}."
        layer_tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if entry.get("kind", ATTENTION) != ATTENTION:
            if entry["kind"] not in RECURRENT_STATE_KINDS:
                raise ValueError(
                    f"layer {i} has kind {entry['kind']!r}; litkv knows {(ATTENTION, *RECURRENT_STATE_KINDS)}"
                )
            layers.append(RecurrentLayerState(RecurrentShape(**entry["shape"]), layer_tensors, entry["kind"]))
            continue
        config = KVCacheConfig(**entry["config"])
        shape = CacheShape(**entry["shape"])
        layers.append(LayerState(config, shape, layer_tensors, int(entry["num_filled"]), int(entry["length"])))
    token_ids = meta.get("token_ids")
    fingerprint = meta["fingerprint"]
    return CacheState(layers, tensors.get("last_pos"), fingerprint, dtype, token_ids, tensors.get("last_hidden"))
