"""The memory layout of a model's linear weights for decoding on the CPU.

A linear layer's weight `(out, in)` is stored row-major: `F.linear(x, W)` hands the BLAS `x @ W^T` with the
weight transposed. For one row (a decode step of one sequence) the BLAS then runs its transposed
matrix-vector product, which on some CPUs (an AMD EPYC with MKL: docs/cpu_speed.md) reads the weight at well
under the memory's bandwidth; stored column-major (strides `(1, out)`, the memory of `W^T`), the same call is
the BLAS's plain product, which streams the weight. The values, the parameters and every caller stay the
same; only the one-row product's summation order may change (products of more rows are packed by the BLAS either
way). `litkv.checkpoints.runtime.load_for_inference` applies it to a model loaded onto the CPU.

The moved float32 layers become `litkv.modeling.row_linear.RowLinear` (an `nn.Linear` whose decode-step calls
take a C product that reads a column-major weight once, in order; `RowLinear.fits`): the same parameters and
state dict.
"""

from __future__ import annotations

import torch
from torch import nn

from litkv.modeling.row_linear import RowLinear

__all__ = ["COLUMN_MAJOR_DTYPES", "columns_contiguous"]

#: The dtypes whose one-row products the layout serves; PyTorch's 16-bit CPU products ran slower column-major
#: (`scripts/bench_weight_layout.py --dtype bfloat16`), so 16-bit weights stay row-major.
COLUMN_MAJOR_DTYPES = (torch.float32, torch.float64)


def columns_contiguous(model: nn.Module) -> nn.Module:
    """Store every float32 / float64 `nn.Linear` weight of `model` that lives on the CPU column-major (in place;
    a weight shared by several layers, such as a tied embedding, is moved once and stays shared); returns
    `model`. Other weights (16-bit, quantised layers, other devices) keep their layout.

    The parameters keep their identity, values, shapes and `requires_grad`; the linear weights' strides become
    `(1, out)`, and the plain `nn.Linear` layers whose weight `RowLinear` takes become that class. When any
    moved, the model's other CPU parameters are copied as they are, so that no parameter is left in the memory
    the weights were loaded into (a safetensors file maps the whole file, which stays mapped while any one of its
    tensors lives). Writers that need contiguous tensors (safetensors) copy them first, as
    `save_state_dict_atomic` does.
    """
    moved: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None) if isinstance(module, nn.Linear) else None
        if isinstance(weight, nn.Parameter) and id(weight) not in moved and _movable(weight):
            moved.add(id(weight))
            weight.data = weight.data.t().contiguous().t()
        if RowLinear.fits(module):
            module.__class__ = RowLinear
    if not moved:  # nothing changed layout: the model keeps its memory as it is
        return model
    for param in model.parameters():  # each parameter once (shared ones included)
        if id(param) not in moved and param.device.type == "cpu":
            param.data = param.data.clone()
    return model


def _movable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in COLUMN_MAJOR_DTYPES and weight.dim() == 2
