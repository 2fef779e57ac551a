"""The Mamba-2 mixer of hybrid models (Bamba, Granite-4.0-H): a layer that takes the place of attention.

Per token: `in_proj` gives the gate `z`, the convolution inputs `xBC` and the time step `dt`; a depthwise
causal convolution (width `d_conv`) and SiLU mix `xBC`, which splits into `x` (`n_heads` heads of
`head_dim`), `B` and `C` (`n_groups` groups of `d_state`, shared by the heads of a group). The SSM:

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t B_t^T,    y_t = h_t C_t + D * x_t

with `dt = clamp(softplus(dt + dt_bias))`, `A = -exp(A_log)`; then a gated RMSNorm (`y * silu(z)`,
normalised over the inner width) and `out_proj`.

A call with several tokens runs the chunked scan (`ssd_scan`: the state-space dual, quadratic inside a
block of `chunk_size` tokens, the recurrence between blocks); a one-token call runs the recurrent step
(`ssd_step`). Through a `RecurrentCache` a call starts from the row's state and leaves the new one; pads
(`input_pos == -1`, anywhere in a call) never touch a row's state: each row's real tokens are gathered to
the front of the call, pads get `dt = 0` (the state passes unchanged) and the convolution window is read
after the row's last real token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.recurrent import RecurrentCache, RecurrentShape
from litkv.modeling.config import MAMBA2, HybridConfig

__all__ = [
    "GatedRMSNorm",
    "Mamba2Mixer",
    "causal_conv",
    "in_call_order",
    "real_tokens_first",
    "recurrent_forward",
    "recurrent_shape",
    "ssd_scan",
    "ssd_step",
]


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, chunk: int, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over a call, blocks of `chunk` tokens (no `D` term).

    Args:
        x: `(B, T, H, P)` inputs; dt: `(B, T, H)` time steps (0: the token leaves the state unchanged);
        a: `(H,)` negative decay rates; b, c: `(B, T, H, N)` (already repeated from groups to heads);
        chunk: tokens per block; h0: `(B, H, P, N)` state before the call.

    Returns:
        `y` `(B, T, H, P)` and the state after the call `(B, H, P, N)`.
    """
    bsz, t, h, p = x.shape
    pad = (-t) % chunk
    if pad:
        x, dt, b, c = (F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad)) for v in (x, dt, b, c))
    n_chunks = (t + pad) // chunk
    x, b, c = (v.reshape(bsz, n_chunks, chunk, h, -1) for v in (x, b, c))
    dt = dt.reshape(bsz, n_chunks, chunk, h)
    acs = torch.cumsum(dt * a, dim=2)  # (B, nc, L, H) log decay from the block's start
    seg = acs[:, :, :, None, :] - acs[:, :, None, :, :]  # (B, nc, L, S, H): from token s to token l
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal[None, None, :, :, None], float("-inf")))
    scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * decay
    y = torch.einsum("bclsh,bcsh,bcshp->bclhp", scores, dt, x)
    to_end = torch.exp(acs[:, :, -1:, :] - acs) * dt  # (B, nc, L, H)
    block_states = torch.einsum("bclhn,bclh,bclhp->bchpn", b, to_end, x)
    block_decay = torch.exp(acs[:, :, -1, :])  # (B, nc, H)
    state = h0
    starts = []
    for i in range(n_chunks):
        starts.append(state)
        state = state * block_decay[:, i, :, None, None] + block_states[:, i]
    before = torch.stack(starts, dim=1)  # (B, nc, H, P, N)
    y = y + torch.einsum("bclhn,bchpn,bclh->bclhp", c, before, torch.exp(acs))
    return y.reshape(bsz, n_chunks * chunk, h, p)[:, :t], state


def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the SSM (no `D` term): `x` `(B, H, P)`, `dt` `(B, H)`, `a` `(H,)`, `b`/`c` `(B, H, N)`,
    `h` `(B, H, P, N)` -> `y` `(B, H, P)` and the new state."""
    h = h * torch.exp(dt * a)[:, :, None, None] + (dt[:, :, None] * x)[..., None] * b[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", h, c), h


def causal_conv(
    xbc: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution continuing from a window.

    Args:
        xbc: `(B, T, C)` inputs; window: `(B, C, K - 1)` the inputs before them; weight: `(C, 1, K)`;
        bias: `(C,)` or None; ends: `(B,)` int64 how many of the `T` inputs are real (at the front).

    Returns:
        Outputs `(B, T, C)` (before the activation) and the window after the row's last real input.
    """
    full = torch.cat((window, xbc.transpose(1, 2)), dim=2)  # (B, C, K - 1 + T)
    t, taps = xbc.shape[1], weight.shape[2]
    # K shifted multiply-adds (a depthwise kernel is a few taps; cheaper than a convolution call for decode)
    out = sum(full[:, :, k : k + t] * weight[:, 0, k, None] for k in range(taps))
    out = (out if bias is None else out + bias[:, None]).transpose(1, 2)
    width = window.shape[2]
    index = ends[:, None] + torch.arange(width, device=xbc.device)  # (B, K - 1)
    new_window = full.gather(2, index[:, None, :].expand(-1, full.shape[1], -1))
    return out, new_window


def real_tokens_first(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's real tokens gathered to the front in their order, pads after: `x` `(B, T, C)` and `valid`
    `(B, T)` gathered, and the order `(B, T)` that `in_call_order` undoes."""
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    return x.gather(1, order[:, :, None].expand(-1, -1, x.shape[2])), valid.gather(1, order), order


def in_call_order(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`y` `(B, T, C)` computed on `real_tokens_first`'s gathered tokens, back in the call's order."""
    return y.gather(1, torch.argsort(order, dim=1)[:, :, None].expand(-1, -1, y.shape[2]))


def new_recurrent_cache(
    mixer: type, config: HybridConfig, batch_size: int, device: torch.device, dtype: torch.dtype
) -> RecurrentCache:
    """A fresh `RecurrentCache` of a recurrent mixer class's layer (its `state_shape` and `kind`)."""
    return RecurrentCache(mixer.state_shape(config, batch_size), device, dtype, kind=mixer.kind)


def recurrent_forward(
    mixer: nn.Module, x: torch.Tensor, input_pos: torch.Tensor | None, shape: Callable[[int], RecurrentShape]
) -> torch.Tensor:
    """A recurrent mixer's (Mamba-2, Gated DeltaNet) forward: `x` `(B, T, n_embd)` -> `(B, T, n_embd)`.
    `input_pos` `None`: the whole sequence from a zero state (`shape(B)` sizes it), no cache; else `(B, T)`
    positions (`-1`: pad) through the mixer's `RecurrentCache`, updated with the state after the call."""
    if input_pos is None:
        b, t = x.shape[:2]
        sizes = shape(b).tensor_shapes()
        valid = torch.ones(b, t, dtype=torch.bool, device=x.device)
        return mixer.mix(x, valid, x.new_zeros(sizes["conv"]), x.new_zeros(sizes["ssm"]), compact=False)[0]
    cache = mixer.kv_cache
    if cache is None:
        raise ValueError(f"layer {mixer.block_idx} has no recurrent cache: call set_kv_caches() first")
    y, window, state = mixer.mix(x, input_pos >= 0, cache.conv, cache.ssm, compact=True)
    cache.update(window, state)
    return y


class GatedRMSNorm(nn.Module):
    """RMSNorm of `y * silu(z)` over the last dimension (float32 inside, as Bamba's), times `weight`."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`y`, `z`: `(B, T, size)` -> `(B, T, size)`."""
        dtype = y.dtype
        work = torch.promote_types(dtype, torch.float32)
        g = y.to(work) * F.silu(z.to(work))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.to(dtype)


def recurrent_shape(config: HybridConfig, batch_size: int) -> RecurrentShape:
    """The state sizes of a Mamba-2 layer of `config` for `batch_size` rows."""
    c = config
    return RecurrentShape(
        batch_size, c.mamba_conv_dim, c.mamba_d_conv - 1, c.mamba_n_heads, c.mamba_head_dim, c.mamba_d_state
    )


class Mamba2Mixer(nn.Module):
    """Mamba-2 in an attention layer's place (`Block.attn`): same call, a `RecurrentCache` as its cache.

    Parameter names are Hugging Face Bamba's mixer's (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
    `norm`, `out_proj`).
    """

    kind: ClassVar[str] = MAMBA2  # the layer kind it mixes (`litkv.modeling.config.layer_kinds`)
    reads_rope: ClassVar[bool] = False  # a block calls it with `(x, input_pos)`

    def __init__(self, config: HybridConfig, block_idx: int) -> None:
        super().__init__()
        c = config
        inner, conv_dim, heads = c.mamba_inner, c.mamba_conv_dim, c.mamba_n_heads
        self.in_proj = nn.Linear(c.n_embd, inner + conv_dim + heads, bias=c.mamba_proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, c.mamba_d_conv, groups=conv_dim, bias=c.mamba_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = GatedRMSNorm(inner, c.norm_eps)
        self.out_proj = nn.Linear(inner, c.n_embd, bias=c.mamba_proj_bias)
        self.kv_cache: RecurrentCache | None = None
        self.config = config
        self.block_idx = block_idx

    @staticmethod
    def state_shape(config: HybridConfig, batch_size: int) -> RecurrentShape:
        """The state sizes of this mixer's layer of `config` for `batch_size` rows."""
        return recurrent_shape(config, batch_size)

    @classmethod
    def new_cache(
        cls, config: HybridConfig, kv_cache: KVCacheConfig, batch_size: int, device: torch.device, dtype: torch.dtype
    ) -> RecurrentCache:
        """A fresh cache of the layer's state (`kv_cache` covers attention layers only: not read here)."""
        return new_recurrent_cache(cls, config, batch_size, device, dtype)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        """`x`: `(B, T, n_embd)` -> `(B, T, n_embd)`. `input_pos` `None`: the whole sequence from a zero
        state, no cache; else `(B, T)` positions (`-1`: pad) through the layer's `RecurrentCache`."""
        return recurrent_forward(self, x, input_pos, lambda b: recurrent_shape(self.config, b))

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
        ends = valid.sum(dim=1)
        z, xbc, dt = self.in_proj(x).split((c.mamba_inner, c.mamba_conv_dim, c.mamba_n_heads), dim=-1)
        xbc, new_window = causal_conv(xbc, window, self.conv1d.weight, self.conv1d.bias, ends)
        gn = c.mamba_n_groups * c.mamba_d_state
        xs, bs, cs = F.silu(xbc).split((c.mamba_inner, gn, gn), dim=-1)
        dt = F.softplus(dt + self.dt_bias).clamp(c.mamba_dt_min, c.mamba_dt_max)
        dt = torch.where(valid[..., None], dt, torch.zeros_like(dt))  # pads: the state passes unchanged
        xs = xs.reshape(b, t, c.mamba_n_heads, c.mamba_head_dim)
        repeat = c.mamba_n_heads // c.mamba_n_groups
        bs, cs = (v.reshape(b, t, c.mamba_n_groups, c.mamba_d_state).repeat_interleave(repeat, dim=2) for v in (bs, cs))
        a = -torch.exp(self.A_log.to(dt.dtype))
        if t == 1:
            y, new_state = ssd_step(xs[:, 0], dt[:, 0], a, bs[:, 0], cs[:, 0], state)
            y = y[:, None]
        else:
            y, new_state = ssd_scan(xs, dt, a, bs, cs, min(c.mamba_chunk_size, t), state)  # no block past the call
        y = (y + self.D[:, None] * xs).reshape(b, t, c.mamba_inner)
        y = self.out_proj(self.norm(y, z))
        if order is not None:
            y = in_call_order(y, order)
        return y, new_window, new_state
