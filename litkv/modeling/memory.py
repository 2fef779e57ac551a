"""Memory checked before allocation: the bytes a run's KV caches (or another buffer a user's number sizes:
`generate`'s RoPE table for `max_new_tokens`) need against what the machine holds.

A `cache_length` (or batch) given by the user sizes tensors directly; 10**12 slots asked the allocator for
256 TB and failed with a traceback that never named the option. `check_cache_memory` refuses such a
request first, naming `cache_length` and the size, against the machine's physical memory (or the device's
memory on CUDA). The estimate is a lower bound (keys and values only, at their storage's element size), so
no cache that fits is refused.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

__all__ = ["cache_bytes", "check_cache_memory", "check_memory", "machine_bytes"]

#: bytes per element of the quantised storage formats (codes only; scales add a little)
_STORAGE_BYTES = {"int8": 1.0, "int4": 0.5}


def machine_bytes(device: torch.device) -> int | None:
    """The memory a tensor on `device` can use at most: the CUDA device's total memory, else the host's
    physical memory; None when it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def cache_bytes(
    cache_lengths: Sequence[int], storages: Sequence[str], batch: int, groups: int, head_size: int, itemsize: int
) -> int:
    """Keys and values of the attention layers' caches: per layer `batch x groups x cache_length x head_size`
    elements, twice, at the storage's element size."""
    total = 0.0
    for length, storage in zip(cache_lengths, storages, strict=True):
        total += 2 * batch * groups * length * head_size * _STORAGE_BYTES.get(storage, itemsize)
    return int(total)


def check_cache_memory(needed: int, device: torch.device, option: str) -> None:
    """ValueError naming `option` and the size when `needed` bytes of KV caches exceed what `device` can hold."""
    check_memory(needed, device, option, "the KV caches", "lower cache_length (or the batch)")


def check_memory(needed: int, device: torch.device, option: str, what: str, advice: str) -> None:
    """ValueError `"{option}: {what} would take {size}, more than ...; {advice}"` when `needed` bytes exceed
    what `device` can hold (`machine_bytes`); nothing when that cannot be read."""
    limit = machine_bytes(device)
    if limit is None or needed <= limit:
        return
    where = f"{device} device memory" if device.type == "cuda" else "physical memory"
    raise ValueError(
        f"{option}: {what} would take {_size(needed)}, more than this machine's {_size(limit)} of {where}; {advice}"
    )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"
