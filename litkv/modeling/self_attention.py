"""The self-attention layer of a `Block` (`Block.attn` of an attention layer): queries, keys and values with
RoPE, then attention through the layer's optional `SlotMachine` (`attend_inputs`, the attention kernel of
`litkv.modeling.attention`, `evict_and_store`), with the mask layout chosen per call. The recurrent mixers
in the same place are `litkv.modeling.mamba2.Mamba2Mixer` and `litkv.modeling.gated_deltanet.GatedDeltaNet`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn as nn

from litkv.core.rope import apply_rope, yarn_mscale
from litkv.gates.soft import SoftEviction
from litkv.kvcache.base import LayerCache
from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.storage import CacheShape
from litkv.modeling.attention import CAUSAL, HeadStarts, Layout, attend, build_mask
from litkv.modeling.config import ATTENTION, Config, HybridConfig

__all__ = ["CausalSelfAttention", "call_layout", "rotated_together"]


class CausalSelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention through an optional per-layer `SlotMachine`."""

    kind: ClassVar[str] = ATTENTION  # the layer kind it mixes (`litkv.modeling.config.layer_kinds`)
    reads_rope: ClassVar[bool] = True  # a block calls it with `(x, cos, sin, input_pos, no_pads, evict_later)`

    @staticmethod
    def state_shape(config: Config, kv_cache: KVCacheConfig, batch_size: int) -> CacheShape:
        """The cache sizes of an attention layer of `config` under `kv_cache` for `batch_size` rows."""
        hs = config.head_size
        return CacheShape(batch_size, config.n_query_groups, kv_cache.cache_length, hs, hs)

    @classmethod
    def new_cache(
        cls, config: Config, kv_cache: KVCacheConfig, batch_size: int, device: torch.device, dtype: torch.dtype
    ) -> LayerCache:
        """A fresh cache of `kv_cache`'s policy for the layer."""
        return kv_cache.make_cache(cls.state_shape(config, kv_cache, batch_size), device, dtype)

    def __init__(self, config: Config, block_idx: int) -> None:
        super().__init__()
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.qkv = nn.Linear(config.n_embd, shape, bias=config.bias or config.attn_bias)
        self.proj = nn.Linear(config.head_size * config.n_head, config.n_embd, bias=config.bias)
        # Qwen3.5 / Qwen3-Next: the output is gated per channel, `proj(y * sigmoid(gate(x)))`
        gated = isinstance(config, HybridConfig) and config.attn_output_gate
        self.gate = nn.Linear(config.n_embd, config.head_size * config.n_head, bias=False) if gated else None
        if config.norm_qk:
            olmo2 = config.norm_qk_type == "olmo2"
            q_size = config.n_head * config.head_size if olmo2 else config.head_size
            k_size = config.n_query_groups * config.head_size if olmo2 else config.head_size
            self.norm_q = config.norm_class(q_size, eps=config.norm_eps)
            self.norm_k = config.norm_class(k_size, eps=config.norm_eps)
        else:
            self.norm_q = self.norm_k = None
        self.window: int | None = None
        indices = config.sliding_window_indices
        if config.sliding_window_size is not None and indices is not None and indices[block_idx]:
            self.window = config.sliding_window_size
        mscale = 1.0
        adjustments = config.rope_adjustments or {}
        if adjustments.get("mscale_all_dim") and adjustments.get("factor"):
            mscale = yarn_mscale(adjustments["factor"], adjustments["mscale_all_dim"])
        self.scale = mscale * mscale / math.sqrt(config.attention_scores_scalar or config.head_size)
        self.kv_cache: SlotMachine | None = None
        # Set while eviction gates are trained (`litkv.gates.soft.soft_eviction`): calls attend with the
        # gates' soft keep decisions as an additive bias (without a cache, or through one, `attend_cached`).
        self.soft_eviction: SoftEviction | None = None
        self.config = config
        self.block_idx = block_idx

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        input_pos: torch.Tensor | None,
        no_pads: bool = False,
        evict_later: bool = False,
    ) -> torch.Tensor:
        """`x`: `(B, T, n_embd)` -> `(B, T, n_embd)`. `no_pads`: `input_pos` holds no `-1` (then a call
        that attends only its own tokens, the first prefill chunk, takes SDPA's causal kernel).
        `evict_later`: the cache keeps the call's weights and evicts with the other layers after the block
        loop (`SlotMachine.wait_for_eviction`, `KVCaches.evict_waiting`), else now (`evict_and_store`)."""
        q, k, v = self._qkv(x, cos, sin)
        return self.project(x, self.attend_qkv(x, q, k, v, cos, sin, input_pos, no_pads, evict_later))

    def attend_qkv(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        input_pos: torch.Tensor | None,
        no_pads: bool = False,
        evict_later: bool = False,
    ) -> torch.Tensor:
        """`forward` between the projections: the layer's input `x` `(B, T, n_embd)`, its queries `(B, n_head, T,
        hs)`, keys and values `(B, G, T, hs)` (`heads`, RoPE applied; a block may have made them in one call,
        `fused_decode.qkv_step`) -> the attention's output `(B, T, n_head * hs)` before `project`."""
        if input_pos is None and self.soft_eviction is not None:
            y = self.soft_eviction.attend(self.block_idx, q, k, v, cos, sin, self.scale, self.window)
        elif input_pos is None:
            y = self._attend_full(q, k, v, self.config.attention_logit_softcapping)
        else:
            cache = self.kv_cache
            if cache is None:
                raise ValueError(f"layer {self.block_idx} has no KV cache: call set_kv_caches() first")
            y = self.attend_cached(q, k, v, input_pos, cache, no_pads, evict_later, x)
        return y

    def project(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention's output `y` `(B, T, n_head * hs)` (gated by the layer's input
        `x` where the layer has a gate) -> `(B, T, n_embd)`."""
        return self.proj(y if self.gate is None else y * torch.sigmoid(self.gate(x)))

    def attend_cached(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        input_pos: torch.Tensor,
        cache: SlotMachine,
        no_pads: bool = False,
        evict_later: bool = False,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of a call through `cache` (the layer's own): queries `(B, n_head, T, hs)`, keys and
        values `(B, G, T, hs)` (`heads`) at positions `input_pos` `(B, T)` -> `(B, T, n_head * hs)`, before the
        output projection. `no_pads` and `evict_later` as in `forward`; `hidden`: the layer's input `x`
        `(B, T, n_embd)`, handed to a cache whose policy reads it (`needs_hidden`)."""
        if cache.needs_hidden:  # by keyword, and only then: a cache that reads no hidden state takes the 4 arguments
            keys, values, k_pos = cache.attend_inputs(k, v, input_pos, q, hidden=hidden)
        else:
            keys, values, k_pos = cache.attend_inputs(k, v, input_pos, q)
        if self.soft_eviction is not None:  # eviction gates trained through caches
            if cache.needs_attn_weights:
                raise ValueError(
                    f"soft eviction needs a cache that reads no attention weights, got {type(cache).__name__}"
                )
            y = self.soft_eviction.attend_cached(
                self.block_idx, q, keys, values, k_pos, input_pos, self.scale, self.window
            )
            weights = None
        else:
            mask = self._layout(cache, keys, k_pos, input_pos, no_pads)
            need = cache.needs_attn_weights
            softcap = self.config.attention_logit_softcapping
            valid = None if no_pads or not need else input_pos >= 0  # which queries count in the weight sums
            y, weights = attend(q, keys, values, mask, self.scale, softcap, need, valid)
        if evict_later:
            cache.wait_for_eviction(weights)
        else:
            cache.evict_and_store(weights)
        return y

    def _qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries `(B, n_head, T, hs)`, keys and values `(B, G, T, hs)`, RoPE applied."""
        return self.heads(self.qkv(x), cos, sin)

    def heads(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `qkv` projection's output `(B, T, (n_head + 2 G) * hs)` as queries `(B, n_head, T, hs)`, keys and
        values `(B, G, T, hs)`, q/k norms and RoPE applied; queries and keys contiguous."""
        c = self.config
        b, t, _ = qkv.shape
        kv_size = c.n_query_groups * c.head_size
        if not c.norm_qk:  # queries and keys rotated together (half the operators of a decode step's RoPE)
            return self._rotated_together(qkv, cos, sin)
        q, k, v = qkv.split((c.n_head * c.head_size, kv_size, kv_size), dim=-1)
        if c.norm_qk and c.norm_qk_type == "olmo2":
            q, k = self.norm_q(q), self.norm_k(k)
        q = q.view(b, t, c.n_head, c.head_size).transpose(1, 2)
        k = k.view(b, t, c.n_query_groups, c.head_size).transpose(1, 2)
        v = v.view(b, t, c.n_query_groups, c.head_size).transpose(1, 2)
        if c.norm_qk and c.norm_qk_type == "default":
            q, k = self.norm_q(q), self.norm_k(k)
        return self._rope(q, cos, sin).contiguous(), self._rope(k, cos, sin).contiguous(), v

    def _rotated_together(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`heads` without q/k norms (`rotated_together` with this layer's sizes and RoPE)."""
        c = self.config
        return rotated_together(qkv, cos, sin, c.n_head, c.n_query_groups, c.head_size, self._rope)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first `rope_n_elem` features of heads `x` `(B, H, T, hs)` (the rest unchanged)."""
        n = self.config.rope_n_elem
        if n == x.shape[-1]:
            return apply_rope(x, cos, sin, self.config.rope_interleave)
        return torch.cat((apply_rope(x[..., :n], cos, sin, self.config.rope_interleave), x[..., n:]), dim=-1)

    def _layout(
        self, cache: SlotMachine, keys: object, k_pos: torch.Tensor, input_pos: torch.Tensor, no_pads: bool
    ) -> Layout:
        """Which keys each of the call's queries sees (`call_layout` with this layer's sliding window)."""
        return call_layout(cache, keys, k_pos, input_pos, no_pads, self.window)

    def _attend_full(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None) -> torch.Tensor:
        """Plain causal attention over the whole sequence: `(B, T, n_head * hs)`."""
        mask: Layout = CAUSAL
        if self.window is not None:
            pos = torch.arange(q.shape[2], device=q.device)
            mask = build_mask(pos[None], pos[None, None], self.window)
        return attend(q, k, v, mask, self.scale, softcap)[0]


def rotated_together(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_head: int,
    n_groups: int,
    head_size: int,
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A `qkv` projection's output `(B, T, (n_head + 2 n_groups) * head_size)` as queries `(B, n_head, T, hs)` and
    keys `(B, n_groups, T, hs)`, both contiguous, `rope(heads, cos, sin)` applied over the query and key heads in one
    pass (the same elementwise operators per element, so the same bits as rotating each apart; no copy for a decode
    step of one row), and values `(B, n_groups, T, hs)` (a view). Shared by `CausalSelfAttention.heads` and
    `fused_decode`'s fallback, which must give its bits."""
    b, t, _ = qkv.shape
    heads = qkv.view(b, t, n_head + 2 * n_groups, head_size).transpose(1, 2)
    qk = rope(heads[:, : n_head + n_groups], cos, sin)
    return qk[:, :n_head].contiguous(), qk[:, n_head:].contiguous(), heads[:, n_head + n_groups :]


def call_layout(
    cache: LayerCache, keys: object, k_pos: torch.Tensor, input_pos: torch.Tensor, no_pads: bool, window: int | None
) -> Layout:
    """Which keys each of a call's queries sees (`attend`'s `mask`): `CAUSAL` for a call without pads whose keys
    end with its own after filled earlier slots (no mask), `None` for a decode step over slots the cache knows all
    hold a token (a full cache's, or a prefix filled by calls without pads: no mask), `HeadStarts` for a decode step
    without pads over a compressed one-shot cache whose heads keep different counts (each head's run of slots),
    else a mask built from positions (pads, empty slots, a sliding window, spliced positions). Shared by
    `CausalSelfAttention` and `litkv.hf`'s attention function.

    Args:
        cache: the layer's cache; keys: the keys `attend_inputs` returned (a tensor, or packed slots); k_pos: their
            positions `(B, G, S)` (`-1`: empty); input_pos: the call's positions `(B, T)`; no_pads: `input_pos` has
            no `-1`; window: the layer's sliding window, or `None`.
    """
    t = input_pos.shape[-1]
    # asked after every call (a call that may hold pads ends the compression's layout and the known prefix)
    machine = isinstance(cache, SlotMachine)
    starts = cache.direct_head_starts(no_pads) if machine else None
    filled = cache.direct_prefix_valid(no_pads) if machine else False
    if window is None and t == 1 and (filled or getattr(cache, "attended_keys_valid", False)):
        return None  # a decode step: its token is the newest, every slot holds an earlier one (packed slots too)
    if window is None and isinstance(keys, torch.Tensor):
        if t > 1 and no_pads and _suffix_causal(k_pos, input_pos):
            return CAUSAL
        if t == 1 and starts is not None:  # a decode step after a one-shot compression: each head's run of slots
            return HeadStarts(*starts) if any(map(any, starts[0])) else None
    return build_mask(input_pos, k_pos[:, :1] if cache.heads_share_positions else k_pos, window)


def _suffix_causal(k_pos: torch.Tensor, input_pos: torch.Tensor) -> bool:
    """Whether the call's own keys are the last `T` slots in the order of its increasing positions, and every
    earlier slot filled and earlier than the call's first position (one host read; none for a call that
    attends only its own tokens, the first chunk). A spliced or selectively recomputed call (positions out of
    slot order) is not.

    Args:
        k_pos: the slots' positions `(B, G, S)` (`-1`: empty); `input_pos`: the call's positions `(B, T)`.
    """
    t = input_pos.shape[-1]
    if k_pos.shape[-1] == t:  # positions increase along a call without pads: causal by index is by position
        return True
    if k_pos.shape[-1] < t:
        return False
    own = (k_pos[..., -t:] == input_pos[:, None, :]).all()
    before = k_pos[..., :-t]
    earlier = ((before >= 0) & (before < input_pos[:, None, :1])).all()
    increasing = (input_pos.diff(dim=-1) > 0).all()
    return bool(own & earlier & increasing)
