"""Model configuration (LitGPT's `Config`, reused as is) and, re-exported, the KV cache configuration.

`HybridConfig` adds per-layer kinds (attention or Mamba-2) and the Mamba-2 mixer's sizes to LitGPT's
`Config`, for hybrid models (Bamba, Granite-4.0-H); `config_from_dict` picks the class a stored mapping needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from litgpt.config import Config

from litkv.kvcache.config import DEFAULT_CHUNK_SIZE, KVCacheConfig

__all__ = [
    "ATTENTION",
    "Config",
    "DEFAULT_CHUNK_SIZE",
    "HybridConfig",
    "KVCacheConfig",
    "LAYER_KINDS",
    "MAMBA2",
    "config_from_dict",
    "layer_kinds",
]

ATTENTION = "attention"
MAMBA2 = "mamba2"
LAYER_KINDS = (ATTENTION, MAMBA2)


@dataclass
class HybridConfig(Config):
    """LitGPT's `Config` plus one kind per layer and the Mamba-2 mixer's sizes (HF `BambaConfig` names).

    Attributes:
        layer_kinds: one of `LAYER_KINDS` per layer (`"attention"`: LitGPT's block; `"mamba2"`: the mixer
            of `litkv.modeling.mamba2` in place of the attention, same norms and MLP).
        mamba_n_heads, mamba_head_dim: SSM heads and their width (`n_heads * head_dim` is the inner width).
        mamba_n_groups: groups of heads sharing B and C (must divide `mamba_n_heads`).
        mamba_d_state: SSM state size per head and channel.
        mamba_d_conv: depthwise causal convolution width.
        mamba_chunk_size: tokens per block of the chunked scan (a numerical choice, not a model one).
        mamba_conv_bias, mamba_proj_bias: biases of the convolution and of the in/out projections.
        mamba_dt_min, mamba_dt_max: the clamp of the time step after softplus.
    """

    layer_kinds: tuple[str, ...] = ()
    mamba_n_heads: int = 1
    mamba_head_dim: int = 1
    mamba_n_groups: int = 1
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_min: float = 0.0
    mamba_dt_max: float = math.inf

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_kinds = tuple(self.layer_kinds)
        if len(self.layer_kinds) != self.n_layer:
            raise ValueError(f"layer_kinds must name one kind per layer ({self.n_layer}), got {len(self.layer_kinds)}")
        for i, kind in enumerate(self.layer_kinds):
            if kind not in LAYER_KINDS:
                raise ValueError(
                    f"layer {i} has kind {kind!r}, which litkv does not implement; expected one of {LAYER_KINDS}"
                )
        for name in (
            "mamba_n_heads",
            "mamba_head_dim",
            "mamba_n_groups",
            "mamba_d_state",
            "mamba_d_conv",
            "mamba_chunk_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError(f"mamba_n_groups ({self.mamba_n_groups}) must divide mamba_n_heads ({self.mamba_n_heads})")
        if not 0.0 <= self.mamba_dt_min < self.mamba_dt_max:
            raise ValueError(f"need 0 <= mamba_dt_min < mamba_dt_max, got {self.mamba_dt_min}, {self.mamba_dt_max}")

    @property
    def mamba_inner(self) -> int:
        """The mixer's inner width (`mamba_n_heads * mamba_head_dim`)."""
        return self.mamba_n_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the convolution: x, B and C (`inner + 2 * n_groups * d_state`)."""
        return self.mamba_inner + 2 * self.mamba_n_groups * self.mamba_d_state


def layer_kinds(config: Config) -> tuple[str, ...]:
    """One kind per layer: a `HybridConfig`'s `layer_kinds`, else all attention."""
    if isinstance(config, HybridConfig):
        return config.layer_kinds
    return (ATTENTION,) * config.n_layer


def config_from_dict(raw: dict[str, Any]) -> Config:
    """A `HybridConfig` when the mapping names `layer_kinds`, else LitGPT's `Config`."""
    return HybridConfig(**raw) if "layer_kinds" in raw else Config(**raw)
