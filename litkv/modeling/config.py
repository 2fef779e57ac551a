"""Model configuration (LitGPT's `Config`, reused as is) and, re-exported, the KV cache configuration.

`HybridConfig` adds per-layer kinds (attention, Mamba-2 or Gated DeltaNet) and the recurrent mixers' sizes to
LitGPT's `Config`, for hybrid models (Bamba, Granite-4.0-H, Qwen3.5); `config_from_dict` picks the class a
stored mapping needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

from litgpt.config import Config

from litkv.kvcache.config import DEFAULT_CHUNK_SIZE, KVCacheConfig

__all__ = [
    "ATTENTION",
    "Config",
    "DEFAULT_CHUNK_SIZE",
    "GATED_DELTANET",
    "HybridConfig",
    "KVCacheConfig",
    "LAYER_KINDS",
    "MAMBA2",
    "RECURRENT_KINDS",
    "config_from_dict",
    "layer_kinds",
]

ATTENTION = "attention"
MAMBA2 = "mamba2"
GATED_DELTANET = "gated_deltanet"
RECURRENT_KINDS = (MAMBA2, GATED_DELTANET)
LAYER_KINDS = (ATTENTION, *RECURRENT_KINDS)


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
        gdn_n_k_heads, gdn_n_v_heads: Gated DeltaNet query/key heads and value heads (the first divides the
            second; HF Qwen3.5's `linear_num_key_heads`, `linear_num_value_heads`).
        gdn_k_head_dim, gdn_v_head_dim: their widths (`linear_key_head_dim`, `linear_value_head_dim`).
        gdn_d_conv: the Gated DeltaNet's causal convolution width (`linear_conv_kernel_dim`).
        gdn_chunk_size: tokens per block of the chunked delta-rule scan (a numerical choice, not a model one).
        attn_output_gate: attention layers gate their output per channel (`attn.gate`, Qwen3.5 / Qwen3-Next:
            `proj(y * sigmoid(gate(x)))`).
        norm_unit_offset: every RMSNorm of the model scales by `1 + weight` (Qwen3.5's, Gemma's), not `weight`.
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
    gdn_n_k_heads: int = 1
    gdn_n_v_heads: int = 1
    gdn_k_head_dim: int = 1
    gdn_v_head_dim: int = 1
    gdn_d_conv: int = 4
    gdn_chunk_size: int = 64
    attn_output_gate: bool = False
    norm_unit_offset: bool = False

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
            "gdn_n_k_heads",
            "gdn_n_v_heads",
            "gdn_k_head_dim",
            "gdn_v_head_dim",
            "gdn_d_conv",
            "gdn_chunk_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError(f"mamba_n_groups ({self.mamba_n_groups}) must divide mamba_n_heads ({self.mamba_n_heads})")
        if not 0.0 <= self.mamba_dt_min < self.mamba_dt_max:
            raise ValueError(f"need 0 <= mamba_dt_min < mamba_dt_max, got {self.mamba_dt_min}, {self.mamba_dt_max}")
        if self.gdn_n_v_heads % self.gdn_n_k_heads:
            raise ValueError(f"gdn_n_k_heads ({self.gdn_n_k_heads}) must divide gdn_n_v_heads ({self.gdn_n_v_heads})")

    @property
    def norm_class(self) -> type:
        """LitGPT's norm class; RMSNorm with `1 + weight` when `norm_unit_offset`."""
        if self.norm_unit_offset and self.norm_class_name == "RMSNorm":
            from litgpt.model import RMSNorm  # lazy, as LitGPT's own `norm_class`

            return partial(RMSNorm, add_unit_offset=True)  # type: ignore[return-value]
        return super().norm_class

    @property
    def gdn_key_dim(self) -> int:
        """Width of the Gated DeltaNet's queries (and keys): `gdn_n_k_heads * gdn_k_head_dim`."""
        return self.gdn_n_k_heads * self.gdn_k_head_dim

    @property
    def gdn_value_dim(self) -> int:
        """Width of the Gated DeltaNet's values (and its output before `out_proj`)."""
        return self.gdn_n_v_heads * self.gdn_v_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the Gated DeltaNet's convolution: queries, keys and values (`2 * key_dim + value_dim`)."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

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
