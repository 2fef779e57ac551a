"""The cache-state file format: one safetensors file (tensors) with JSON metadata (what they mean).

The metadata (safetensors key `"litkv"`) holds the format name and version, the model fingerprint,
the cache dtype, per layer the cache config, `CacheShape`, `num_filled` and stored length, the token
ids, and a sha256 checksum over the metadata and every tensor's bytes; a file a store writes also
carries `"mac"`, an HMAC-SHA256 of that checksum under a key its directory does not hold
(`litkv.core.secret`), which the store requires on reading. Nothing is unpickled; a policy
a file names must already be loadable (`check_policy_loadable`) before any config is built from it.
`litkv.states.state` turns what `read_state_file` returns into a `CacheState` (and checks its meaning with
`litkv.states.state_checks`); `read_state_header` reads the metadata alone, without a tensor, so that a store
can refuse an entry before reading or allocating anything. See docs/state.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from litkv.core.atomic import write_atomic
from litkv.core.secret import mac, macs_equal
from litkv.kvcache.registry import check_policy_loadable
from litkv.kvcache.storage import CacheShape

__all__ = ["FORMAT", "FORMAT_VERSION", "read_state_file", "read_state_header", "write_state_file"]

FORMAT = "litkv-cache-state"
#: Version 2: int8 storage holds its codes biased (the byte read as int8 is the code - 128, so integer
#: products read them in place); version 1 files are read unless they hold int8 storage.
FORMAT_VERSION = 2
#: Safetensors metadata key of the litkv JSON metadata.
META_KEY = "litkv"
#: What a state file's mac authenticates (`litkv.core.secret.mac`).
MAC_PURPOSE = "cache-state"


class _Layer(Protocol):
    """What is written of one layer of a `litkv.states.state.LayerState`."""

    config: Any  # a KVCacheConfig (a dataclass)
    shape: CacheShape
    tensors: dict[str, torch.Tensor]
    num_filled: int
    length: int


class _State(Protocol):
    """What is written of a `litkv.states.state.CacheState`."""

    layers: Sequence[_Layer]
    last_pos: torch.Tensor | None
    last_hidden: torch.Tensor | None
    fingerprint: dict[str, str]
    dtype: torch.dtype
    token_ids: list[list[int]] | None


def one_line(err: BaseException) -> str:
    """An error's message on one line (its type name when it has none)."""
    return " ".join(str(err).split()) or type(err).__name__


def encode(state: _State) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The file's tensors (on the host, contiguous) and its metadata (without the checksum)."""
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(state.layers):
        for name, t in layer.tensors.items():
            tensors[f"layer.{i}.{name}"] = t.detach().cpu().contiguous()
        kind = getattr(layer, "kind", "attention")
        if kind != "attention":  # a recurrent layer: its kind and sizes (attention entries have no kind)
            layers.append({"kind": kind, "config": {"kind": kind}, "shape": dataclasses.asdict(layer.shape)})
            continue
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


def digest(meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the metadata (sorted JSON) and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_state_file(
    path: str | Path,
    state: _State,
    extra_metadata: dict[str, str] | None = None,
    entry: dict[str, object] | None = None,
    key: bytes | None = None,
) -> None:
    """Write `state` to `path` atomically (`litkv.core.atomic.write_atomic`); `extra_metadata`: more string
    entries of the file's safetensors metadata, for the writer's own use (not checksummed); `entry`: a
    store's proof of what the state is (its key, the tokens it covers), kept in the litkv metadata as
    `"entry"` and so covered by the checksum (a relabelled file fails it); `key`: the secret whose
    HMAC of the checksum the file carries as `"mac"` (a store's: only a holder of the key can write an
    entry the store accepts)."""
    from safetensors.torch import save_file

    tensors, meta = encode(state)
    if entry is not None:
        meta["entry"] = entry
    meta["digest"] = digest(meta, tensors)
    if key is not None:
        meta["mac"] = mac(key, MAC_PURPOSE, meta["digest"])  # type: ignore[arg-type]
    extra = dict(extra_metadata or {})
    if META_KEY in extra or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise ValueError(f"extra_metadata must map str to str and not use the key 'litkv', got {extra!r:.200}")
    metadata = {**extra, META_KEY: json.dumps(meta, sort_keys=True)}
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def _check_path(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"cache state path {str(path)!r} is a directory, not a cache state file")
    if not path.is_file():
        raise FileNotFoundError(f"cache state file {str(path)!r} does not exist")


def _parse_meta(path: Path, header: dict[str, str]) -> dict[str, Any]:
    try:
        meta = json.loads(header[META_KEY])
    except (KeyError, json.JSONDecodeError):
        raise ValueError(f"{str(path)!r} is a safetensors file but not a litkv cache state (no metadata)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{str(path)!r} is not a litkv cache state (format {found!r})")
    version = meta.get("version")
    if version not in (1, FORMAT_VERSION):
        raise ValueError(
            f"cache state file {str(path)!r} has format version {version!r}; this litkv reads "
            f"versions 1 and {FORMAT_VERSION}"
        )
    if version == 1 and any(_storage(layer) == "int8" for layer in meta.get("layers") or []):
        raise ValueError(
            f"cache state file {str(path)!r} (format version 1) holds int8 storage, whose codes version "
            f"{FORMAT_VERSION} stores differently: compute the state again"
        )
    return meta


def _storage(layer: object) -> object:
    config = layer.get("config") if isinstance(layer, dict) else None
    return config.get("storage") if isinstance(config, dict) else None


def _open(path: Path, with_tensors: bool) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()} if with_tensors else {}  # noqa: SIM118
    except Exception as err:  # safetensors raises its own error types for truncated or garbled files
        raise ValueError(
            f"cache state file {str(path)!r} is not a readable safetensors file (truncated or corrupt): {one_line(err)}"
        ) from None
    return header, tensors


def read_state_header(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The litkv metadata of a state file (not yet checked against its checksum) and the writer's own
    string entries (`extra_metadata`), without reading a tensor.

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line, for a directory, a file that is not a litkv cache state or another version.
    """
    path = Path(path)
    _check_path(path)
    header, _ = _open(path, with_tensors=False)
    meta = _parse_meta(path, header)
    return meta, {k: v for k, v in header.items() if k != META_KEY}


def read_state_file(path: str | Path, key: bytes | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and metadata (checksum and mac removed) of a state file, checked: format, version,
    checksum, its mac under `key` (when given: a file without one, or with another, is refused) and
    every policy it names loadable without an import.

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line, for a directory, a file that is not a litkv cache state, has another format
            version, is truncated, was modified (checksum mismatch) or names a policy not loadable.
    """
    path = Path(path)
    _check_path(path)
    header, tensors = _open(path, with_tensors=True)
    meta = _parse_meta(path, header)
    expected, recorded_mac = meta.pop("digest", None), meta.pop("mac", None)
    if expected != digest(meta, tensors):
        raise ValueError(f"cache state file {str(path)!r} is corrupt or was modified (checksum mismatch)")
    if key is not None and not macs_equal(recorded_mac, mac(key, MAC_PURPOSE, expected)):
        what = "carries no mac" if recorded_mac is None else "carries a mac this store's key did not make"
        raise ValueError(
            f"cache state file {str(path)!r} {what}: not written by this store (forged, or another user's); "
            "not authenticated"
        )
    _check_policies_loadable(meta, f"cache state file {str(path)!r}")
    return tensors, meta


def _check_policies_loadable(meta: dict[str, Any], source: str) -> None:
    """ValueError unless every policy the metadata names is loadable without an import (before any
    `KVCacheConfig` is built from it: building one resolves its policy)."""
    layers = meta.get("layers")
    if not isinstance(layers, list):
        raise ValueError(f"{source} has invalid metadata: 'layers' must be a list")
    for i, entry in enumerate(layers):
        if isinstance(entry, dict) and entry.get("kind", "attention") != "attention":
            continue  # a recurrent layer names no policy
        config = entry.get("config") if isinstance(entry, dict) else None
        if not isinstance(config, dict):
            raise ValueError(f"{source} has invalid metadata: layer {i} has no config")
        check_policy_loadable(config.get("policy"), f"{source} (layer {i})")
