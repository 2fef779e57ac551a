"""Helpers shared by the command functions: precision, device, checkpoint directory defaults."""

from __future__ import annotations

from pathlib import Path

import torch

from litkv.checkpoint import default_checkpoint_dir
from litkv.validation import require_int

__all__ = ["PRECISIONS", "apply_num_threads", "resolve_checkpoint_dir", "resolve_device", "resolve_dtype"]

PRECISIONS: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
    "64-true": torch.float64,
}


def resolve_checkpoint_dir(checkpoint_dir: Path | str | None) -> Path:
    """`checkpoint_dir`, or the model shipped with the package when it is `None`, or the cache directory
    of a downloaded model when it is such a name (`smollm2-135m-instruct`) and not an existing path."""
    if checkpoint_dir is None:
        return default_checkpoint_dir()
    from litkv.download import known_checkpoint_dir

    return known_checkpoint_dir(checkpoint_dir) or Path(checkpoint_dir)


RUNNABLE_DEVICES = ("cpu", "cuda", "mps")


def resolve_device(device: str | None) -> torch.device:
    """`device`, or CUDA when available, else CPU. Raises ValueError for an unusable device.

    Only devices that compute are accepted (`cpu`, `cuda`, `cuda:N`, `mps`): `meta` has no data.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"invalid device {device!r}: expected 'cpu', 'cuda', 'cuda:N' or 'mps' ({err})") from err
    if resolved.type not in RUNNABLE_DEVICES:
        raise ValueError(
            f"device {device!r} cannot run generation or evaluation; expected 'cpu', 'cuda', 'cuda:N' or 'mps'"
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested, but CUDA is not available")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"device {device!r} requested, but only {count} CUDA device(s) are visible")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} requested, but MPS is not available")
    return resolved


def resolve_dtype(precision: str | None, device: torch.device) -> torch.dtype:
    """The parameter dtype for a Lightning-style precision string (`"32-true"`, `"bf16-true"`, ...).

    `None`: bf16 on a CUDA device that supports it, float32 otherwise.
    """
    if precision is None:
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def apply_num_threads(num_threads: int | None) -> None:
    """Set torch's CPU thread count; `None` keeps torch's default. Raises ValueError below 1."""
    if num_threads is None:
        return
    require_int("num_threads", num_threads, 1)
    torch.set_num_threads(num_threads)
