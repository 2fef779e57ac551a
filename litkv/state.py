"""Cache state: the KV caches of a model (all layers) as a value that can be taken and given back.

A `CacheState` holds, per layer, what `KVCache.state_tensors()` returns (slot positions, storage
tensors, the policy's per-slot and per-row state) and the host counter `num_filled`, plus the last
position of each row (`GPT.last_pos`). On it are built:

- `snapshot(model)` / `restore(model, state)`: copy out and back in, bitwise;
- `CacheState.select(rows)` / `CacheState.cat(states)`: fork rows, merge rows of different lengths;
- `CacheState.save(path)` / `CacheState.load(path)`: safetensors + JSON metadata (format version,
  model fingerprint, cache configs, token ids, checksum); nothing is unpickled;
- `keep_undo_log(model, depth)` and `truncate(model, n)` (in `litkv.undo`): roll back the last `n`
  tokens of each row (exact for dense caches; for others exact within the undo log of `depth` calls).

A custom policy that declares its state (`slot_state`, `row_state`) gets all of this. See docs/state.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from litkv.config import KVCacheConfig
from litkv.kvcache.base import KVCache
from litkv.kvcache.registry import check_policy_loadable
from litkv.kvcache.storage import CacheShape
from litkv.model import GPT
from litkv.state_checks import check_token_ids, validate_state
from litkv.undo import UndoLog, attached_caches, keep_undo_log, truncate, undo_log_of, writing_mode

__all__ = [
    "CacheState",
    "LayerState",
    "StateLRU",
    "UndoLog",
    "keep_undo_log",
    "model_fingerprint",
    "restore",
    "snapshot",
    "truncate",
]

FORMAT = "litkv-cache-state"
FORMAT_VERSION = 1
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
        tensors: `KVCache.state_tensors()` copies. "positions" and "storage.*" may hold only the first
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
        layers: list[LayerState],
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
        return self.layers[0].tensors["positions"].shape[0]

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
            return first.to(first.layers[0].tensors["positions"].device)
        layers = []
        for i, layer in enumerate(first.layers):
            parts = [s.layers[i] for s in states]
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

    def save(self, path: str | Path, extra_metadata: dict[str, str] | None = None) -> None:
        """Write the state to one safetensors file (tensors + JSON metadata with a checksum), atomically
        (`litkv.atomic.write_atomic`). `extra_metadata`: more string entries of the file's safetensors
        metadata, for the writer's own use (read back with `safe_open(...).metadata()`; not checksummed)."""
        from safetensors.torch import save_file

        from litkv.atomic import write_atomic

        tensors, meta = _to_file(self)
        meta["digest"] = _digest(meta, tensors)
        extra = dict(extra_metadata or {})
        if "litkv" in extra or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise ValueError(f"extra_metadata must map str to str and not use the key 'litkv', got {extra!r:.200}")
        metadata = {**extra, "litkv": json.dumps(meta, sort_keys=True)}
        write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> CacheState:
        """Read a state written by `save` (safetensors only: nothing is unpickled).

        Raises:
            FileNotFoundError: no such file.
            ValueError: `path` is a directory.
            ValueError: one line, for a file that is not a litkv cache state, has another format version,
                is truncated, or was modified (checksum mismatch).
        """
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"cache state path {str(path)!r} is a directory, not a cache state file")
        if not path.is_file():
            raise FileNotFoundError(f"cache state file {str(path)!r} does not exist")
        tensors, meta = _read_file(path)
        expected = meta.pop("digest", None)
        if expected != _digest(meta, tensors):
            raise ValueError(f"cache state file {str(path)!r} is corrupt or was modified (checksum mismatch)")
        _check_policies_loadable(meta, f"cache state file {str(path)!r}")
        try:
            state = _from_file(tensors, meta)
            validate_state(state)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"cache state file {str(path)!r} has invalid metadata: {_one_line(err)}") from None
        return state if device is None else state.to(device)


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
    if a.fingerprint != b.fingerprint:
        raise ValueError(f"{what} was taken from another model (fingerprint {b.fingerprint} != {a.fingerprint})")
    if a.configs != b.configs or a.dtype != b.dtype:
        raise ValueError(f"{what} has other cache configs or dtype ({b.configs[0]}, {b.dtype}) than the first state")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


# -- memory of states ------------------------------------------------------------------------------


class StateLRU:
    """Cache states by key, at most `max_bytes` bytes of tensors (`CacheState.nbytes`) in all; the least
    recently used go first (the memory of the prefix store and of the server's conversation store).

    Attributes:
        nbytes: bytes of the states held.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._states: OrderedDict[str, CacheState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: object) -> bool:
        return key in self._states

    def get(self, key: str) -> CacheState | None:
        """The state under `key`, marked most recently used; `None` when there is none."""
        state = self._states.get(key)
        if state is not None:
            self._states.move_to_end(key)
        return state

    def put(self, key: str, state: CacheState) -> bool:
        """Keep `state` under `key` (replacing what was there), then drop the least recently used states
        until the total fits. Returns False, keeping nothing, for a state larger than `max_bytes`."""
        old = self._states.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes()
        size = state.nbytes()
        if size > self.max_bytes:
            return False
        self._states[key] = state
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, dropped = self._states.popitem(last=False)
            self.nbytes -= dropped.nbytes()
        return True

    def clear(self) -> None:
        """Forget every state."""
        self._states.clear()
        self.nbytes = 0


# -- model fingerprint ----------------------------------------------------------------------------

_WEIGHT_HASHES: weakref.WeakKeyDictionary[GPT, tuple[tuple[int, ...], str]] = weakref.WeakKeyDictionary()


_K = 1024  # a parameter's digest works on rows of this many elements


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# odd 64-bit multipliers (golden ratio and another odd constant, as signed int64)
_MUL, _ADD = -7046029254386353131, 7155164730210238489


def _parameter_digest(p: torch.Tensor) -> torch.Tensor:
    """`()` int64: sum over the elements of `bits_i * m_i` mod 2^64, with `m_i` an odd multiplier per position.

    Computed where the parameter lives (no copy to the host; integer arithmetic, so the same value on
    every device and in any reduction order). Any change to any single element changes it: its bit
    pattern changes by `d != 0`, the sum by `d * m_i`, and an odd `m_i` is invertible mod 2^64. The
    multiplier of position `i = r * K + k` is `col[k] * row[r]`, a product of two odd numbers.
    """
    flat = p.detach().contiguous().reshape(-1)
    bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % _K)).view(-1, _K)
    col = _odd(torch.arange(_K, dtype=torch.int64, device=flat.device), 0)
    row = _odd(torch.arange(bits.shape[0], dtype=torch.int64, device=flat.device), 1)
    return ((bits * col).sum(dim=1) * row).sum()


def _odd(index: torch.Tensor, salt: int) -> torch.Tensor:
    """An odd int64 per index (a multiplicative hash of it, wrapping mod 2^64)."""
    return (index * _MUL + (_ADD + salt)).bitwise_or_(1)


def model_fingerprint(model: GPT) -> dict[str, str]:
    """`{"model_config": sha256 of the config, "weights": sha256 of names, shapes, dtypes and each
    parameter's `_parameter_digest` (every element counts)}`, plus `"eviction_gates"` (sha256 of the
    gates' tensors, window and sinks) when the model has gates.

    Memoised until a parameter changes (version counter or storage); a model with inference tensors
    (built under `torch.inference_mode`, no version counter) is hashed at every call.
    """
    cfg = {k: v for k, v in dataclasses.asdict(model.config).items() if k not in ("name", "hf_config")}
    config_hash = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
    params = list(model.named_parameters())
    versions = tuple(-1 if p.is_inference() else p._version for _, p in params) + tuple(p.data_ptr() for _, p in params)
    cached = _WEIGHT_HASHES.get(model)
    if cached is None or cached[0] != versions or -1 in versions:
        h = hashlib.sha256()
        with torch.no_grad():
            digests = torch.stack([_parameter_digest(p).cpu() for _, p in params]) if params else torch.zeros(0)
        for (name, p), digest in zip(params, digests.tolist(), strict=True):
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{digest};".encode())
        cached = (versions, h.hexdigest())
        _WEIGHT_HASHES[model] = cached
    out = {"model_config": config_hash, "weights": cached[1]}
    gates = model.eviction_gates  # the `learned` policy's scores depend on them
    if gates is not None:
        h = hashlib.sha256(f"{tuple(gates.weight.shape)}:{gates.window}:{gates.sinks};".encode())
        for tensor in (gates.weight, gates.bias):
            h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        out["eviction_gates"] = h.hexdigest()
    return out


# -- snapshot / restore ---------------------------------------------------------------------------

_WARNED: set[type] = set()


def _layer_snapshot(cache: KVCache, device: torch.device | str | None) -> LayerState:
    cls = type(cache)
    if cls.after_write is not KVCache.after_write and not (cls.slot_state or cls.row_state) and cls not in _WARNED:
        _WARNED.add(cls)
        warnings.warn(
            f"{cls.__name__} overrides after_write but declares no slot_state/row_state: its own state is not "
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
            raise ValueError(f"snapshot device {device!r} is not a torch device: {_one_line(err)}") from None
    layers = [_layer_snapshot(cache, device) for cache in caches]
    last_pos = None if model.last_pos is None else model.last_pos.to(device, copy=True)
    return CacheState(layers, last_pos, model_fingerprint(model), caches[0].dtype, token_ids)


def _check_model(model: GPT, state: CacheState) -> None:
    fp = model_fingerprint(model)
    if fp["model_config"] != state.fingerprint.get("model_config"):
        raise ValueError(
            f"the cache state was taken from a model with another config ({model.config.name!r} does not match "
            f"its fingerprint {state.fingerprint.get('model_config', '?')[:12]})"
        )
    if fp["weights"] != state.fingerprint.get("weights"):
        raise ValueError("the cache state was taken from a model with other weights (or another dtype)")
    learned = any(layer.config.policy == "learned" for layer in state.layers)
    if learned and fp.get("eviction_gates") != state.fingerprint.get("eviction_gates"):
        raise ValueError("the cache state holds `learned` caches scored by other eviction gates than the model's")
    if len(state.layers) != model.config.n_layer:
        raise ValueError(f"the cache state has {len(state.layers)} layers, the model {model.config.n_layer}")
    check_token_ids(state, model.config.vocab_size)


@torch.no_grad()
def restore(model: GPT, state: CacheState) -> list[KVCache]:
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
    reuse = all(
        isinstance(c, KVCache) and c.config == layer.config and c.shape == layer.shape and c.dtype == state.dtype
        for c, layer in zip(caches, state.layers, strict=True)
    )
    if not reuse:
        caches = [layer.config.policy_class(layer.config, layer.shape, device, state.dtype) for layer in state.layers]
        model.set_kv_caches(caches)
    with writing_mode(caches):
        for cache, layer in zip(caches, state.layers, strict=True):
            cache.abort_call()  # a call interrupted between attend_inputs and evict_and_store
            cache.load_state_tensors(layer.full_tensors(cache.positions.device), layer.num_filled)
    model.last_pos = None if state.last_pos is None else state.last_pos.to(device, copy=True)
    if log is not None:
        log.attach(model.caches)
    return caches  # type: ignore[return-value]


# -- files ----------------------------------------------------------------------------------------


def _to_file(state: CacheState) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(state.layers):
        for name, t in layer.tensors.items():
            tensors[f"layer.{i}.{name}"] = t.detach().cpu().contiguous()
        layers.append(
            {
                "config": dataclasses.asdict(layer.config),
                "shape": dataclasses.asdict(layer.shape),
                "num_filled": layer.num_filled,
                "length": layer.length,
            }
        )
    for name in ("last_pos", "last_hidden"):
        value = getattr(state, name)
        if value is not None:
            tensors[name] = value.detach().cpu().contiguous()
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "fingerprint": state.fingerprint,
        "dtype": str(state.dtype).removeprefix("torch."),
        "layers": layers,
        "token_ids": state.token_ids,
    }
    return tensors, meta


def _digest(meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as err:  # safetensors raises its own error types for truncated or garbled files
        raise ValueError(
            f"cache state file {str(path)!r} is not a readable safetensors file (truncated or corrupt): "
            f"{_one_line(err)}"
        ) from None
    try:
        meta = json.loads(header["litkv"])
    except (KeyError, json.JSONDecodeError):
        raise ValueError(f"{str(path)!r} is a safetensors file but not a litkv cache state (no metadata)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a litkv cache state (format {meta.get('format')!r})")
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"cache state file {str(path)!r} has format version {meta.get('version')!r}; this litkv reads "
            f"version {FORMAT_VERSION}"
        )
    return tensors, meta


def _check_policies_loadable(meta: dict[str, object], source: str) -> None:
    """ValueError unless every policy the metadata names is loadable without an import (before any
    `KVCacheConfig` is built from it: building one resolves its policy)."""
    layers = meta.get("layers")
    if not isinstance(layers, list):
        raise ValueError(f"{source} has invalid metadata: 'layers' must be a list")
    for i, entry in enumerate(layers):
        config = entry.get("config") if isinstance(entry, dict) else None
        if not isinstance(config, dict):
            raise ValueError(f"{source} has invalid metadata: layer {i} has no config")
        check_policy_loadable(config.get("policy"), f"{source} (layer {i})")


def _from_file(tensors: dict[str, torch.Tensor], meta: dict[str, object]) -> CacheState:
    dtype = getattr(torch, str(meta["dtype"]))
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {meta['dtype']!r}")
    layers = []
    for i, entry in enumerate(meta["layers"]):  # type: ignore[union-attr]
        prefix = f"layer.{i}."
        layer_tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        config = KVCacheConfig(**entry["config"])
        shape = CacheShape(**entry["shape"])
        layers.append(LayerState(config, shape, layer_tensors, int(entry["num_filled"]), int(entry["length"])))
    token_ids = meta.get("token_ids")
    fingerprint = meta["fingerprint"]
    return CacheState(layers, tensors.get("last_pos"), fingerprint, dtype, token_ids, tensors.get("last_hidden"))
