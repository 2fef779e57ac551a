"""Storage formats by name: `KVCacheConfig.storage` -> a `KVStorage`, registered like policies.

A new format is one module with a `KVStorage` subclass and a factory decorated with
`@register_storage("name")` (plus a line in `_BUILTIN_MODULES` for a built-in one; a user's module
registers when it is imported).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from litkv.kvcache.storage import CacheShape, FloatStorage, KVStorage

__all__ = [
    "STORAGE_KINDS",
    "StorageFactory",
    "check_storage_name",
    "known_storages",
    "make_storage",
    "register_storage",
]

# (shape, device, dtype, quant_group_size) -> storage
StorageFactory = Callable[[CacheShape, "torch.device | None", torch.dtype, int], KVStorage]

_STORAGES: dict[str, StorageFactory] = {}
_BUILTIN_MODULES = ("litkv.kvcache.quantized",)
_builtins_loaded = False

#: The built-in formats (`known_storages()` lists registered ones too).
STORAGE_KINDS = ("float", "int8", "int4")


def register_storage(name: str) -> Callable[[StorageFactory], StorageFactory]:
    """Decorator: make `factory(shape, device, dtype, quant_group_size) -> KVStorage` the format `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"storage name must be a non-empty string, got {name!r}")

    def decorator(factory: StorageFactory) -> StorageFactory:
        taken = _STORAGES.get(name)
        if taken is not None and taken.__qualname__ != factory.__qualname__:
            raise ValueError(f"storage name {name!r} is already registered for {taken.__qualname__}")
        _STORAGES[name] = factory
        return factory

    return decorator


@register_storage("float")
def _float(shape: CacheShape, device: torch.device | None, dtype: torch.dtype, group_size: int) -> KVStorage:
    return FloatStorage(shape, device, dtype)


def known_storages() -> list[str]:
    """Names usable as `KVCacheConfig.storage`, sorted."""
    _load_builtins()
    return sorted(_STORAGES)


def check_storage_name(name: object) -> None:
    """ValueError naming the known formats unless `name` is a registered storage format."""
    _load_builtins()
    if not isinstance(name, str) or name not in _STORAGES:
        raise ValueError(f"storage must be one of {known_storages()}, got {name!r}")


def make_storage(
    kind: str, shape: CacheShape, device: torch.device | None, dtype: torch.dtype, group_size: int
) -> KVStorage:
    """Build the storage named by `KVCacheConfig.storage`."""
    check_storage_name(kind)
    return _STORAGES[kind](shape, device, dtype, group_size)


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)
