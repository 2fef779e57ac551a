"""The Gated DeltaNet mixer of Qwen3.5 / Qwen3-Next hybrids: a layer that takes the place of attention.

Per token: `in_proj_qkv` gives the convolution inputs (queries and keys, `n_k_heads` heads of `k_head_dim`;
values, `n_v_heads` heads of `v_head_dim`), `in_proj_z` the output gate `z`, `in_proj_b` the write strength
`beta = sigmoid(b)` and `in_proj_a` the decay `g = -exp(A_log) * softplus(a + dt_bias)` (log scale). A
depthwise causal convolution (width `d_conv`, no bias) and SiLU mix the inputs; queries and keys are
L2-normalised (and repeated from key heads to value heads), queries scaled by `1 / sqrt(k_head_dim)`. Per
value head the state `S` (`k_head_dim x v_head_dim`) follows the gated delta rule:

    S <- exp(g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T q_t

then a gated RMSNorm per head (`weight * rmsnorm(o) * silu(z)`) and `out_proj`.

A call with several tokens runs the chunked scan (`delta_rule_scan`: inside a block of `chunk` tokens the
writes solve one unit lower-triangular system, the blocks pass the state on); a one-token call runs the
recurrence (`delta_rule_step`). Through a `RecurrentCache` (kind `"gated_deltanet"`: `conv` the window,
`ssm` the state `(B, n_v_heads, k_head_dim, v_head_dim)`) a call starts from the row's state and leaves the
new one; pads (`input_pos == -1`, anywhere in a call) never touch it: each row's real tokens are gathered to
the front, pads get `g = 0` and `beta = 0` (the state passes unchanged), the window is read after the row's
last real token.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.recurrent import RecurrentCache, RecurrentShape
from litkv.modeling.config import GATED_DELTANET, HybridConfig
from litkv.modeling.mamba2 import (
    causal_conv,
    in_call_order,
    new_recurrent_cache,
    real_tokens_first,
    recurrent_forward,
)

__all__ = ["GatedDeltaNet", "HeadGatedRMSNorm", "delta_rule_scan", "delta_rule_step", "gdn_recurrent_shape"]


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule: `q`, `k` `(B, H, K)`, `v` `(B, H, V)`, `g`, `beta` `(B, H)`, state
    `s` `(B, H, K, V)` -> output `(B, H, V)` and the new state (`g = beta = 0`: the state unchanged)."""
    s = s * torch.exp(g)[:, :, None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta[:, :, None]
    s = s + k[:, :, :, None] * delta[:, :, None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def delta_rule_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int,
    s0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a call, blocks of `chunk` tokens.

    Inside a block, with `G_i` the cumulative log decay from the block's start and `S0` the state before
    it, the writes `u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j)` are
    the solution of one unit lower-triangular system; then `o_i = exp(G_i) S0^T q_i + sum_{j<=i}
    exp(G_i - G_j) (q_i . k_j) u_j` and the state after the block `exp(G_L) S0 + sum_j exp(G_L - G_j) k_j u_j^T`.

    Args:
        q, k: `(B, T, H, K)` (normalised and scaled as the step takes them); v: `(B, T, H, V)`;
        g: `(B, T, H)` log decays (<= 0); beta: `(B, T, H)` write strengths (`g = beta = 0`: a token that
        leaves the state unchanged); chunk: tokens per block; s0: `(B, H, K, V)` state before the call.

    Returns:
        Outputs `(B, T, H, V)` and the state after the call `(B, H, K, V)`.
    """
    bsz, t, h, _ = k.shape
    pad = (-t) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    # (B, H, nc, L, .) per block
    q, k, v = (x.reshape(bsz, n, chunk, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.reshape(bsz, n, chunk, h).permute(0, 3, 1, 2) for x in (g, beta))
    cum = torch.cumsum(g, dim=-1)  # (B, H, nc, L)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    gap = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = torch.exp(gap)  # (B, H, nc, L, L): exp(G_i - G_j) for j <= i, else 0
    kk = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    system = kk.tril(-1) + torch.eye(chunk, dtype=k.dtype, device=k.device)
    solve = torch.linalg.solve_triangular
    writes_v = solve(system, v * beta[..., None], upper=False, unitriangular=True)
    writes_k = solve(system, k * (beta * torch.exp(cum))[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay  # (B, H, nc, L, L)
    to_end = torch.exp(cum[..., -1:] - cum)  # (B, H, nc, L)
    outs = []
    state = s0
    for i in range(n):
        u = writes_v[:, :, i] - writes_k[:, :, i] @ state  # (B, H, L, V)
        from_state = (q[:, :, i] * torch.exp(cum[:, :, i])[..., None]) @ state
        outs.append(from_state + qk[:, :, i] @ u)
        written = (k[:, :, i] * to_end[:, :, i, :, None]).transpose(-1, -2) @ u  # (B, H, K, V)
        state = state * torch.exp(cum[:, :, i, -1])[..., None, None] + written
    out = torch.stack(outs, dim=2).reshape(bsz, h, n * chunk, -1).transpose(1, 2)
    return out[:, :t], state


class HeadGatedRMSNorm(nn.Module):
    """Per head: `weight * rmsnorm(y) * silu(z)` over the last dimension (float32 or wider inside)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`y`, `z`: `(..., size)` -> `(..., size)` in `y`'s dtype."""
        dtype = y.dtype
        work = torch.promote_types(dtype, torch.float32)
        y32 = y.to(work)
        normed = (y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return ((self.weight * normed).to(work) * F.silu(z.to(work))).to(dtype)


def gdn_recurrent_shape(config: HybridConfig, batch_size: int) -> RecurrentShape:
    """The state sizes of a Gated DeltaNet layer of `config` for `batch_size` rows."""
    c = config
    return RecurrentShape(
        batch_size, c.gdn_conv_dim, c.gdn_d_conv - 1, c.gdn_n_v_heads, c.gdn_k_head_dim, c.gdn_v_head_dim
    )


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + 1e-6)` over the last dimension (the epsilon of Qwen3.5's kernels)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet in an attention layer's place (`Block.attn`): same call, a `RecurrentCache` as its cache.

    Parameter names are Hugging Face Qwen3.5's (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
    `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`).
    """

    kind: ClassVar[str] = GATED_DELTANET  # the layer kind it mixes (`litkv.modeling.config.layer_kinds`)
    reads_rope: ClassVar[bool] = False  # a block calls it with `(x, input_pos)`

    def __init__(self, config: HybridConfig, block_idx: int) -> None:
        super().__init__()
        c = config
        heads = c.gdn_n_v_heads
        self.in_proj_qkv = nn.Linear(c.n_embd, c.gdn_conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.n_embd, c.gdn_value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.n_embd, heads, bias=False)
        self.in_proj_a = nn.Linear(c.n_embd, heads, bias=False)
        self.conv1d = nn.Conv1d(c.gdn_conv_dim, c.gdn_conv_dim, c.gdn_d_conv, groups=c.gdn_conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
        self.norm = HeadGatedRMSNorm(c.gdn_v_head_dim, c.norm_eps)
        self.out_proj = nn.Linear(c.gdn_value_dim, c.n_embd, bias=False)
        self.kv_cache: RecurrentCache | None = None
        self.config = config
        self.block_idx = block_idx

    @staticmethod
    def state_shape(config: HybridConfig, batch_size: int) -> RecurrentShape:
        """The state sizes of this mixer's layer of `config` for `batch_size` rows."""
        return gdn_recurrent_shape(config, batch_size)

    @classmethod
    def new_cache(
        cls, config: HybridConfig, kv_cache: KVCacheConfig, batch_size: int, device: torch.device, dtype: torch.dtype
    ) -> RecurrentCache:
        """A fresh cache of the layer's state (`kv_cache` covers attention layers only: not read here)."""
        return new_recurrent_cache(cls, config, batch_size, device, dtype)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        """`x`: `(B, T, n_embd)` -> `(B, T, n_embd)`. `input_pos` `None`: the whole sequence from a zero
        state, no cache; else `(B, T)` positions (`-1`: pad) through the layer's `RecurrentCache`."""
        return recurrent_forward(self, x, input_pos, lambda b: gdn_recurrent_shape(self.config, b))

    def mix(
        self, x: torch.Tensor, valid: torch.Tensor, window: torch.Tensor, state: torch.Tensor, compact: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mixer from a state: `x` `(B, T, n_embd)`, `valid` `(B, T)` real tokens, `window`/`state` as
        `RecurrentCache`'s. `compact`: gather each row's real tokens to the front first (pads anywhere).

        Returns:
            `(B, T, n_embd)` outputs (at pads: finite, meaningless) and the window and state after the call.
        """
        c = self.config
        b, t, _ = x.shape
        order = None
        if compact and t > 1:
            x, valid, order = real_tokens_first(x, valid)
        mixed, new_window = causal_conv(self.in_proj_qkv(x), window, self.conv1d.weight, None, valid.sum(dim=1))
        q, k, v = F.silu(mixed).split((c.gdn_key_dim, c.gdn_key_dim, c.gdn_value_dim), dim=-1)
        repeat = c.gdn_n_v_heads // c.gdn_n_k_heads
        q, k = (_l2norm(y.reshape(b, t, c.gdn_n_k_heads, c.gdn_k_head_dim)) for y in (q, k))
        q, k = q.repeat_interleave(repeat, 2), k.repeat_interleave(repeat, 2)
        q = q * c.gdn_k_head_dim**-0.5
        v = v.reshape(b, t, c.gdn_n_v_heads, c.gdn_v_head_dim)
        work = torch.promote_types(x.dtype, torch.float32)
        beta = torch.sigmoid(self.in_proj_b(x)).to(work)
        g = -torch.exp(self.A_log.to(work)) * F.softplus(self.in_proj_a(x).to(work) + self.dt_bias.to(work))
        beta, g = (torch.where(valid[..., None], y, torch.zeros_like(y)) for y in (beta, g))  # pads: no change
        q, k, v, s = (y.to(work) for y in (q, k, v, state))
        if t == 1:
            out, new_state = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s)
            out = out[:, None]
        else:
            out, new_state = delta_rule_scan(q, k, v, g, beta, min(c.gdn_chunk_size, t), s)
        z = self.in_proj_z(x).reshape(b, t, c.gdn_n_v_heads, c.gdn_v_head_dim)
        y = self.out_proj(self.norm(out.to(x.dtype), z).reshape(b, t, c.gdn_value_dim))
        if order is not None:
            y = in_call_order(y, order)
        return y, new_window, new_state.to(state.dtype)
