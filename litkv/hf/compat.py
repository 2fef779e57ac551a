"""Which transformers `litkv.hf` works with, checked when `litkv.hf` is imported, and which model types it takes.

The range is that of the `Cache` interfaces it was built against: 5.0 - 5.3 (layers' `get_mask_sizes` take
`cache_position`, the models pass `cache_position`), the later 5.x up to 5.17 (`cache_position` gone,
`get_mask_sizes` takes the query length) and from 5.24 (the models call a layer's `update` with `kwargs=` instead
of `cache_kwargs`, and name the forward's cache argument `cache`, `past_key_values` kept as a deprecated alias).
The adapter reads the query length from either form, takes any `update` arguments, and passes its cache under the
name the model's forward declares (`cache_argument`). Tested: 5.3.0 and every minor version from 5.17 to 5.25
(docs/hf.md).
"""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "FAMILIES",
    "HYBRID_MODEL_TYPES",
    "TRANSFORMERS_RANGE",
    "cache_argument",
    "check_model_type",
    "check_transformers_version",
]

#: Lowest version included, first version excluded.
TRANSFORMERS_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((5, 0), (5, 26))

#: Model types whose attention layers `litkv.hf.Cache` serves (every layer an attention layer, RoPE, GQA).
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text")

#: Hybrid model types (recurrent layers beside the attention): refused, litkv's GPT runs them.
HYBRID_MODEL_TYPES: tuple[str, ...] = (
    "bamba",
    "granitemoehybrid",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_next",
    "jamba",
    "falcon_h1",
    "nemotron_h",
    "zamba",
    "zamba2",
)


def _parse(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ImportError(f"litkv.hf cannot read the transformers version {text!r}")
    return int(match.group(1)), int(match.group(2))


def check_transformers_version(text: str) -> None:
    """ImportError in one line unless transformers `text` (e.g. ``"5.3.0"``) is in `TRANSFORMERS_RANGE`."""
    (lo_major, lo_minor), (hi_major, hi_minor) = TRANSFORMERS_RANGE
    if not (lo_major, lo_minor) <= _parse(text) < (hi_major, hi_minor):
        raise ImportError(
            f"litkv.hf supports transformers >={lo_major}.{lo_minor},<{hi_major}.{hi_minor}, found {text}: "
            f'install a version in that range (pip install -e ".[hf]")'
        )


def check_model_type(model_type: str | None) -> None:
    """ValueError in one line unless `model_type` is one of `FAMILIES` (hybrids and other types named)."""
    if model_type in FAMILIES:
        return
    if model_type in HYBRID_MODEL_TYPES:
        raise ValueError(
            f"litkv.hf.Cache does not serve hybrid models ({model_type!r}: recurrent layers beside attention); "
            "convert it with `litkv convert` and run litkv's GPT, which keeps their state"
        )
    raise ValueError(f"litkv.hf.Cache does not support model_type {model_type!r}: supported are {list(FAMILIES)}")


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword under which `model`'s forward takes its cache: ``"cache"`` where the forward declares it (later
    5.x, which keep ``"past_key_values"`` only as a deprecated alias), else ``"past_key_values"``."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters and "past_key_values" not in parameters else "past_key_values"
