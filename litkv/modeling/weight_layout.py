"""The memory layout of a model's linear weights for decoding on the CPU.

A linear layer's weight `(out, in)` is stored row-major: `F.linear(x, W)` hands the BLAS `x @ W^T` with the
weight transposed. For one row (a decode step of one sequence) the BLAS then runs its transposed
matrix-vector product, which on some CPUs (an AMD EPYC with MKL: docs/cpu_speed.md) reads the weight at well
under the memory's bandwidth; stored column-major (strides `(1, out)`, the memory of `W^T`), the same call is
the BLAS's plain product, which streams the weight. The values, the module and every caller stay the same;
only the one-row product's summation order may change (products of more rows are packed by the BLAS either
way). `litkv.checkpoints.runtime.load_for_inference` applies it to a model loaded onto the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["columns_contiguous"]


def columns_contiguous(model: nn.Module) -> nn.Module:
    """Store every floating-point `nn.Linear` weight of `model` that lives on the CPU column-major (in place;
    a weight shared by several layers, such as a tied embedding, is moved once and stays shared); returns
    `model`. Other weights (quantised layers, other devices) are left as they are.

    The parameters keep their identity, values, shapes and `requires_grad`; their strides become `(1, out)`.
    Writers that need contiguous tensors (safetensors) copy them first, as `save_state_dict` does.
    """
    seen: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None) if isinstance(module, nn.Linear) else None
        if not isinstance(weight, nn.Parameter) or id(weight) in seen:
            continue
        seen.add(id(weight))
        if weight.device.type == "cpu" and weight.dtype.is_floating_point and weight.dim() == 2:
            with torch.no_grad():
                weight.data = weight.data.t().contiguous().t()
    return model
