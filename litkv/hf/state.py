"""What `litkv.hf.Cache` checks of its configs, and its state as a `litkv.CacheState` (snapshot, restore, the
transformers model's fingerprint): "compress once, ask many" through litkv's own state value."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from litkv.gates.gate import EvictionGates
from litkv.kvcache.caches import KVCaches
from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.machine import SlotMachine
from litkv.modeling.fingerprint import _parameter_digest, gates_fingerprint
from litkv.states.state import CacheState, LayerState, _layer_snapshot
from litkv.states.undo import writing_mode

__all__ = ["check_configs", "hf_fingerprint", "restore_caches", "snapshot_caches"]


def check_configs(configs: Sequence[KVCacheConfig], n_layer: int, gates: bool = False) -> None:
    """TypeError / ValueError in one line unless `configs` are one `KVCacheConfig` per layer that litkv.hf runs: a
    policy that reads eviction gates (`learned`) only with `gates` given (`litkv.hf.Cache(..., gates=...)`), and
    `gates` only for such a policy."""
    if len(configs) != n_layer:
        raise ValueError(f"expected one KVCacheConfig per layer ({n_layer}), got {len(configs)}")
    if gates and not any(isinstance(c, KVCacheConfig) and c.policy_class.needs_gates for c in configs):
        policies = sorted({str(getattr(c, "policy", c)) for c in configs})
        raise ValueError(f"gates= was given, but no layer's policy reads eviction gates (policies {policies})")
    for i, cfg in enumerate(configs):
        if not isinstance(cfg, KVCacheConfig):
            raise TypeError(f"kv_cache must be a KVCacheConfig or a list of them, item {i} is {type(cfg).__name__}")
        if cfg.policy_class.needs_gates and not gates:
            raise ValueError(
                f"policy {cfg.policy!r} needs eviction gates: give litkv.hf.Cache(model, kv_cache, gates=CHECKPOINT) "
                "the litkv checkpoint directory they were fitted in (checked against the model's weights)"
            )


def hf_fingerprint(model: torch.nn.Module, gates: EvictionGates | None = None) -> dict[str, str]:
    """`{"model_config": sha256 of the transformers config's JSON, "weights": sha256 of every parameter's name,
    shape, dtype and digest (every element counts)}`, plus `"eviction_gates"` with `gates` (as litkv's
    `model_fingerprint`): a state restores only into the model, and the gates, it came from."""
    config_hash = hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{int(_parameter_digest(p))};".encode())
    out = {"model_config": config_hash, "weights": h.hexdigest()}
    if gates is not None:
        out["eviction_gates"] = gates_fingerprint(gates)
    return out


@torch.no_grad()
def snapshot_caches(
    caches: KVCaches, model: torch.nn.Module, device: torch.device | str | None, gates: EvictionGates | None = None
) -> CacheState:
    """A copy of every layer's state and of `last_pos` (`litkv.snapshot` for a transformers model; `gates`: the
    cache's eviction gates, in its fingerprint)."""
    layers = [_layer_snapshot(cache, device) for cache in caches.policy_caches]
    last_pos = None if caches.last_pos is None else caches.last_pos.to(device, copy=True)
    return CacheState(layers, last_pos, hf_fingerprint(model, gates), caches.policy_caches[0].dtype)  # type: ignore[arg-type]


@torch.no_grad()
def restore_caches(
    caches: KVCaches, model: torch.nn.Module, state: CacheState, gates: EvictionGates | None = None
) -> None:
    """Set `caches` to `state`, bitwise; ValueError unless it was taken from `model` (and `gates`) with the same
    configs, rows and dtype."""
    if not isinstance(state, CacheState):
        raise TypeError(f"state must be a litkv.CacheState, got {type(state).__name__}")
    if state.fingerprint != hf_fingerprint(model, gates):
        raise ValueError("the cache state was taken from another model (its config, weights or eviction gates differ)")
    layers: list[SlotMachine] = caches.policy_caches
    if len(state.layers) != len(layers):
        raise ValueError(f"the cache state has {len(state.layers)} layers, the cache {len(layers)}")
    for i, (cache, layer) in enumerate(zip(layers, state.layers, strict=True)):
        if not isinstance(layer, LayerState) or layer.config != cache.config or layer.shape != cache.shape:
            raise ValueError(f"layer {i} of the cache state has another config or shape than the cache's")
        if state.dtype != cache.dtype:
            raise ValueError(f"the cache state holds {state.dtype}, the cache {cache.dtype}")
    with writing_mode(layers):
        for cache, layer in zip(layers, state.layers, strict=True):
            cache.abort_call()
            cache.load_state_tensors(layer.full_tensors(cache.positions.device), layer.num_filled)  # type: ignore[union-attr]
    caches.last_pos = None if state.last_pos is None else state.last_pos.to(layers[0].positions.device, copy=True)
