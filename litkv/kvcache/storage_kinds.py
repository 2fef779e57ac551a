"""Storage by name: `KVCacheConfig.storage` -> a `KVStorage` (float or quantised)."""

from __future__ import annotations

import torch

from litkv.kvcache.quantized import QuantizedStorage
from litkv.kvcache.storage import CacheShape, FloatStorage, KVStorage

__all__ = ["STORAGE_KINDS", "make_storage"]

STORAGE_KINDS = ("float", "int8", "int4")


def make_storage(
    kind: str, shape: CacheShape, device: torch.device | None, dtype: torch.dtype, group_size: int
) -> KVStorage:
    """Build the storage named by `KVCacheConfig.storage`."""
    if kind == "float":
        return FloatStorage(shape, device, dtype)
    if kind in ("int8", "int4"):
        return QuantizedStorage(shape, device, dtype, bits=8 if kind == "int8" else 4, group_size=group_size)
    raise ValueError(f"storage must be one of {list(STORAGE_KINDS)}, got {kind!r}")
