"""Soft eviction for training the gates (Dynamic Memory Sparsification, Łańcucki et al., 2025).

While the gates train, a forward pass without a cache attends the whole sequence, and each token's
keep decision enters the attention of the queries that come after it as an additive bias on its
logit: `log(keep)`. Eviction is *delayed*: a token younger than the gates' `window` (or among the
first `sinks` positions) is attended with no bias, as the `learned` policy keeps its recent window and
sinks at inference. The decision is a logistic (Gumbel-sigmoid) sample at a temperature; with
`straight_through`, the forward pass uses the hard decision (kept: bias 0; evicted: `log(EPS)`) and the
backward pass the soft one, so that the loss reaches the gate of an evicted token by how much its
attention would have mattered.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from litkv.learned.gate import EvictionGates, unrotate_keys

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
        keep: filled by each forward pass: layer -> `(B, G, T)` soft keep probabilities.
    """

    gates: EvictionGates
    n_elem: int
    temperature: float = 1.0
    noise: bool = True
    straight_through: bool = True
    keep: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")

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
        logit = self.gates.logits(layer, unrotate_keys(k, cos, sin, self.n_elem))  # (B, G, T)
        if self.noise:
            u = torch.rand_like(logit).clamp_(1e-6, 1 - 1e-6)
            logit = logit + torch.log(u) - torch.log1p(-u)
        keep = torch.sigmoid(logit / self.temperature)
        self.keep[layer] = keep
        if self.straight_through:
            keep = (logit > 0).to(keep.dtype) + keep - keep.detach()
        log_keep = torch.log(EPS + (1 - EPS) * keep)
        bias = soft_bias(log_keep, self.gates.window, self.gates.sinks, window).to(q.dtype)  # (B, G, T, T)
        b, h, t, _ = q.shape
        g = k.shape[1]
        bias = bias[:, :, None].expand(b, g, h // g, t, t).reshape(b, h, t, t)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
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
    soft.gates.check_model(config.n_layer, config.n_query_groups, config.head_size, "soft_eviction")
    blocks = list(model.transformer.h)
    for block in blocks:
        block.attn.soft_eviction = soft
    try:
        yield soft
    finally:
        for block in blocks:
            block.attn.soft_eviction = None
