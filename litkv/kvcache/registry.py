"""Policy name -> `KVCache` class. Names are registered with `register_kv_cache`; a
`"package.module:Class"` path is accepted anywhere a name is."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from litkv.kvcache.base import KVCache

__all__ = ["register_kv_cache", "get_kv_cache_class", "known_policies", "check_policy_name"]

_REGISTRY: dict[str, type[KVCache]] = {}
_BUILTINS = {
    "dense": "litkv.kvcache.dense:DenseKVCache",
    "last-recent": "litkv.kvcache.last_recent:LastRecentKVCache",
    "h2o": "litkv.kvcache.h2o:H2OKVCache",
    "qh2o": "litkv.kvcache.qh2o:QuantizedH2OKVCache",
}


def register_kv_cache(name: str) -> Callable[[type[KVCache]], type[KVCache]]:
    """Class decorator: make a `KVCache` subclass available as policy `name`."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"policy name must be a non-empty string without ':', got {name!r}")

    def decorator(cls: type[KVCache]) -> type[KVCache]:
        if not (isinstance(cls, type) and issubclass(cls, KVCache)):
            raise TypeError(f"register_kv_cache({name!r}) expects a KVCache subclass, got {cls!r}")
        _REGISTRY[name] = cls
        return cls

    return decorator


def known_policies() -> list[str]:
    """Names usable as `KVCacheConfig.policy` (built-in ones, then registered ones)."""
    return sorted(set(_BUILTINS) | set(_REGISTRY))


def check_policy_name(name: str) -> None:
    """Raise ValueError naming the known policies if `name` is neither known nor a `module:Class` path."""
    if ":" not in name and name not in _BUILTINS and name not in _REGISTRY:
        raise ValueError(f"unknown KV cache policy {name!r}; known policies: {', '.join(known_policies())}")


def get_kv_cache_class(name: str) -> type[KVCache]:
    """The class for a policy name or a `"package.module:Class"` path."""
    check_policy_name(name)
    if name in _REGISTRY:
        return _REGISTRY[name]
    path = _BUILTINS.get(name, name)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} for policy {name!r}: {err}") from err
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, KVCache)):
        raise ValueError(f"policy {name!r}: {attr!r} in {module_name!r} is not a KVCache subclass")
    return cls
