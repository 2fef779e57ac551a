"""A quantised cache's decode attention as one Triton kernel pass (CUDA): dequantisation in registers,
grouped-query attention over the slots, and the per-slot weight sums that h2o / qh2o read.

The PyTorch path (`litkv.kvcache.quant_attention`) reads the codes several times per step (the score
product, the masked softmax, the value product, the weight sums are each a kernel launch with a
`(B, G, q_per_kv, S)` temporary between them). Here a decode step (one query per row) reads each slot's
codes, scales and offsets once:

1. `_partial_kernel`, one program per (row, KV head, split of the slots): for blocks of `BLOCK_S` slots it
   loads the key codes (int8: one byte per number, stored biased by -128; int4: element `i` in the low
   nibble, `i + D / 2` in the high one) and their group's scale and offset, dequantises them in registers
   (`offset + scale * code`, float32), scores the KV head's query heads against them (soft-capped if
   asked), masks the slots the call may not see, and folds them into a running softmax (maximum `m`,
   sum `l`, the weighted sum of the values, dequantised the same way). The masked scores are written to
   a `(B, G, q_per_kv, S)` float32 scratch only when the weights are needed.
2. `_combine_kernel`, one program per (row, KV head, split): merges the splits' `(m, l, sum)` by
   log-sum-exp into the output (the first split's program) and turns its split's scores into the
   weights summed over the query heads, `sum_h exp(score_h - m_h) / l_h` (times `query_valid`).

The splits (flash-decoding) keep the GPU busy at batch 1 with few KV heads: about `PROGRAMS` programs
per call. Scores, softmax and both products run in float32 (`tl.dot` with IEEE float32 inputs, never
TF32), so the result equals the PyTorch path up to float32 rounding: the PyTorch path multiplies the
scale into a sum of products where this kernel multiplies it into each number
(`tests/kvcache/test_quant_decode_kernel.py` states the bounds, against the PyTorch path and a float64
oracle, run by Triton's interpreter on the CPU; `tests/precision/test_cuda.py` compiled on CUDA).

Used where `supported` says so (CUDA, one query per row, float32 / bfloat16 / float16 queries, an even
head size, no autograd); every other call takes the PyTorch path.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["PROGRAMS", "decode_attend", "supported", "triton_available"]

BLOCK_S = 64  # slots per block of a program's loop
PROGRAMS = 256  # programs per call the splits aim at (about two per streaming multiprocessor of an H100)

try:  # triton is optional: without it, `supported` is False and nothing below is called
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU test environments may lack triton
    triton = None


def triton_available() -> bool:
    """Whether triton can be imported (it ships with PyTorch's CUDA wheels on Linux)."""
    return triton is not None or importlib.util.find_spec("triton") is not None


def supported(q: torch.Tensor, t: int, head_size: int) -> bool:
    """Whether a call of `t` queries per row over `head_size` heads (queries `q`) takes this kernel."""
    return (
        triton is not None
        and q.is_cuda
        and t == 1
        and head_size % 2 == 0
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not (torch.is_grad_enabled() and q.requires_grad)
    )


def decode_attend(
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
    split_slots: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over quantised slots (`quant_attention._quant_attend_eager`'s contract at `T = 1`).

    Args:
        q: `(B, G, M, D)` queries, `M` the query heads of a KV head (one query each), `D` even.
        codes: `(B, G, S, 2, D * bits / 8)` uint8 (index 0 of the fourth axis: key, 1: value), the last
            axis contiguous (else copied); `scales`, `offsets`: `(B, G, S, 2, D / group_size)` float16 or bfloat16,
            likewise.
        mask: `(B, G or 1, 1, S)` bool, True where attention is allowed (any strides, expanded included).
        query_valid: `(B, 1)` bool, whether the row's query counts in the weights (default: all).
        bits: 8 or 4; group_size: numbers per scale; scale: factor of `q . k`; softcap: or `None`.
        need_weights: also compute the weights summed over the query heads.
        split_slots: slots per split (a multiple of `BLOCK_S`); default: about `PROGRAMS` programs in all.

    Returns:
        `y` `(B, G, M, D)` in `q`'s dtype and the weights `(B, G, S)` float32 (a 0-element tensor unless
        `need_weights`).
    """
    b, g, m, d = q.shape
    s, half = codes.shape[2], d // 2
    q, codes, scales, offsets = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, codes, scales, offsets))
    if split_slots is None:
        splits = max(1, min(triton.cdiv(s, BLOCK_S), triton.cdiv(PROGRAMS, b * g)))
        split_slots = triton.cdiv(triton.cdiv(s, splits), BLOCK_S) * BLOCK_S
    splits = triton.cdiv(s, split_slots)
    block_h = max(16, triton.next_power_of_2(m))  # tl.dot takes blocks of at least 16
    block_d = max(16, triton.next_power_of_2(half))
    f32 = dict(dtype=torch.float32, device=q.device)
    m_part = torch.empty(b * g, splits, block_h, **f32)
    l_part = torch.empty(b * g, splits, block_h, **f32)
    acc_part = torch.empty(b * g, splits, block_h, 2 * block_d, **f32)
    scores = torch.empty(b, g, m, s, **f32) if need_weights else m_part
    weights = torch.empty(b, g, s, **f32) if need_weights else q.new_empty(0, dtype=torch.float32)
    mask = mask.expand(b, g, 1, s)  # stride 0 over the KV heads of a shared mask
    valid = mask if query_valid is None else query_valid[:, 0].contiguous()  # `mask`: a placeholder pointer
    y = torch.empty_like(q)
    grid = (b * g, splits)
    _partial_kernel[grid](
        q, codes, scales, offsets, mask, scores, m_part, l_part, acc_part,
        g, s, m, half, group_size, split_slots, splits, float(scale), float(softcap or 0.0),
        *q.stride()[:3], *codes.stride()[:4], *scales.stride()[:4], *offsets.stride()[:4],
        mask.stride(0), mask.stride(1), mask.stride(3),
        BITS=bits, SOFTCAP=softcap is not None, NEED_WEIGHTS=need_weights,
        BLOCK_H=block_h, BLOCK_S=BLOCK_S, BLOCK_D=block_d,
    )  # fmt: skip
    _combine_kernel[grid](
        y, weights, scores, m_part, l_part, acc_part, valid,
        g, s, m, half, split_slots, splits, *y.stride()[:3],
        HAS_VALID=query_valid is not None, NEED_WEIGHTS=need_weights,
        BLOCK_H=block_h, BLOCK_S=BLOCK_S, BLOCK_D=block_d, BLOCK_P=triton.next_power_of_2(splits),
    )  # fmt: skip
    return y, weights


if triton is not None:

    @triton.jit
    def _dequantised(
        codes_row, scales_row, offsets_row, offs_s, offs_d, ok,
        stride_cs, stride_ss, stride_os, half, group_size, BITS: tl.constexpr,
    ):  # fmt: skip
        """Both halves of the head dimension (elements `0 .. D/2` and `D/2 .. D`) of a block of slots,
        `(BLOCK_S, BLOCK_D)` float32 each: `offset + scale * code`, zero outside `ok`."""
        if BITS == 8:  # the byte is `code - 128` as int8: `code = byte ^ 128`
            at = codes_row + offs_s[:, None] * stride_cs + offs_d[None, :]
            lo = (tl.load(at, mask=ok, other=128) ^ 128).to(tl.float32)
            hi = (tl.load(at + half, mask=ok, other=128) ^ 128).to(tl.float32)
        else:  # int4: element i in the low nibble, element i + D / 2 in the high one
            byte = tl.load(codes_row + offs_s[:, None] * stride_cs + offs_d[None, :], mask=ok, other=0)
            lo = (byte & 15).to(tl.float32)
            hi = (byte >> 4).to(tl.float32)
        group_lo = (offs_d // group_size)[None, :]
        group_hi = ((offs_d + half) // group_size)[None, :]
        at_s = scales_row + offs_s[:, None] * stride_ss
        at_o = offsets_row + offs_s[:, None] * stride_os
        lo = lo * tl.load(at_s + group_lo, mask=ok, other=0.0).to(tl.float32)
        lo += tl.load(at_o + group_lo, mask=ok, other=0.0).to(tl.float32)
        hi = hi * tl.load(at_s + group_hi, mask=ok, other=0.0).to(tl.float32)
        hi += tl.load(at_o + group_hi, mask=ok, other=0.0).to(tl.float32)
        return lo, hi

    @triton.jit
    def _partial_kernel(
        Q, Codes, Scales, Offsets, Mask, Scores, MPart, LPart, AccPart,
        n_kv, n_slots, n_q, half, group_size, split_slots, n_splits, sm_scale, softcap,
        stride_qb, stride_qg, stride_qm,
        stride_cb, stride_cg, stride_cs, stride_ckv,
        stride_sb, stride_sg, stride_ss, stride_skv,
        stride_ob, stride_og, stride_os, stride_okv,
        stride_mb, stride_mg, stride_ms,
        BITS: tl.constexpr, SOFTCAP: tl.constexpr, NEED_WEIGHTS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One (row, KV head, split): running softmax `(m, l, sum of values)` over the split's slots."""
        bg = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a large cache's codes exceed 2^31 bytes
        split = tl.program_id(1)
        b = bg // n_kv
        g = bg % n_kv
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_ok = offs_h < n_q
        d_ok = offs_d < half
        q_at = Q + b * stride_qb + g * stride_qg + offs_h[:, None] * stride_qm + offs_d[None, :]
        q_ok = h_ok[:, None] & d_ok[None, :]
        q_lo = tl.load(q_at, mask=q_ok, other=0.0).to(tl.float32) * sm_scale
        q_hi = tl.load(q_at + half, mask=q_ok, other=0.0).to(tl.float32) * sm_scale
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc_lo = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        acc_hi = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        codes_row = Codes + b * stride_cb + g * stride_cg
        scales_row = Scales + b * stride_sb + g * stride_sg
        offsets_row = Offsets + b * stride_ob + g * stride_og
        start = split * split_slots
        end = tl.minimum(start + split_slots, n_slots)
        for s0 in range(start, end, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            s_ok = offs_s < end
            ok = s_ok[:, None] & d_ok[None, :]
            k_lo, k_hi = _dequantised(
                codes_row, scales_row, offsets_row, offs_s, offs_d, ok,
                stride_cs, stride_ss, stride_os, half, group_size, BITS,
            )  # fmt: skip
            x = tl.dot(q_lo, tl.trans(k_lo), input_precision="ieee")
            x = tl.dot(q_hi, tl.trans(k_hi), x, input_precision="ieee")  # (BLOCK_H, BLOCK_S)
            if SOFTCAP:  # softcap * tanh(x / softcap), tanh(u) = 1 - 2 / (exp(2u) + 1)
                x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))
            allowed = tl.load(Mask + b * stride_mb + g * stride_mg + offs_s * stride_ms, mask=s_ok, other=0)
            x = tl.where((allowed != 0)[None, :] & s_ok[None, :], x, float("-inf"))
            if NEED_WEIGHTS:
                at = Scores + (bg * n_q + offs_h[:, None]) * n_slots + offs_s[None, :]
                tl.store(at, x, mask=h_ok[:, None] & s_ok[None, :])
            m_new = tl.maximum(m_i, tl.max(x, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing visible yet
            p = tl.exp(x - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_lo, v_hi = _dequantised(
                codes_row + stride_ckv, scales_row + stride_skv, offsets_row + stride_okv, offs_s, offs_d, ok,
                stride_cs, stride_ss, stride_os, half, group_size, BITS,
            )  # fmt: skip
            acc_lo = tl.dot(p, v_lo, acc_lo * alpha[:, None], input_precision="ieee")
            acc_hi = tl.dot(p, v_hi, acc_hi * alpha[:, None], input_precision="ieee")
            m_i = m_new
        part = bg * n_splits + split
        tl.store(MPart + part * BLOCK_H + offs_h, m_i)
        tl.store(LPart + part * BLOCK_H + offs_h, l_i)
        acc_at = AccPart + (part * BLOCK_H + offs_h[:, None]) * (2 * BLOCK_D) + offs_d[None, :]
        tl.store(acc_at, acc_lo)
        tl.store(acc_at + BLOCK_D, acc_hi)

    @triton.jit
    def _combine_kernel(
        Y, Weights, Scores, MPart, LPart, AccPart, Valid,
        n_kv, n_slots, n_q, half, split_slots, n_splits, stride_yb, stride_yg, stride_ym,
        HAS_VALID: tl.constexpr, NEED_WEIGHTS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    ):  # fmt: skip
        """One (row, KV head, split): the splits merged by log-sum-exp; the output (first split) and the
        split's weight sums over the query heads."""
        bg = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        offs_h = tl.arange(0, BLOCK_H)
        offs_p = tl.arange(0, BLOCK_P)
        offs_d = tl.arange(0, BLOCK_D)
        h_ok = offs_h < n_q
        p_ok = offs_p < n_splits
        at = (bg * n_splits + offs_p[:, None]) * BLOCK_H + offs_h[None, :]  # (BLOCK_P, BLOCK_H)
        m_parts = tl.load(MPart + at, mask=p_ok[:, None], other=float("-inf"))
        m = tl.max(m_parts, axis=0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        factor = tl.exp(m_parts - m_use[None, :])
        l_total = tl.sum(factor * tl.load(LPart + at, mask=p_ok[:, None], other=0.0), axis=0)
        if split == 0:  # the output: the splits' value sums, each rescaled to the common maximum
            lo = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            hi = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            for p in range(0, n_splits):
                at_p = (bg * n_splits + p) * BLOCK_H + offs_h
                weight = (tl.exp(tl.load(MPart + at_p) - m_use) / l_total)[:, None]
                acc_at = AccPart + at_p[:, None] * (2 * BLOCK_D) + offs_d[None, :]
                lo += tl.load(acc_at) * weight
                hi += tl.load(acc_at + BLOCK_D) * weight
            b = bg // n_kv
            g = bg % n_kv
            y_at = Y + b * stride_yb + g * stride_yg + offs_h[:, None] * stride_ym + offs_d[None, :]
            y_ok = h_ok[:, None] & (offs_d < half)[None, :]
            tl.store(y_at, lo.to(Y.dtype.element_ty), mask=y_ok)
            tl.store(y_at + half, hi.to(Y.dtype.element_ty), mask=y_ok)
        if NEED_WEIGHTS:
            inverse = tl.where(h_ok, 1.0 / l_total, 0.0)
            if HAS_VALID:
                inverse = inverse * tl.load(Valid + bg // n_kv).to(tl.float32)
            start = split * split_slots
            end = tl.minimum(start + split_slots, n_slots)
            for s0 in range(start, end, BLOCK_S):
                offs_s = s0 + tl.arange(0, BLOCK_S)
                s_ok = offs_s < end
                x_at = Scores + (bg * n_q + offs_h[:, None]) * n_slots + offs_s[None, :]
                x = tl.load(x_at, mask=h_ok[:, None] & s_ok[None, :], other=float("-inf"))
                w = tl.sum(tl.exp(x - m_use[:, None]) * inverse[:, None], axis=0)
                tl.store(Weights + bg * n_slots + offs_s, w, mask=s_ok)
