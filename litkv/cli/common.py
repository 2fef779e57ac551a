"""Helpers shared by the command functions: the checkpoint directory default (device, dtype and threads:
`litkv.runtime`)."""

from __future__ import annotations

from pathlib import Path

from litkv.checkpoint import default_checkpoint_dir

__all__ = ["resolve_checkpoint_dir"]


def resolve_checkpoint_dir(checkpoint_dir: Path | str | None) -> Path:
    """`checkpoint_dir`, or the model shipped with the package when it is `None`, or the cache directory
    of a downloaded model when it is such a name (`smollm2-135m-instruct`) and not an existing path."""
    if checkpoint_dir is None:
        return default_checkpoint_dir()
    from litkv.download import known_checkpoint_dir

    return known_checkpoint_dir(checkpoint_dir) or Path(checkpoint_dir)
