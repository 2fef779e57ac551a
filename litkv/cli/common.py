"""Helpers shared by the command functions: the checkpoint directory default (device, dtype and threads:
`litkv.checkpoints.runtime`)."""

from __future__ import annotations

import atexit
import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from litkv.checkpoints.checkpoint import default_checkpoint_dir
from litkv.checkpoints.download import (
    MODELS,
    DownloadError,
    add_shipped_gates,
    cache_dir,
    download_model,
    known_checkpoint_dir,
)

if TYPE_CHECKING:
    from lightning.fabric import Fabric

__all__ = ["close_fabric", "launching_rank", "resolve_checkpoint_dir"]


def launching_rank() -> bool:
    """Whether this process is the one that starts a launched run (rank 0, or not launched yet)."""
    return int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0) == 0


def close_fabric(fabric: Fabric) -> None:
    """The end of a launched run: every process waits for the others (rank 0 writes last), and leaves the
    process group when the process exits. A process that exits with its gloo threads still running can abort
    (`terminate called without an active exception`), and the launcher then kills the others; the group is
    not left at once because a second launched run in the same process (`finetune` then `finetune
    --resume`) reuses it."""
    fabric.barrier()
    _leave_process_group_at_exit()


@functools.cache
def _leave_process_group_at_exit() -> None:
    atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def resolve_checkpoint_dir(checkpoint_dir: Path | str | None) -> Path:
    """`checkpoint_dir`, or the model shipped with the package when it is `None`, or the cache directory
    of a known model when it is such a name (`smollm2-135m-instruct`) and not an existing path.

    A known model gets the eviction gates litkv ships for it (`litkv.checkpoints.download.add_shipped_gates`).
    A known model that is not downloaded yet is obtained first, once (as `litkv download NAME`); where
    that is impossible (no network, no pip), one warning line says so and the small model shipped with
    litkv is used instead.
    """
    if checkpoint_dir is None:
        return default_checkpoint_dir()
    name = str(checkpoint_dir)
    if name in MODELS and not Path(name).exists() and not cache_dir(name).is_dir():
        print(f"{name}: not downloaded yet; getting it once into {cache_dir(name)} ...", file=sys.stderr)
        try:
            download_model(name)
        except DownloadError as err:
            print(f"warning: cannot get {name} ({err}); using the small model shipped with litkv", file=sys.stderr)
            return default_checkpoint_dir()
    path = known_checkpoint_dir(name)
    if path is None:
        return Path(name)
    add_shipped_gates(name, path)  # gates shipped after the model was downloaded
    return path
