"""Storage formats by name: `KVCacheConfig.storage` -> a `KVStorage`, registered like policies.

A new format is one module with a `KVStorage` subclass and a factory decorated with
`@register_storage("name")` (plus a line in `_BUILTIN_MODULES` for a built-in one; a user's module
registers when it is imported).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from litkv.core.names import NameRegistry
from litkv.kvcache.storage import CacheShape, FloatStorage, KVStorage

__all__ = [
    "StorageFactory",
    "check_storage_name",
    "known_storages",
    "make_storage",
    "register_storage",
]

# (shape, device, dtype, quant_group_size) -> storage
StorageFactory = Callable[[CacheShape, "torch.device | None", torch.dtype, int], KVStorage]

_BUILTIN_MODULES = ("litkv.kvcache.quantized",)
_STORAGES: NameRegistry[StorageFactory] = NameRegistry("storage", _BUILTIN_MODULES)


def register_storage(name: str) -> Callable[[StorageFactory], StorageFactory]:
    """Decorator: make `factory(shape, device, dtype, quant_group_size) -> KVStorage` the format `name`."""
    return _STORAGES.register(name)


@register_storage("float")
def _float(shape: CacheShape, device: torch.device | None, dtype: torch.dtype, group_size: int) -> KVStorage:
    return FloatStorage(shape, device, dtype)


def known_storages() -> list[str]:
    """Names usable as `KVCacheConfig.storage`, sorted."""
    return _STORAGES.names()


def check_storage_name(name: object) -> None:
    """ValueError naming the known formats unless `name` is a registered storage format."""
    _factory(name)


def make_storage(
    kind: str, shape: CacheShape, device: torch.device | None, dtype: torch.dtype, group_size: int
) -> KVStorage:
    """Build the storage named by `KVCacheConfig.storage`."""
    return _factory(kind)(shape, device, dtype, group_size)


def _factory(name: object) -> StorageFactory:
    factory = _STORAGES.get(name)
    if factory is None:
        raise ValueError(f"storage must be one of {known_storages()}, got {name!r}")
    return factory
