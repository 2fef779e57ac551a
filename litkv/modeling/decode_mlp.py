"""A decode step's MLP half of a block in one C call: RMSNorm, SwiGLU MLP over int4 weights, and the residual.

An eager decode step of an int4 model spends more on Python and dispatch than on its products: the block's
`norm_2`, `mlp` (three quantised layers, silu, a product) and the residual are about ten operators and five module
calls a layer. Where a block is the plain LLaMA shape (LitGPT's `RMSNorm` without a unit offset, `LLaMAMLP` with
`Int4Linear` layers of one group size and no bias, no norm after the MLP) and the call is a decode step that the C
products take (`quant_rows`: float32 rows on the CPU, at most `MAX_ROWS`, no autograd), `mlp_step` computes `x +
mlp(norm_2(x))` by `mlp_rows` instead: one C call where PyTorch runs on one thread, else the modules' own operators
(inside `torch.compile` the op `litkv::int4_mlp`, which decides when it runs, so compiled and eager steps agree).
The C call's products are the layers' own (the same as their calls); its norm's sum and silu's exponential round
differently from PyTorch's, within a few units in the last place (`tests/modeling/test_decode_mlp.py`). Elsewhere
`mlp_step` returns None and the block runs its modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from litgpt.model import LLaMAMLP, RMSNorm
from torch import nn

from litkv.modeling import quant_rows
from litkv.modeling.quant_weights import Int4Linear

__all__ = ["mlp_rows", "mlp_rows_op", "mlp_step"]


def mlp_step(norm: nn.Module | None, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`x + mlp(norm(x))` for `x` `(B, T, C)` by `mlp_rows` where the block and the call fit (the module
    docstring), else None (the caller runs its modules)."""
    if not (quant_rows.CPU_KERNEL and type(mlp) is LLaMAMLP):
        return None
    layers = (mlp.fc_1, mlp.fc_2, mlp.proj)
    if not (_layers_fit(layers, x.shape[-1]) and _plain_norm(norm) and _rows(x)):
        return None
    flat = x.reshape(-1, x.shape[-1])
    weights = [[layer.packed, layer.scale_zeros] for layer in layers]
    group = layers[0].group_size
    rows = mlp_rows_op if torch.compiler.is_compiling() else mlp_rows
    return rows(flat, norm.weight, norm.eps, *weights, group).view(x.shape)


def mlp_rows(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    fc_1: list[torch.Tensor],
    fc_2: list[torch.Tensor],
    proj: list[torch.Tensor],
    group_size: int,
) -> torch.Tensor:
    """`x + proj(silu(fc_1(m)) * fc_2(m))` with `m = x / sqrt(mean(x^2) + eps) * norm_weight`: `x` `(rows, C)`
    float32 (1 to `MAX_ROWS` rows), `norm_weight` `(C,)` float32, each layer `[packed, scale_zeros]` as
    `quant_rows.int4_rows` takes them (`fc_1`, `fc_2` `(H, C)`, `proj` `(C, H)`) -> `(rows, C)` float32. By one C
    call (`litkv_int4_mlp`: each product as `int4_rows`'s, silu's exponential by a polynomial within a few units in
    the last place) where PyTorch runs on one thread and the library is there; else the blocks' own operators
    (`_composed`: the bits the modules give)."""
    lib = quant_rows.library() if quant_rows.one_thread() else None
    if lib is None:
        return _composed(x, norm_weight, eps, fc_1, fc_2, proj, group_size)
    xc, w = x.contiguous(), norm_weight.contiguous()
    pointers = [t.contiguous().data_ptr() for t in (*fc_1, *fc_2, *proj)]
    y = torch.empty_like(xc)
    rows, width = xc.shape
    if lib.litkv_int4_mlp(
        xc.data_ptr(), w.data_ptr(), eps, *pointers, y.data_ptr(), rows, width, fc_1[0].shape[0], group_size
    ):
        return _composed(x, norm_weight, eps, fc_1, fc_2, proj, group_size)  # memory short in C
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
) -> torch.Tensor:
    """`mlp_rows` by the operators the modules run where the C call is not taken (PyTorch on more threads, no
    library): LitGPT's `RMSNorm` in float32, each product PyTorch's packed kernel (`Int4Linear.kernel` there),
    `F.silu(a) * b`, the residual."""
    m = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * norm_weight
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
