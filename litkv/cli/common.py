"""Helpers shared by the command functions: the checkpoint directory default (device, dtype and threads:
`litkv.runtime`)."""

from __future__ import annotations

from pathlib import Path

from litkv.checkpoint import default_checkpoint_dir

__all__ = ["resolve_checkpoint_dir"]


def resolve_checkpoint_dir(checkpoint_dir: Path | str | None) -> Path:
    """`checkpoint_dir`, or the model shipped with the package when it is `None`."""
    return default_checkpoint_dir() if checkpoint_dir is None else Path(checkpoint_dir)
