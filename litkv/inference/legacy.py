"""Deprecated entry points kept for one release (DeprecationWarning): `litkv.generate` does their work.

- `generate_segments(model, segments, n, kv_cache, store, recompute, ...)` is
  `generate(model, [segments], n, kv_cache, Sampling(...), block_store=store, recompute=recompute)[0]`;
- `generate_segments_batch(model, prompts, n, ...)` is `generate(model, prompts, n, ...)`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from litkv.inference.blocks import Segment
from litkv.inference.generate import KVCacheSpec, generate
from litkv.inference.sampling import Sampling
from litkv.modeling.model import GPT
from litkv.states.block_store import BlockStore

__all__ = ["generate_segments", "generate_segments_batch"]


def generate_segments(
    model: GPT,
    segments: Sequence[Segment],
    max_new_tokens: int,
    kv_cache: KVCacheSpec,
    store: BlockStore | None = None,
    recompute: float = 0.0,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    generator: torch.Generator | None = None,
    on_tokens: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Deprecated: `generate(model, [segments], ...)[0]`, the new tokens `(m,)` of one prompt of segments."""
    _warn("generate_segments(model, segments, ...)", "generate(model, [segments], ...)[0]")
    sampling = Sampling(temperature, top_k, top_p, tuple(stop_tokens), generator)
    out = generate(model, [segments], max_new_tokens, kv_cache, sampling, on_tokens=on_tokens, block_store=store,
                   recompute=recompute)  # fmt: skip
    return out[0]


def generate_segments_batch(
    model: GPT,
    prompts: Sequence[Sequence[Segment]],
    max_new_tokens: int,
    kv_cache: KVCacheSpec,
    store: BlockStore | None = None,
    recompute: float = 0.0,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    generator: torch.Generator | None = None,
    on_tokens: Callable[[torch.Tensor], None] | None = None,
) -> list[torch.Tensor]:
    """Deprecated: `generate(model, prompts, ...)` with prompts of segments, the new tokens `(m_r,)` of each."""
    _warn("generate_segments_batch(model, prompts, ...)", "generate(model, prompts, ...)")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of segment lists")
    sampling = Sampling(temperature, top_k, top_p, tuple(stop_tokens), generator)
    return generate(model, list(prompts), max_new_tokens, kv_cache, sampling, on_tokens=on_tokens, block_store=store,
                    recompute=recompute)  # fmt: skip


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated and goes in the next release: use litkv.{new}", DeprecationWarning, stacklevel=3
    )
