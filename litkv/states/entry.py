"""What a stored cache state must prove before it is restored: its entry (key, tokens, token ids) and
its source (the model's weights and the exact caches, `EntryCheck`).

A store (`litkv.states.state_store`) writes the entry into the state file's checksummed metadata
(`CacheState.save(..., entry=...)`) and compares it, and the file's metadata, with the request's on
every read from disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.storage import CacheShape
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT, kv_cache_configs

__all__ = ["EntryCheck", "entry_problem", "ids_digest"]


def ids_digest(ids: Sequence[int] | torch.Tensor) -> str:
    """sha256 of token ids (as little-endian int64): what a store entry records of the tokens it covers."""
    host = torch.as_tensor(ids).detach().to("cpu", torch.int64).reshape(-1)
    return hashlib.sha256(host.numpy().astype("<i8").tobytes()).hexdigest()


def _json_form(value: object) -> object:
    """`value` as it reads back from the JSON metadata of a state file (tuples become lists)."""
    return json.loads(json.dumps(value, default=str))


def _difference(what: str, got: object, expected: dict[str, Any]) -> str | None:
    """One line naming the first field where `got` differs from `expected`; `None` when they are equal."""
    if not isinstance(got, dict):
        return f"{what} is {str(got)[:80]}, expected {expected}"
    for name in sorted(set(got) | set(expected)):
        if got.get(name) != expected.get(name):
            return f"{what}.{name} is {str(got.get(name))[:80]}, expected {str(expected.get(name))[:80]}"
    return None


@dataclass(frozen=True)
class EntryCheck:
    """What a stored state must be to be restored: taken from this model (every weight, the eviction
    gates) with exactly these caches (per layer: config and shape) of this dtype.

    Build one with `EntryCheck.of(model, kv_cache)`.
    """

    fingerprint: dict[str, str]
    configs: tuple[dict[str, Any], ...]
    shapes: tuple[dict[str, Any], ...]
    dtype: str

    @classmethod
    def of(
        cls,
        model: GPT,
        kv_cache: KVCacheConfig | Sequence[KVCacheConfig],
        dtype: torch.dtype | None = None,
        batch_size: int = 1,
    ) -> EntryCheck:
        """The check for states of `model` with caches of `kv_cache` (one config, or one per layer), of
        `dtype` (default: the model's) and `batch_size` rows.

        The configs and shapes are those of the caches `model.build_kv_caches` makes (a policy may
        adjust its config, as `qh2o` picks int4 storage for "float"), built on the meta device: nothing
        is allocated.
        """
        dtype = model.lm_head.weight.dtype if dtype is None else dtype
        configs, shapes = _built_caches(model, kv_cache, batch_size, dtype)
        return cls(
            fingerprint=model_fingerprint(model),
            configs=tuple(
                _json_form(dataclasses.asdict(cfg)) if dataclasses.is_dataclass(cfg) else cfg for cfg in configs
            ),  # type: ignore[misc]
            shapes=tuple(_json_form(dataclasses.asdict(s)) for s in shapes),  # type: ignore[misc]
            dtype=str(dtype).removeprefix("torch."),
        )

    def mismatch(self, meta: dict[str, Any]) -> str | None:
        """One line naming what a state file's metadata claims that differs from this check, or `None`."""
        if meta.get("fingerprint") != self.fingerprint:
            return "the state was taken from another model (other config, weights or eviction gates)"
        if meta.get("dtype") != self.dtype:
            return f"the state's dtype is {meta.get('dtype')!r}, expected {self.dtype!r}"
        layers = meta.get("layers")
        if not isinstance(layers, list) or len(layers) != len(self.configs):
            found = len(layers) if isinstance(layers, list) else layers
            return f"the state has {found} layers, expected {len(self.configs)}"
        for i, (entry, config, shape) in enumerate(zip(layers, self.configs, self.shapes, strict=True)):
            entry = entry if isinstance(entry, dict) else {}
            problem = _difference(f"layer {i} config", entry.get("config"), config) or _difference(
                f"layer {i} shape", entry.get("shape"), shape
            )
            if problem:
                return problem
        return None


def _built_caches(
    model: GPT, kv_cache: KVCacheConfig | Sequence[KVCacheConfig], batch_size: int, dtype: torch.dtype
) -> tuple[list[KVCacheConfig], list[CacheShape]]:
    """The configs and shapes of the caches `model.build_kv_caches` makes, built on the meta device (a
    custom policy that cannot be built there: the configs as given, the shapes the model gives them)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a policy's warnings were given when the run's caches were built
            caches = model.build_kv_caches(kv_cache, batch_size, device=torch.device("meta"), dtype=dtype)
        # a recurrent layer has no cache config: its entry names its kind (`litkv.states.state_file.encode`)
        configs = [cache.config if cache.config is not None else {"kind": cache.kind} for cache in caches]
        return configs, [cache.shape for cache in caches]  # type: ignore[return-value]
    except (RuntimeError, NotImplementedError):
        configs = kv_cache_configs(kv_cache) or [kv_cache] * model.config.n_layer  # type: ignore[list-item]
        c = model.config
        shapes = [CacheShape(batch_size, c.n_query_groups, k.cache_length, c.head_size, c.head_size) for k in configs]
        return configs, shapes


def entry_problem(entry: object, key: str, tokens: int | None, digest: str | None) -> str | None:
    """One line naming how a file's entry differs from the request (key, tokens, token ids), or `None`."""
    if not isinstance(entry, dict) or entry.get("key") != key:
        found = entry.get("key") if isinstance(entry, dict) else entry
        return f"the entry does not prove key {key[:16]}...: it holds {str(found)[:80]}"
    if tokens is not None and entry.get("tokens") != tokens:
        return f"the entry covers {entry.get('tokens')} tokens, expected {tokens}"
    if digest is not None and entry.get("ids_sha256") != digest:
        return "the entry was taken over other token ids than the request's"
    return None
