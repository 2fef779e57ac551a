"""A decode step's two halves of a block over int4 weights, each in one C call (`quant_rows_cpu.c`).

An eager decode step of an int4 model spends more on Python and dispatch than on its products: a block's norms,
five quantised layers, RoPE, silu and residuals are some thirty operators and ten module calls a layer. Where a block
is the plain LLaMA shape (LitGPT's `RMSNorm` without a unit offset; `LLaMAMLP` and the attention's `qkv` of
`Int4Linear` layers without bias; RoPE over whole heads in half-split pairs, no q/k norms; no norm after the MLP)
and the call is one the C products take (`quant_rows`: float32 rows on the CPU, at most `MAX_ROWS`, no autograd):

- `qkv_step`: `norm_1(x)`, then the queries and keys with RoPE and the values, by `qkv_rows`;
- `mlp_step`: `x + mlp(norm_2(x))`, by `mlp_rows`, with `x` first plus the attention's output projection where the
  block hands it in (`Block._residual_chain`: an int4 `proj` without bias, no gate, no norm between).

Each is one C call where PyTorch runs on one thread, else the modules' own operators (inside `torch.compile` the ops
`litkv::int4_qkv` / `litkv::int4_mlp`, which decide when they run, so compiled and eager steps agree). The C calls'
products are the layers' own (the same as their calls); their norm's sum, RoPE's and silu's arithmetic (silu's
exponential by a polynomial) round differently from PyTorch's, within a few units in the last place
(`tests/modeling/test_fused_decode.py`). Elsewhere the steps return None and the block runs its modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from litgpt.config import Config
from litgpt.model import LLaMAMLP, RMSNorm
from torch import nn

from litkv.core.rope import apply_rope
from litkv.modeling import quant_rows
from litkv.modeling.quant_weights import Int4Linear
from litkv.modeling.self_attention import rotated_together

__all__ = ["mlp_rows", "mlp_rows_op", "mlp_step", "qkv_rows", "qkv_rows_op", "qkv_step"]


def mlp_step(
    norm: nn.Module | None,
    mlp: nn.Module,
    x: torch.Tensor,
    heads: torch.Tensor | None,
    attn_proj: nn.Module | None,
) -> torch.Tensor | None:
    """`x + mlp(norm(x))` for `x` `(B, T, C)` by `mlp_rows` where the block and the call fit (the module
    docstring), else None (the caller runs its modules). With the attention's output `heads` `(B, T, A)` and its
    projection `attn_proj` (an int4 layer of the MLP's group size, no bias): `h + mlp(norm(h))` with `h = x +
    attn_proj(heads)`, the projection in the same call."""
    if not (quant_rows.CPU_KERNEL and type(mlp) is LLaMAMLP):
        return None
    layers = (mlp.fc_1, mlp.fc_2, mlp.proj)
    if not (_layers_fit(layers, x.shape[-1]) and _plain_norm(norm) and _rows(x)):
        return None
    group = layers[0].group_size
    flat = x.reshape(-1, x.shape[-1])
    attention: list[torch.Tensor] = []
    if heads is not None:
        if not _projection_fits(attn_proj, heads, x, group):
            return None
        attention = [heads.reshape(flat.shape[0], -1), attn_proj.packed, attn_proj.scale_zeros]
    weights = [[layer.packed, layer.scale_zeros] for layer in layers]
    rows = mlp_rows_op if torch.compiler.is_compiling() else mlp_rows
    return rows(flat, norm.weight, norm.eps, *weights, group, attention).view(x.shape)


def mlp_rows(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    fc_1: list[torch.Tensor],
    fc_2: list[torch.Tensor],
    proj: list[torch.Tensor],
    group_size: int,
    attention: list[torch.Tensor],
) -> torch.Tensor:
    """`h + proj(silu(fc_1(m)) * fc_2(m))` with `m = h / sqrt(mean(h^2) + eps) * norm_weight`, `h = x` `(rows, C)`
    float32 (1 to `MAX_ROWS` rows), or where `attention` is `[heads (rows, A), packed, scale_zeros]` (not empty)
    `h = x + heads @ W_attn^T`; `norm_weight` `(C,)` float32, each layer `[packed, scale_zeros]` as
    `quant_rows.int4_rows` takes them (`fc_1`, `fc_2` `(H, C)`, `proj` `(C, H)`, the attention's `(C, A)`, all of
    `group_size`) -> `(rows, C)` float32. By one C call (`litkv_int4_mlp`: each product as `int4_rows`'s, silu's
    exponential by a polynomial within a few units in the last place) where PyTorch runs on one thread and the
    library is there; else the blocks' own operators (`_composed`: the bits the modules give)."""
    lib = quant_rows.library() if quant_rows.one_thread() else None
    if lib is None:
        return _composed(x, norm_weight, eps, fc_1, fc_2, proj, group_size, attention)
    xc, w = x.contiguous(), norm_weight.contiguous()
    pointers = [t.contiguous().data_ptr() for t in (*fc_1, *fc_2, *proj)]
    extra = (0, 0, 0, 0)  # no attention projection: NULL
    if attention:
        heads, attn_codes, attn_scales = (t.contiguous() for t in attention)
        extra = (heads.data_ptr(), attn_codes.data_ptr(), attn_scales.data_ptr(), heads.shape[1])
    y = torch.empty_like(xc)
    rows, width = xc.shape
    sizes = (rows, width, fc_1[0].shape[0], group_size)
    if lib.litkv_int4_mlp(*extra, xc.data_ptr(), w.data_ptr(), eps, *pointers, y.data_ptr(), *sizes):
        return _composed(x, norm_weight, eps, fc_1, fc_2, proj, group_size, attention)  # memory short in C
    return y


mlp_rows_op = torch.library.custom_op("litkv::int4_mlp", mlp_rows, mutates_args=())


@mlp_rows_op.register_fake
def _mlp_shape(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    fc_1: list[torch.Tensor],
    fc_2: list[torch.Tensor],
    proj: list[torch.Tensor],
    group_size: int,
    attention: list[torch.Tensor],
) -> torch.Tensor:
    return torch.empty_like(x)


def _composed(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    fc_1: list[torch.Tensor],
    fc_2: list[torch.Tensor],
    proj: list[torch.Tensor],
    group_size: int,
    attention: list[torch.Tensor],
) -> torch.Tensor:
    """`mlp_rows` by the operators the modules run where the C call is not taken (PyTorch on more threads, no
    library): each product PyTorch's packed kernel (`Int4Linear.kernel` there), the attention's projection plus
    the residual, LitGPT's `RMSNorm` in float32, `F.silu(a) * b`, the residual."""
    if attention:
        x = quant_rows.int4_packed(attention[0], attention[1], attention[2], group_size) + x
    m = _rms_norm(x, norm_weight, eps)
    a, b = (quant_rows.int4_packed(m, packed, sz, group_size) for packed, sz in (fc_1, fc_2))
    return quant_rows.int4_packed(F.silu(a) * b, *proj, group_size) + x


def _plain_norm(norm: nn.Module | None) -> bool:
    """Whether `norm` is LitGPT's RMSNorm over the last dimension without a unit offset, in float32."""
    return type(norm) is RMSNorm and not norm.add_unit_offset and norm.dim == -1 and norm.weight.dtype is torch.float32


def _rows(x: torch.Tensor) -> bool:
    """Whether `x` `(..., C)` is a decode call the C products take: float32 on the CPU, 1 to `MAX_ROWS` rows, no
    autograd."""
    flat_rows = x.numel() // x.shape[-1] if x.dim() >= 2 and x.shape[-1] else 0
    return (
        x.is_cpu
        and x.dtype is torch.float32
        and 1 <= flat_rows <= quant_rows.MAX_ROWS
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def _projection_fits(layer: nn.Module | None, heads: torch.Tensor, x: torch.Tensor, group: int) -> bool:
    """Whether the attention's projection `layer` of `heads` `(B, T, A)` into `x`'s `(B, T, C)` is an int4 layer the
    C products read, without bias, of the MLP's `group` size (its `C` outputs whole 64-row blocks: `_layers_fit`)."""
    return (
        type(layer) is Int4Linear
        and layer.bias is None
        and layer.unpackable
        and layer.group_size == group
        and layer.in_features == heads.shape[-1]
        and layer.out_features == x.shape[-1]
        and heads.dtype is torch.float32
        and heads.shape[:-1] == x.shape[:-1]
    )


def _layers_fit(layers: tuple[nn.Module, nn.Module, nn.Module], width: int) -> bool:
    """Whether `LLaMAMLP`'s `fc_1`, `fc_2`, `proj` are int4 layers the C products read, without bias, of one group
    size, chaining `width -> H -> width` in whole 64-row blocks."""
    fc_1, fc_2, proj = layers
    if not all(type(layer) is Int4Linear and layer.bias is None and layer.unpackable for layer in layers):
        return False
    hidden, group = fc_1.out_features, fc_1.group_size
    return (
        fc_1.in_features == fc_2.in_features == proj.out_features == width
        and fc_2.out_features == proj.in_features == hidden
        and fc_2.group_size == proj.group_size == group
        and width % 64 == 0
        and hidden % 64 == 0
        and group % 32 == 0
    )


def qkv_step(
    norm: nn.Module, qkv: nn.Module, config: Config, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`norm(x)` `(B, T, C)` and the attention's queries `(B, n_head, T, hs)`, keys and values `(B, G, T, hs)`
    (RoPE by `cos`, `sin` `(B or 1, T, hs)`) by `qkv_rows` where the layer and the call fit (the module docstring),
    else None (the caller runs its modules)."""
    if not (quant_rows.CPU_KERNEL and type(qkv) is Int4Linear and qkv.bias is None and qkv.unpackable):
        return None
    hs, heads, groups = config.head_size, config.n_head, config.n_query_groups
    fits = (
        not config.norm_qk
        and not config.rope_interleave
        and config.rope_n_elem == hs
        and hs % 2 == 0
        and qkv.in_features == x.shape[-1]
        and qkv.out_features == (heads + 2 * groups) * hs
        and qkv.out_features % 64 == 0
        and qkv.group_size % 32 == 0
        and x.shape[-1] % 16 == 0
        and x.dim() == 3
        and cos.shape == sin.shape == (cos.shape[0], x.shape[1], hs)
        and cos.shape[0] in (1, x.shape[0])
        and cos.dtype is sin.dtype is torch.float32
    )
    if not (fits and _plain_norm(norm) and _rows(x)):
        return None
    rows = qkv_rows_op if torch.compiler.is_compiling() else qkv_rows
    return rows(x, norm.weight, norm.eps, qkv.packed, qkv.scale_zeros, cos, sin, heads, groups, qkv.group_size)


def qkv_rows(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    packed: torch.Tensor,
    scale_zeros: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_head: int,
    n_groups: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`m = x / sqrt(mean(x^2) + eps) * norm_weight` `(B, T, C)`, then `m`'s projection by an int4 layer (`packed`,
    `scale_zeros` as `quant_rows.int4_rows` takes them, `(n_head + 2 n_groups) * hs` outputs) split into queries
    `(B, n_head, T, hs)` and keys `(B, n_groups, T, hs)` rotated by RoPE (`cos`, `sin` `(B or 1, T, hs)`, half-split
    pairs) and values `(B, n_groups, T, hs)`, all float32 and contiguous. By one C call (`litkv_int4_qkv`) where
    PyTorch runs on one thread and the library is there; else the modules' operators (`_composed_qkv`)."""
    lib = quant_rows.library() if quant_rows.one_thread() else None
    b, t, width = x.shape
    hs = cos.shape[-1]
    if lib is None:
        return _composed_qkv(x, norm_weight, eps, packed, scale_zeros, cos, sin, n_head, n_groups, group_size)
    xc, w, c, s = x.contiguous(), norm_weight.contiguous(), cos.contiguous(), sin.contiguous()
    m = torch.empty_like(xc)
    q = x.new_empty(b, n_head, t, hs)
    k, v = x.new_empty(b, n_groups, t, hs), x.new_empty(b, n_groups, t, hs)
    weights = [packed.contiguous().data_ptr(), scale_zeros.contiguous().data_ptr()]
    tensors = [tensor.data_ptr() for tensor in (c, s, m, q, k, v)]
    sizes = (b, t, c.shape[0], width, n_head, n_groups, hs, group_size)
    if lib.litkv_int4_qkv(xc.data_ptr(), w.data_ptr(), eps, *weights, *tensors, *sizes):
        return _composed_qkv(x, norm_weight, eps, packed, scale_zeros, cos, sin, n_head, n_groups, group_size)
    return m, q, k, v


qkv_rows_op = torch.library.custom_op("litkv::int4_qkv", qkv_rows, mutates_args=())


@qkv_rows_op.register_fake
def _qkv_shape(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    packed: torch.Tensor,
    scale_zeros: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_head: int,
    n_groups: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, t, _ = x.shape
    hs = cos.shape[-1]
    kv = (x.new_empty(b, n_groups, t, hs) for _ in range(2))
    return torch.empty_like(x), x.new_empty(b, n_head, t, hs), *kv


def _composed_qkv(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    packed: torch.Tensor,
    scale_zeros: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_head: int,
    n_groups: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv_rows` by the operators the modules run where the C call is not taken: LitGPT's `RMSNorm`, the packed
    kernel (`Int4Linear.kernel` there), `CausalSelfAttention.heads`' split and RoPE (`rotated_together`)."""
    b, t, width = x.shape
    m = _rms_norm(x, norm_weight, eps)
    projected = quant_rows.int4_packed(m.reshape(-1, width), packed, scale_zeros, group_size).view(b, t, -1)
    q, k, v = rotated_together(projected, cos, sin, n_head, n_groups, cos.shape[-1], apply_rope)
    return m, q, k, v.contiguous()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LitGPT's `RMSNorm.forward` for float32 `x` and `weight`, operator for operator."""
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * weight
