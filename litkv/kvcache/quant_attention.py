"""Attention over int8/int4 slots straight from their codes, without dequantising the cache.

A quantised number is `x = offset_g + scale_g * c` (`QuantizedSlots`: per-group 16-bit scales and
offsets, integer codes `c`). For a query `q` and a key, with the sums over the groups `g` of the
head dimension,

    q . k = sum_g scale_g * (q_g . c_g) + offset_g * sum(q_g)

and for the softmax weights `p` over the slots `s` and a value group `g`,

    y_g = sum_s (p_s * scale_sg) * c_sg + (sum_s p_s * offset_sg)

so both products are matrix products on the codes (as numbers: int4's two nibbles are unpacked into
one float buffer, the only full-size temporary) with the scales and offsets applied to the small
`(queries, slots)` and `(queries, groups)` results. With several groups per head the queries are
spread block-diagonally (one row per (query, group), zeros outside the group), so the codes are
read in their stored layout and never copied. Grouped-query attention folds a KV group's query heads
into the query axis as `litkv.modeling.attention` does. Scores, softmax and products run in float32 (float64
for float64 models); the softmax weights summed over the queries and each group's heads come back
on request, as from `attention.attend(..., need_weights=True)`.

Tolerance: against dequantising then `attention.attend` the result differs only by rounding, since
the scales multiply a sum of products instead of each product: within 1e-10 in float64 and within
`atol=1e-5, rtol=1e-4` in float32 (outputs and weight sums; `tests/kvcache/test_quant_attention.py`).

Under `torch.compile` the kernel is one opaque op (`litkv::quant_attend`), as `litkv::masked_sdpa`:
compiled decode steps compute what eager ones do.

On CUDA a decode step (one query per row) takes a Triton kernel instead
(`litkv.kvcache.kernels.quant_decode`: dequantisation in registers, the attention and the weight sums in
one pass over the codes), inside the same op; this PyTorch path is the CPU's and every other call's.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch

from litkv.kvcache.kernels import cpu_decode
from litkv.kvcache.quant_int import int_scores, int_weighted_values, integer_parts, integer_path

__all__ = ["CodeSlots", "quant_attend"]

# Largest number of score elements held at once (as `attention.WEIGHTS_BLOCK_ELEMENTS`).
BLOCK_ELEMENTS = 1 << 24
#: Whether a decode step on CUDA takes the Triton kernel (`litkv.kvcache.kernels.quant_decode`) where it
#: applies; False: the PyTorch path everywhere (`scripts/gpu_bench.py --no-triton` measures it).
TRITON_DECODE = True


class CodeSlots(Protocol):
    """What the kernel reads of quantised slots (`litkv.kvcache.quantized.QuantizedSlots`)."""

    codes: torch.Tensor  # (B, G, S, 2, D * bits / 8) uint8; index 0 of the fourth axis: key, 1: value
    scales: torch.Tensor  # (B, G, S, 2, D / group_size)
    offsets: torch.Tensor  # (B, G, S, 2, D / group_size)
    bits: int
    group_size: int

    @property
    def shape(self) -> torch.Size: ...


def quant_attend(
    q: torch.Tensor,
    slots: CodeSlots,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    need_weights: bool = False,
    query_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked grouped-query attention of `q` over quantised keys and values.

    Args:
        q: `(B, n_head, T, D)` queries, `n_head` a multiple of the slots' `G`.
        slots: keys and values of `S` slots (`QuantizedSlots`: codes `(B, G, S, 2, D * bits / 8)`).
        mask: `(B, G, T, S)` or `(B, 1, T, S)` bool, True where attention is allowed; None: one query per head
            (`T = 1`) that sees every slot (no mask built or read).
        scale: factor applied to `q . k`.
        softcap: attention-logit soft-capping threshold, or `None`.
        need_weights: also return the softmax weights summed over queries and each group's heads.
        query_valid: `(B, T)` bool, queries that count in the weight sums (default: all).

    Returns:
        `y` `(B, T, n_head * D)` in `q`'s dtype and the weights `(B, G, S)` float32 (or `None`).
    """
    _check(q, slots, mask, query_valid)
    b, n_head, t, d = q.shape
    g = slots.codes.shape[1]
    folded = q.reshape(b, g, (n_head // g) * t, d)  # a group's heads, then its queries, on one axis
    op = _quant_attend_op if torch.compiler.is_compiling() else _quant_attend_eager
    y, weights = op(
        folded, slots.codes, slots.scales, slots.offsets, mask, query_valid,
        slots.bits, slots.group_size, scale, softcap, need_weights,
    )  # fmt: skip
    y = y.view(b, n_head, t, d).transpose(1, 2).reshape(b, t, n_head * d)
    return y, weights if need_weights else None


def _check(q: torch.Tensor, slots: CodeSlots, mask: torch.Tensor | None, query_valid: torch.Tensor | None) -> None:
    """Raise ValueError naming the expected and actual shapes when the inputs do not fit together."""
    b, g, s, d = slots.shape
    if q.dim() != 4 or q.shape[0] != b or q.shape[1] % g != 0 or q.shape[3] != d:
        raise ValueError(f"q must be (B={b}, a multiple of G={g}, T, D={d}), got {tuple(q.shape)}")
    t = q.shape[2]
    if mask is None:
        if t != 1:
            raise ValueError(f"mask may be None only for one query per head, got T={t}")
        return
    if mask.dim() != 4 or mask.shape[0] != b or mask.shape[1] not in (1, g) or tuple(mask.shape[2:]) != (t, s):
        raise ValueError(f"mask must be ({b}, {g} or 1, {t}, {s}), got {tuple(mask.shape)}")
    if query_valid is not None and tuple(query_valid.shape) != (b, t):
        raise ValueError(f"query_valid must be ({b}, {t}), got {tuple(query_valid.shape)}")


def _quant_attend_eager(
    q: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    mask: torch.Tensor | None,
    query_valid: torch.Tensor | None,
    bits: int,
    group_size: int,
    scale: float,
    softcap: float | None,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op: a decode step on CUDA takes the Triton kernel (`kernels.quant_decode`, while `TRITON_DECODE`), one
    on the CPU the C kernel (`kernels.cpu_decode`, where it builds), every other call the PyTorch path
    (`_quant_attend_torch`); shapes as there (`mask` None: one query per head, every slot seen)."""
    t = 1 if mask is None else mask.shape[2]
    if TRITON_DECODE and q.is_cuda and t == 1:
        from litkv.kvcache.kernels import quant_decode  # imports triton: only on CUDA

        if quant_decode.supported(q, 1, q.shape[-1]):
            every = _every_slot(mask, q, codes)
            return quant_decode.decode_attend(
                q, codes, scales, offsets, every, query_valid, bits, group_size, scale, softcap, need_weights
            )
    if cpu_decode.supported(q, t):
        done = cpu_decode.decode_attend(
            q, codes, scales, offsets, mask, query_valid, bits, group_size, scale, softcap, need_weights
        )
        if done is not None:
            return done
    every = _every_slot(mask, q, codes)
    return _quant_attend_torch(
        q, codes, scales, offsets, every, query_valid, bits, group_size, scale, softcap, need_weights
    )


def _every_slot(mask: torch.Tensor | None, q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """`mask`, or where None (one query per head that sees every slot) an all-True `(B, 1, 1, S)` mask, expanded."""
    if mask is not None:
        return mask
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device).expand(q.shape[0], 1, 1, codes.shape[2])


def _quant_attend_torch(
    q: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    mask: torch.Tensor,
    query_valid: torch.Tensor | None,
    bits: int,
    group_size: int,
    scale: float,
    softcap: float | None,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path. `q` `(B, G, M, D)` with `M = q_per_kv * T` (heads, then queries), `mask`
    `(B, G or 1, T, S)` -> `y` `(B, G, M, D)` in `q`'s dtype and weight sums `(B, G, S)` float32
    (a 0-element tensor unless `need_weights`); blockwise over the queries."""
    b, g, m, d = q.shape
    t, s = mask.shape[2], codes.shape[2]
    per_kv = m // t
    dtype = torch.promote_types(q.dtype, torch.float32)
    factors, shifts = (x.to(dtype).permute(0, 1, 3, 4, 2) for x in (scales, offsets))  # (B, G, 2, n, S)
    if integer_path(codes, bits, dtype, t):
        key_parts, value_parts = integer_parts(codes, bits)
        bias = 128 if bits == 8 else 0  # int8 codes are stored biased by -128
        score_fn = partial(_int_scores, parts=key_parts, bias=bias)
        value_fn = partial(_int_values, parts=value_parts, bias=bias)
        keys = values = codes  # read through the parts
    else:
        numbers = _numbers(codes, bits, dtype)  # (B, G, S, 2, D): a full-size float temporary
        keys, values = numbers[:, :, :, 0], numbers[:, :, :, 1]
        score_fn, value_fn = _scores, _weighted_values
    queries = q.to(dtype) * scale
    block = max(1, BLOCK_ELEMENTS // max(1, b * g * per_kv * s))
    outputs = []
    weight_sum = torch.zeros(b, g, s, dtype=torch.float32, device=q.device) if need_weights else q.new_empty(0)
    for start in range(0, t, block):
        n = min(block, t - start)
        part = queries if n == t else queries.view(b, g, per_kv, t, d)[:, :, :, start : start + n]
        scores = score_fn(part.reshape(b, g, per_kv * n, d), keys, factors[:, :, 0], shifts[:, :, 0])
        scores = scores.view(b, g, per_kv, n, s)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = torch.where(mask[:, :, None, start : start + n], scores, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = value_fn(probs.view(b, g, per_kv * n, s), values, factors[:, :, 1], shifts[:, :, 1])
        outputs.append(out.view(b, g, per_kv, n, d))
        if need_weights:
            if query_valid is not None:
                probs = probs * query_valid[:, None, None, start : start + n, None]
            weight_sum += probs.sum(dim=(2, 3))
    y = torch.cat(outputs, dim=3) if len(outputs) > 1 else outputs[0]
    return y.view(b, g, m, d).to(q.dtype), weight_sum


def _int_scores(
    q: torch.Tensor, _codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, parts: list, bias: int
) -> torch.Tensor:
    return int_scores(q, scales, offsets, parts, bias)


def _int_values(
    probs: torch.Tensor, _codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, parts: list, bias: int
) -> torch.Tensor:
    return int_weighted_values(probs, scales, offsets, parts, bias)


def _numbers(codes: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Codes `(B, G, S, 2, D * bits / 8)` as numbers `(B, G, S, 2, D)` in `dtype`, in their stored order
    (the products read keys and values as strided matrices; a transposing conversion is much slower)."""
    if bits == 8:
        return codes.view(torch.int8).to(dtype).add_(128)  # stored biased (`quantized.quantize`)
    width = codes.shape[-1]
    out = torch.empty(*codes.shape[:-1], 2 * width, dtype=dtype, device=codes.device)
    out[..., :width] = codes & 0x0F  # int4: element i in the low nibble, i + D / 2 in the high one
    out[..., width:] = codes >> 4
    return out


def _scores(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`q . k` from the codes: `q` `(B, G, M, D)`, `codes` `(B, G, S, D)` (numbers), `scales`/`offsets`
    `(B, G, n, S)` for `n` groups per head -> `(B, G, M, S)`."""
    b, g, m, d = q.shape
    n = scales.shape[2]
    by_group = q.view(b, g, m, n, d // n)
    if n == 1:
        offset_part = q.sum(dim=-1, keepdim=True) * offsets  # offset * sum(q): an outer product
        return torch.addcmul(offset_part, torch.matmul(q, codes.transpose(-1, -2)), scales)
    offset_part = torch.matmul(by_group.sum(dim=-1), offsets)  # sum_g offset_g * sum(q_g)
    spread = _block_diagonal(by_group)  # (B, G, M * n, D): row (query, group) holds that group only
    per_group = torch.matmul(spread, codes.transpose(-1, -2)).view(b, g, m, n, -1)
    return (per_group * scales[:, :, None]).sum(dim=3) + offset_part


def _weighted_values(
    probs: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """`probs @ values` from the codes: `probs` `(B, G, M, S)`, `codes` `(B, G, S, D)` (numbers),
    `scales`/`offsets` `(B, G, n, S)` -> `(B, G, M, D)`."""
    b, g, m, s = probs.shape
    n, d = scales.shape[2], codes.shape[-1]
    offset_part = torch.matmul(probs, offsets.transpose(-1, -2))  # (B, G, M, n): sum_s p_s * offset_sg
    if n == 1:
        return torch.matmul(probs * scales, codes).add_(offset_part)
    scaled = (probs[:, :, :, None] * scales[:, :, None]).reshape(b, g, m * n, s)  # row (query, group)
    full = torch.matmul(scaled, codes).view(b, g, m, n, n, d // n)  # [.., group of the weights, group of D, :]
    own = full.diagonal(dim1=3, dim2=4)  # (B, G, M, D / n, n): each group's columns with its own weights
    return (own + offset_part[:, :, :, None]).transpose(-1, -2).reshape(b, g, m, d)


def _block_diagonal(by_group: torch.Tensor) -> torch.Tensor:
    """`(B, G, M, n, D / n)` -> `(B, G, M * n, D)`: row `(i, j)` is query `i` with every group but `j` zeroed."""
    b, g, m, n, size = by_group.shape
    eye = torch.eye(n, dtype=by_group.dtype, device=by_group.device)
    return (by_group[:, :, :, None] * eye[:, :, None]).reshape(b, g, m * n, n * size)


_quant_attend_op = torch.library.custom_op("litkv::quant_attend", _quant_attend_eager, mutates_args=())


@_quant_attend_op.register_fake
def _quant_attend_shape(
    q: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    mask: torch.Tensor | None,
    query_valid: torch.Tensor | None,
    bits: int,
    group_size: int,
    scale: float,
    softcap: float | None,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, g, s = codes.shape[:3]
    weights = q.new_empty(b, g, s, dtype=torch.float32) if need_weights else q.new_empty(0)
    return torch.empty_like(q), weights
