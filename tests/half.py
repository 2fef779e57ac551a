"""Helpers of the 16-bit tests: a model in bfloat16/float16 and its float64 twin with the very same
(rounded) weights, and the tolerance of a 16-bit computation against that twin.

Tolerances scale with the dtype's machine epsilon (`torch.finfo(dtype).eps`: 2^-7 for bfloat16, 2^-10
for float16): a 16-bit run rounds every activation, so its error against the float64 twin is a few eps
relative to the largest value compared, not the `sqrt(depth)` growth of a float32 accumulation (the
products accumulate in float32 inside the kernels, `helpers.rounding_bound`).
"""

from __future__ import annotations

import copy

import torch
from helpers import float64_model, tiny_gpt

from litkv import GPT

HALF_DTYPES = (torch.bfloat16, torch.float16)
#: Multiples of eps(dtype) * max|reference| a 16-bit forward of the tiny 2-layer model may differ by.
LOGIT_EPS = 24.0


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def half_pair(dtype: torch.dtype, seed: int = 21) -> tuple[GPT, GPT]:
    """(the tiny model in `dtype` with random gates, its float64 twin holding the same rounded weights)."""
    model = tiny_gpt(seed, gates=True).to(dtype)
    return model, float64_model(copy.deepcopy(model))


def half_bound(reference: torch.Tensor, dtype: torch.dtype, eps_multiple: float = LOGIT_EPS) -> float:
    """`eps_multiple * eps(dtype) * max|reference|`."""
    return eps_multiple * torch.finfo(dtype).eps * reference.detach().abs().max().item()
