"""Integer matrix products for attention over int8/int4 codes on the CPU (`torch._int_mm`).

`litkv.kvcache.quant_attention` computes `q . k` and `p @ v` as products with the codes, scales and
offsets applied per group afterwards. Converting the codes to float numbers first costs a float
temporary four times the int8 cache (eight times int4) and a pass to write it: on a CPU decode step
at long contexts that conversion, not the product, is the time. Here the codes stay integers:

- int8 codes are stored as int8 (`quantized.quantize` biases them by -128), so they are the matrix
  itself, read in place (key and value codes are strided views of the one buffer).
- int4 codes are unpacked with 32-bit mask-and-shift passes into the low nibbles (elements `0 .. D/2`)
  and high nibbles (`D/2 .. D`) as int8, joined into one int8 matrix in element order; the temporary
  is the int8 size of the codes, never a float one.

The float side (the queries; the softmax weights times the scales) is split into `DIGITS` int8 digits
per row: `x ~ sum_k s_k * d_k` with `s_1 = max|x| / 127` and `s_{k+1} = s_k / 254` (each digit rounds
the remainder to nearest, so what is left is at most `s_k / 2`). One `torch._int_mm` multiplies every
digit of every row by the codes, exactly in int32, so the codes are read once per product, and the
digits are combined in float32: with three digits the float side keeps about 24 bits, float32's own
precision (the result equals dequantise-then-attend within `atol=1e-5, rtol=1e-4` in float32, as the
float path). Sums over more than `SLOT_BLOCK` slots are cut into blocks so that int32 cannot overflow.

Only decode steps (one query per row) on the CPU in float32 (and narrower, computed in float32) with head
sizes that are multiples of 16 take this path (`integer_path`), and only where the C kernel of a decode step
(`litkv.kvcache.kernels.cpu_decode`) cannot be built; float64 models, calls of several queries (prefill
chunks: there the float path's one conversion serves every query, and a chunk of 512 queries over 4,096
slots took a fifth of the integer path's time) and other devices use the float path.
"""

from __future__ import annotations

import torch

__all__ = ["DIGITS", "MIN_SLOTS", "SLOT_BLOCK", "int_scores", "int_weighted_values", "integer_parts", "integer_path"]

DIGITS = 3
#: Fewest slots attended with integer products (1 thread, SmolLM2-135M shape: at 513 slots the float
#: path takes about a third of the integer path's time, at 16,385 about three times as long).
MIN_SLOTS = 2048
#: Slots summed in one int32 product: 2^31 / (127 * 128) > 2^17, so 2^16 leaves room.
SLOT_BLOCK = 1 << 16
_NIBBLES = 0x0F0F0F0F

# An integer matrix of codes `(B, G, S, w)` int8 and the columns of the head dimension it holds.
Part = tuple[torch.Tensor, slice]


def integer_path(codes: torch.Tensor, bits: int, dtype: torch.dtype, queries: int) -> bool:
    """Whether `codes` `(B, G, S, 2, D * bits / 8)` are attended with integer products by a call of `queries`
    queries per row: one (a decode step), on the CPU, in float32, `D` a multiple of 16 (int4 halves are whole
    32-bit words) and at least `MIN_SLOTS` slots (below, the float path's fewer operations cost less than the
    conversion they do)."""
    d = codes.shape[-1] * 8 // bits
    cpu = codes.device.type == "cpu" and not codes.requires_grad
    return cpu and queries == 1 and dtype == torch.float32 and d % 16 == 0 and codes.shape[2] >= MIN_SLOTS


def integer_parts(codes: torch.Tensor, bits: int) -> tuple[list[Part], list[Part]]:
    """The key and value code matrices of `codes` `(B, G, S, 2, D * bits / 8)` uint8 as int8 parts."""
    if bits == 8:
        signed = codes.view(torch.int8)
        d = codes.shape[-1]
        return [(signed[:, :, :, 0], slice(0, d))], [(signed[:, :, :, 1], slice(0, d))]
    width = codes.shape[-1]  # D / 2 bytes: low nibbles hold elements 0 .. D/2, high ones D/2 .. D
    words = codes.reshape(*codes.shape[:3], -1).view(torch.int32)
    low = (words & _NIBBLES).view(torch.int8).view(codes.shape)
    high = ((words >> 4) & _NIBBLES).view(torch.int8).view(codes.shape)
    numbers = torch.cat((low, high), dim=-1)  # (B, G, S, 2, D) int8 in element order: one product each
    return [(numbers[:, :, :, 0], slice(0, 2 * width))], [(numbers[:, :, :, 1], slice(0, 2 * width))]


def _digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `(..., R, K)` float32 -> digits `(..., DIGITS * R, K)` int8 (digit-major) and their scales
    `(..., DIGITS, R)` float32, with `x ~ sum_k scales[k] * digits[k]` row by row (for small `x`: the queries)."""
    step = x.abs().amax(dim=-1) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    rest, digits, steps = x, [], []
    for _ in range(DIGITS):
        digit = (rest / step[..., None]).round_().clamp_(-127, 127)
        digits.append(digit)
        steps.append(step)
        rest = rest - digit * step[..., None]
        step = step / 254
    return torch.cat(digits, dim=-2).to(torch.int8), torch.stack(steps, dim=-2)


def _unsigned_digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `(..., R, K)` float32, `>= 0` -> digits `(..., DIGITS, R, K)` int8 in `[0, 127]` and units
    `(..., R)`, with `x ~ unit * sum_k 128^(DIGITS - 1 - k) * digits[k]` (one rounding to a `7 * DIGITS`-bit
    integer, then its bits: fewer passes over a large `x` than `_digits`)."""
    top = (1 << (7 * DIGITS)) - 1
    unit = x.amax(dim=-1, keepdim=True) / top
    unit = torch.where(unit > 0, unit, torch.ones_like(unit))
    whole = (x / unit).round_().to(torch.int32)
    out = torch.empty(*x.shape[:-2], DIGITS, *x.shape[-2:], dtype=torch.int8)
    for k in range(DIGITS):
        shift = 7 * (DIGITS - 1 - k)
        torch.bitwise_and(whole >> shift if shift else whole, 127, out=out[..., k, :, :])
    return out, unit[..., 0]


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` for int8 `a` `(R, K)` and `b` `(K, N)` in int32, in blocks of `SLOT_BLOCK` along `K`."""
    k = a.shape[1]
    if k <= SLOT_BLOCK:
        return torch._int_mm(a, b)
    total = torch._int_mm(a[:, :SLOT_BLOCK], b[:SLOT_BLOCK])
    for start in range(SLOT_BLOCK, k, SLOT_BLOCK):
        total += torch._int_mm(a[:, start : start + SLOT_BLOCK], b[start : start + SLOT_BLOCK])
    return total


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`out = a @ b` (int8 -> int32), `out` contiguous."""
    if a.shape[1] <= SLOT_BLOCK:
        torch._int_mm(a, b, out=out)
    else:
        out.copy_(_int_mm(a, b))


def int_scores(
    q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, parts: list[Part], bias: int
) -> torch.Tensor:
    """`q . k` from the key codes: `q` `(B, G, M, D)` float32, `scales`/`offsets` `(B, G, n, S)` float32,
    codes in `parts` decoding as `offset + scale * (code + bias)` -> `(B, G, M, S)` float32."""
    b, g, m, d = q.shape
    n, s = scales.shape[2], scales.shape[3]
    by_group = q.view(b, g, m, n, d // n)
    spread = by_group if n == 1 else by_group[:, :, :, None] * torch.eye(n, dtype=q.dtype)[:, :, None]
    r = m * n  # row (query, group): that group's columns only
    digits, steps = _digits(spread.reshape(b, g, r, d))
    # (B, G, R, DIGITS * R): row r takes digit k of row r with its scale, so one matmul combines them
    combine = (steps[..., None] * torch.eye(r, dtype=steps.dtype)).permute(0, 1, 3, 2, 4).reshape(b, g, r, -1)
    products = torch.empty(len(parts), b, g, s, DIGITS * r, dtype=torch.int32)
    for p, (code, cols) in enumerate(parts):
        digits_t = digits[:, :, :, cols].transpose(-1, -2).contiguous()  # (B, G, w, DIGITS * R)
        for i in range(b):
            for j in range(g):
                torch._int_mm(code[i, j], digits_t[i, j], out=products[p, i, j])
    summed = (products[0] if len(parts) == 1 else products.sum(dim=0)).float()
    raw = torch.empty(b, g, r, s, dtype=torch.float32)  # q . code per row (query, group)
    for i in range(b):
        for j in range(g):  # 2-D products: a batched matmul with these small sizes is far slower
            torch.mm(combine[i, j], summed[i, j].t(), out=raw[i, j])
    sums = by_group.sum(dim=-1).view(b, g, r, 1)  # sum(q_g) per row (query, group)
    if bias:
        raw.add_(sums, alpha=bias)
    if n == 1:
        return torch.addcmul(sums * offsets, raw, scales)
    offset_part = torch.matmul(by_group.sum(dim=-1), offsets)  # sum_g offset_g * sum(q_g)
    return (raw.view(b, g, m, n, s) * scales[:, :, None]).sum(dim=3) + offset_part


def int_weighted_values(
    probs: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, parts: list[Part], bias: int
) -> torch.Tensor:
    """`probs @ values` from the value codes: `probs` `(B, G, M, S)` float32, `scales`/`offsets`
    `(B, G, n, S)` float32, codes decoding as `offset + scale * (code + bias)` -> `(B, G, M, D)` float32."""
    b, g, m, s = probs.shape
    n = scales.shape[2]
    r = m * n
    weighted = probs * scales if n == 1 else (probs[:, :, :, None] * scales[:, :, None]).reshape(b, g, r, s)
    digits, unit = _unsigned_digits(weighted)  # (B, G, DIGITS, R, S), (B, G, R)
    width = parts[0][1].stop - parts[0][1].start
    products = torch.empty(b, g, len(parts), DIGITS * r, width, dtype=torch.int32)
    for p, (code, _) in enumerate(parts):
        for i in range(b):
            for j in range(g):
                _mm_into(products[i, j, p], digits[i, j].view(DIGITS * r, s), code[i, j])
    powers = torch.tensor([float(128 ** (DIGITS - 1 - k)) for k in range(DIGITS)])
    per_part = torch.tensordot(products.view(b, g, len(parts), DIGITS, r, width).float(), powers, dims=([3], [0]))
    full = (per_part * unit[:, :, None, :, None]).transpose(2, 3).reshape(b, g, r, width * len(parts))
    offset_part = torch.matmul(probs, offsets.transpose(-1, -2))  # (B, G, M, n): sum_s p_s * offset_sg
    if bias:
        offset_part += bias * weighted.sum(dim=-1).view(b, g, m, n)
    if n == 1:
        return full.add_(offset_part)
    d = full.shape[-1]
    own = full.view(b, g, m, n, n, d // n).diagonal(dim1=3, dim2=4)  # each group's columns, its own weights
    return (own + offset_part[:, :, :, None]).transpose(-1, -2).reshape(b, g, m, d)
