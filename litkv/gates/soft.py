"""Soft eviction for training the gates (Dynamic Memory Sparsification, Łańcucki et al., 2025).

While the gates train, a forward pass without a cache attends the whole sequence, and each token's
keep decision enters the attention of the queries that come after it as an additive bias on its
logit: `log(keep)`. Eviction is *delayed*: a token younger than the gates' `window` (or among the
first `sinks` positions) is attended with no bias, as the `learned` policy keeps its recent window and
sinks at inference. The decision is a logistic (Gumbel-sigmoid) sample at a temperature; with
`straight_through`, the forward pass uses the hard decision (kept: bias 0; evicted: `log(EPS)`) and the
backward pass the soft one, so that the loss reaches the gate of an evicted token by how much its
attention would have mattered.

The same decisions also live in a KV cache (`attend_cached`): a call through caches (the chunked
gradient engine's recording pass and its replay, `litkv.gradient.distill`) attends the slots the cache
returns with the bias of each slot's token, recomputed from its stored key, so that gradients reach the
gates through every chunk. With a cache that keeps every token, this is the whole-sequence soft
attention computed chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from litkv.gates.gate import EvictionGates, unrotate_keys

__all__ = ["EPS", "SoftEviction", "soft_bias", "soft_eviction"]

#: The keep value of an evicted token in the hard forward pass (bias `log(EPS)`).
EPS = 1e-6


@dataclass
class SoftEviction:
    """The training-time attention of every layer (set on each layer by `soft_eviction`).

    Attributes:
        gates: the gates being trained.
        n_elem: how many dims of a head RoPE rotates (`config.rope_n_elem`).
        temperature: of the logistic sample (lower: closer to a hard decision).
        noise: sample logistic noise (training); without it the decision is `sigmoid(logit / temperature)`.
        straight_through: hard decision forward, soft gradient backward.
        noise_table: `None`, or `(n_layer, B, G, T_max)` uniform samples in (0, 1): the logistic noise of
            the token at position `p` of row `b` in layer `l`, KV head `g`, is drawn from
            `noise_table[l, b, g, p]` (the same noise in a whole-sequence pass, a chunked one and its
            replay); without it, fresh noise per call.
        keep: filled by each forward pass: layer -> `(B, G, T)` soft keep probabilities of the call's tokens.
        key_rope: set by `soft_eviction`: `(layer, positions (B, N)) -> cos, sin (B, N, n_elem)`, the
            model's RoPE at arbitrary positions (cached slots).
    """

    gates: EvictionGates
    n_elem: int
    temperature: float = 1.0
    noise: bool = True
    straight_through: bool = True
    noise_table: torch.Tensor | None = None
    keep: dict[int, torch.Tensor] = field(default_factory=dict)
    key_rope: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.noise_table is not None and self.noise_table.dim() != 4:
            raise ValueError(f"noise_table must be (n_layer, B, G, T), got {tuple(self.noise_table.shape)}")

    def decision(
        self, layer: int, keys_pre: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Soft keep probabilities and the log keep decision the attention adds (straight-through or soft).

        Args:
            keys_pre: `(B, G, S, D)` keys rotated back to position 0.
            positions: `(B, G, S)` their token positions (`>= 0`; indexes `noise_table`).

        Returns:
            `(B, G, S)` keep probabilities, `(B, G, S)` log keep decisions.
        """
        logit = self.gates.logits(layer, keys_pre)
        if self.noise:
            if self.noise_table is None:
                u = torch.rand_like(logit).clamp_(1e-6, 1 - 1e-6)
            else:
                table = self.noise_table[layer].to(logit.device, logit.dtype)  # (B, G, T_max)
                u = table.gather(2, positions.clamp(min=0)).clamp(1e-6, 1 - 1e-6)
            logit = logit + torch.log(u) - torch.log1p(-u)
        keep = torch.sigmoid(logit / self.temperature)
        decided = keep
        if self.straight_through:
            decided = (logit > 0).to(keep.dtype) + keep - keep.detach()
        return keep, torch.log(EPS + (1 - EPS) * decided)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """Causal attention with soft eviction: `q` `(B, H, T, hs)`, `k`/`v` `(B, G, T, hs)` after RoPE,
        `cos`/`sin` `(B or 1, T, n_elem)`, `window` the layer's sliding window -> `(B, T, H * hv)`."""
        b, h, t, _ = q.shape
        g = k.shape[1]
        positions = torch.arange(t, device=k.device).expand(b, g, t)
        keep, log_keep = self.decision(layer, unrotate_keys(k, cos, sin, self.n_elem), positions)  # (B, G, T)
        self.keep[layer] = keep
        bias = soft_bias(log_keep, self.gates.window, self.gates.sinks, window).to(q.dtype)  # (B, G, T, T)
        bias = bias[:, :, None].expand(b, g, h // g, t, t).reshape(b, h, t, t)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
        return y.transpose(1, 2).reshape(b, t, -1)

    def attend_cached(
        self,
        layer: int,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        k_pos: torch.Tensor,
        q_pos: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """Attention of a call through a cache with soft eviction.

        Args:
            q: `(B, H, T, hs)` the call's queries after RoPE; `q_pos` `(B, T)` their positions (no pads).
            keys, values: `(B, G, S, hs)` what the cache returned (`SlotMachine.attend_inputs`): its slots, then
                the call's own `T` tokens last (every cache path returns them so).
            k_pos: `(B, G, S)` the keys' positions, `-1` for empty slots.
            window: the layer's sliding window, or `None`.

        Returns:
            `(B, T, H * hv)`; `keep[layer]` is set to the `(B, G, T)` keep probabilities of the call's tokens.
        """
        if not isinstance(keys, torch.Tensor):
            raise ValueError("soft eviction through a cache needs float storage (the cache returned packed slots)")
        if self.key_rope is None:
            raise RuntimeError("SoftEviction.attend_cached needs key_rope: run the model inside soft_eviction()")
        b, h, t, _ = q.shape
        g, s = keys.shape[1], keys.shape[2]
        if bool((q_pos < 0).any()) or not torch.equal(k_pos[:, :, s - t :], q_pos[:, None, :].expand(b, g, t)):
            raise RuntimeError("soft eviction through a cache needs unpadded calls whose tokens the cache returns last")
        cos, sin = self.key_rope(layer, k_pos.reshape(b, g * s))  # (B, G * S, n_elem)
        flat = keys.reshape(b * g, 1, s, keys.shape[-1])
        cos, sin = cos.reshape(b * g, s, -1), sin.reshape(b * g, s, -1)
        keys_pre = unrotate_keys(flat, cos, sin, self.n_elem).reshape(keys.shape)
        keep, log_keep = self.decision(layer, keys_pre, k_pos)  # (B, G, S)
        self.keep[layer] = keep[:, :, s - t :]
        dist = q_pos[:, None, :, None] - k_pos[:, :, None, :]  # (B, G, T, S) query - key
        free = (dist < self.gates.window) | (k_pos[:, :, None, :] < self.gates.sinks)
        zero = torch.zeros((), dtype=log_keep.dtype, device=log_keep.device)
        bias = torch.where(free, zero, log_keep[:, :, None, :])
        masked = (dist < 0) | (k_pos[:, :, None, :] < 0)
        if window is not None:
            masked = masked | (dist >= window)
        bias = bias.masked_fill(masked, float("-inf")).to(q.dtype)
        bias = bias[:, :, None].expand(b, g, h // g, t, s).reshape(b, h, t, s)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)
        return y.transpose(1, 2).reshape(b, t, -1)


def soft_bias(log_keep: torch.Tensor, window: int, sinks: int, sliding: int | None = None) -> torch.Tensor:
    """The additive attention bias of delayed soft eviction.

    Args:
        log_keep: `(B, G, T)` log keep decision of each token (key).
        window: a key at distance `< window` from the query is attended with no bias.
        sinks: keys at positions `< sinks` are attended with no bias.
        sliding: the layer's sliding window (keys at distance `>= sliding` masked), or `None`.

    Returns:
        `(B, G, T, T)` float: `-inf` above the diagonal (and outside `sliding`), 0 inside the window and
        for sinks, `log_keep[key]` elsewhere.
    """
    t = log_keep.shape[-1]
    idx = torch.arange(t, device=log_keep.device)
    dist = idx[:, None] - idx[None, :]  # query - key
    free = (dist < window) | (idx[None, :] < sinks)
    bias = torch.where(free, torch.zeros((), dtype=log_keep.dtype, device=log_keep.device), log_keep[:, :, None, :])
    masked = dist < 0 if sliding is None else (dist < 0) | (dist >= sliding)
    return bias.masked_fill(masked, float("-inf"))


@contextmanager
def soft_eviction(model: nn.Module, soft: SoftEviction) -> Iterator[SoftEviction]:
    """Run the cache-less forward passes of `model` (a `litkv.GPT`) with soft eviction inside the block.

    Raises:
        ValueError: the model soft-caps attention logits (not supported), or the gates do not fit it.
    """
    config = model.config
    if config.attention_logit_softcapping is not None:
        raise ValueError("soft eviction does not support attention-logit soft-capping (Gemma 2 configs)")
    soft.gates.check_model(config.n_layer, config.n_query_groups, config.head_size, config.n_embd, "soft_eviction")
    if soft.gates.input != "key":
        raise ValueError(
            f"soft eviction trains key-input gates, got gates that read the layer's {soft.gates.input} state "
            "(a KVzap fit, as litkv ships for smollm2-135m-instruct); start from key-input gates (scripts/"
            "fit_kvzap.py's OUT/ckpt_raw) or use --learn.init bias"
        )
    blocks = list(model.transformer.h)
    indices = config.rope_indices

    def key_rope(layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = model.rope(positions)
        if indices is not None:
            cos, sin = cos[..., indices[layer]], sin[..., indices[layer]]
        return cos, sin

    previous = soft.key_rope
    soft.key_rope = key_rope
    for block in blocks:
        block.attn.soft_eviction = soft
    try:
        yield soft
    finally:
        soft.key_rope = previous
        for block in blocks:
            block.attn.soft_eviction = None
