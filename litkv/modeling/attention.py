"""Attention of `T` new queries over `S` keys (cache slots + new tokens): two paths, one for calls that need
no attention weights (SDPA), one for calls that do (a blockwise pass over the call's queries for the weights;
the output from SDPA on an accelerator, from that same pass on the CPU).

Which keys a query sees is a layout (`attend`'s `mask`): a bool mask built from positions (`build_mask`: pads,
empty slots, sliding windows, spliced positions), `CAUSAL` (the queries are the last keys, every earlier key
valid: a prefill chunk without pads, no mask built), `None` (every key visible: a decode step over slots that
all hold a token, no mask built) or `HeadStarts` (a decode step over a compressed one-shot cache: each (row, KV
head) attends its own run of slots). Packed slots (`PackedSlots`: a storage's own format, e.g. an int8/int4
cache's codes on a decode step) are attended by their own kernel (`PackedSlots.attend`), never converted here.
A decode step over float32 slots on the CPU takes one C pass over the keys and values (`_one_query_kernel`:
`litkv.kvcache.kernels.cpu_decode.float_attend`, the quantised caches' kernel on float numbers), where it builds.

Grouped-query attention never materialises expanded keys/values on the CPU: the query heads of each KV group
are folded into the query axis, `(B, G, q_per_kv * T, hs)`, or SDPA takes them grouped (`enable_gqa`). When a
cache asks for them, the softmax weights summed over the call's queries and over each group's query heads come
back as `(B, G, S)` float32, computed blockwise over the queries.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from litkv.kvcache.kernels import cpu_decode
from litkv.kvcache.storage import PackedSlots

__all__ = [
    "CAUSAL",
    "HeadStarts",
    "attend",
    "attend_causal_suffix",
    "build_mask",
    "full_mask",
    "masked_sdpa",
    "weights_in_one_pass",
    "WEIGHTS_BLOCK_ELEMENTS",
]

# Largest number of score elements held at once by the eager (weights / soft-capping) path.
WEIGHTS_BLOCK_ELEMENTS = 1 << 24


def build_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Which keys each query may attend to.

    Args:
        q_pos: `(B, T)` query positions, `-1` for padding.
        k_pos: `(B, G, S)` key positions, `-1` for empty slots and padding.
        window: sliding-window size (a query sees keys with `q - k < window`), or `None`.

    Returns:
        `(B, G, T, S)` bool. Rows of pad queries are all True (their output is never used, and a
        fully masked row would give NaN).
    """
    # Empty keys compare above every real query and pad queries above every key, so that one
    # full-size comparison gives the mask.
    top = torch.iinfo(torch.long).max
    q = torch.where(q_pos < 0, top, q_pos)[:, None, :, None]
    k = torch.where(k_pos < 0, top - 1, k_pos)[:, :, None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & ((q - k < window) | (q == top))
    return allowed


class _Causal:
    """The layout of a call whose `T` queries are the last `T` of its `S` keys, in order, every earlier key valid
    and earlier than every query: query `i` sees keys `0 .. S - T + i` (`CAUSAL`)."""

    def __repr__(self) -> str:
        return "CAUSAL"


# `attend`'s mask for a call whose queries are its last keys (a prefill chunk without pads over filled slots, or
# a whole sequence): no `(B, G, T, S)` mask is built.
CAUSAL = _Causal()


class HeadStarts:
    """The layout of a one-query call (a decode step without pads) whose keys are, per (row, KV head), the slots
    `[start, S)`, each holding a token earlier than the query, the slots before `start` empty: a one-shot cache
    compressed to different counts per head (`SlotMachine.direct_head_starts`). `attend` runs SDPA once per
    (row, KV head) over its own slots, no mask built, when that leaves out at least `HEAD_RANGES_MIN_SKIPPED` of the
    slot-heads, else with the mask of the starts.

    Attributes:
        host: `B x G` starts on the host; starts: the same `(B, G)` int64 tensor on the keys' device.
    """

    def __init__(self, host: list[list[int]], starts: torch.Tensor) -> None:
        self.host = host
        self.starts = starts

    def mask(self, s: int) -> torch.Tensor:
        """`(B, G, 1, S)` bool: slot `j` visible where `j >= start`."""
        return torch.arange(s, device=self.starts.device) >= self.starts[:, :, None, None]

    def __repr__(self) -> str:
        return f"HeadStarts({self.host})"


# Per-(row, KV head) SDPA calls when they leave out at least this fraction of the `B x G x S` slot-heads (each call
# costs an operator's overhead, tens of microseconds on a CPU; the masked call reads every slot and builds the mask)
HEAD_RANGES_MIN_SKIPPED = 0.1

Layout = torch.Tensor | _Causal | HeadStarts | None


def attend(
    q: torch.Tensor,
    k: torch.Tensor | PackedSlots,
    v: torch.Tensor | PackedSlots,
    mask: Layout,
    scale: float,
    softcap: float | None = None,
    need_weights: bool = False,
    query_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with grouped queries: two paths, one for calls that need no weights, one for calls that do; a
    decode step over float32 slots on the CPU takes neither but one C pass (`_one_query_kernel`) where it builds.

    A call without weights gets its output from SDPA (`_sdpa`: its flash kernel on the CPU, flash /
    memory-efficient on CUDA where the layout allows). A call with weights gets them from a blockwise pass over
    its queries (scores and their softmax, in blocks of at most about `WEIGHTS_BLOCK_ELEMENTS` scores): on an
    accelerator the output still comes from SDPA and that pass skips the product with the values; on the CPU
    (`weights_in_one_pass`), where the pass's extra `q . k` product costs more than SDPA saves, the same pass
    gives the output too, as it does with soft-capping, which SDPA cannot apply.

    Args:
        q: `(B, n_head, T, hs)`.
        k: `(B, G, S, hs)`, or packed slots holding keys and values (`PackedSlots`, then `v` is the same
            object): attended by their own kernel (`k.attend`; int8/int4 codes are never dequantised).
        v: `(B, G, S, hv)`.
        mask: which keys each query sees. A `(B, G, T, S)` or `(B, 1, T, S)` bool tensor, True where attention is
            allowed (a mask shared by all KV groups lets a multi-token call use SDPA's grouped-query kernel);
            `CAUSAL`: the queries are the last `T` keys, every earlier key visible (no mask is built); `None`:
            every key visible to every query (a decode step over slots that all hold a token); `HeadStarts`: each
            (row, KV head) sees its slots from its start on (one query).
        scale: factor applied to `q @ k^T`.
        softcap: attention-logit soft-capping threshold, or `None`.
        need_weights: also return the weights summed over queries and each group's heads.
        query_valid: `(B, T)` bool, queries that count in the weight sums (default: all).

    Returns:
        `y` `(B, T, n_head * hv)` and the weights `(B, G, S)` float32 (or `None`).
    """
    b, n_head, t, hs = q.shape
    if isinstance(k, PackedSlots) or isinstance(v, PackedSlots):
        if v is not k:
            raise ValueError(f"packed slots hold keys and values together: v must be k, got {type(v).__name__}")
        dense = None if mask is None and t == 1 else full_mask(mask, b, k.shape[1], t, k.shape[2], q.device)
        return k.attend(q, dense, scale, softcap, need_weights, query_valid)
    if t == 1 and _kernel_applies(q, k, v):
        return _one_query_kernel(q, k, v, mask, scale, softcap, need_weights, query_valid)
    return _attend_torch(q, k, v, mask, scale, softcap, need_weights, query_valid)


def _attend_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Layout,
    scale: float,
    softcap: float | None,
    need_weights: bool,
    query_valid: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attend` on key and value tensors through PyTorch's operators (SDPA, or the blockwise weights pass)."""
    b, n_head, t, hs = q.shape
    g, s = k.shape[1], k.shape[2]
    if isinstance(mask, _Causal) and t > s:
        raise ValueError(f"attend: {t} causal queries over {s} keys (the queries are the last keys)")
    one_pass = softcap is not None or (need_weights and weights_in_one_pass(q.device))
    if isinstance(mask, HeadStarts) and (need_weights or softcap is not None):
        mask = mask.mask(s)
    y = None if one_pass else _sdpa(q, k, v, mask, scale)
    weights = None
    if need_weights or softcap is not None:
        qg = q.view(b, g, n_head // g, t, hs)
        if y is None and t == 1 and softcap is None:  # a decode step's weights on the CPU: fewer operators
            return _one_query_pass(qg, k, v, mask, scale, query_valid)
        eager_y, weights = _scores_pass(qg, k, v if y is None else None, mask, scale, softcap, need_weights,
                                        query_valid)  # fmt: skip
        if y is None:
            y = eager_y.view(b, n_head, t, v.shape[-1]).transpose(1, 2).reshape(b, t, n_head * v.shape[-1])
    return y, weights


def _kernel_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a one-query call may take the C pass: float32 queries, keys and values on the CPU, one head size,
    no autograd (`cpu_decode.supported`)."""
    return (
        cpu_decode.supported(q, 1)
        and k.dtype == torch.float32
        and v.dtype == torch.float32
        and k.shape[-1] == v.shape[-1] == q.shape[-1]
        and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
    )


def _one_query_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Layout,
    scale: float,
    softcap: float | None,
    need_weights: bool,
    query_valid: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attend` of one query per head over float32 slots in one C pass (inside `torch.compile`: the same pass as
    one opaque op, so compiled and eager steps give the same bits); `_attend_torch` where it cannot be built."""
    b, n_head, _, hs = q.shape
    g, s = k.shape[1], k.shape[2]
    dense = None if mask is None or isinstance(mask, _Causal) else full_mask(mask, b, g, 1, s, q.device)
    op = _float_decode_op if torch.compiler.is_compiling() else _float_decode
    y, weights = op(q.reshape(b, g, n_head // g, hs), k, v, dense, query_valid, scale, softcap, need_weights)
    return y.view(b, 1, n_head * hs), weights if need_weights else None


def _float_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    query_valid: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cpu_decode.float_attend` of queries `(B, G, M, D)` (`y` `(B, G, M, D)`, the weights `(B, G, S)` or empty),
    or the same through `_attend_torch` where the kernel cannot be built."""
    done = cpu_decode.float_attend(q, k, v, mask, query_valid, scale, softcap, need_weights)
    if done is not None:
        return done
    b, g, m, d = q.shape
    y, weights = _attend_torch(q.reshape(b, g * m, 1, d), k, v, mask, scale, softcap, need_weights, query_valid)
    return y.view(b, g, m, d), weights if weights is not None else q.new_empty(0)


_float_decode_op = torch.library.custom_op("litkv::float_decode", _float_decode, mutates_args=())


@_float_decode_op.register_fake
def _float_decode_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    query_valid: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, g, s = k.shape[:3]
    weights = q.new_empty(b, g, s, dtype=torch.float32) if need_weights else q.new_empty(0)
    return torch.empty_like(q), weights


def weights_in_one_pass(device: torch.device) -> bool:
    """Whether a call that needs weights takes its output from the blockwise weights pass (one pass: the CPU)
    rather than from SDPA plus a scores-only pass (accelerators, whose SDPA kernels are much faster)."""
    return device.type == "cpu"


def full_mask(mask: Layout, b: int, g: int, t: int, s: int, device: torch.device) -> torch.Tensor:
    """A layout as a `(B, G or 1, T, S)` bool tensor (for kernels that take only tensors: packed slots)."""
    if isinstance(mask, torch.Tensor):
        return mask
    if isinstance(mask, HeadStarts):
        return mask.mask(s)
    if mask is None:
        return torch.ones(1, 1, t, s, dtype=torch.bool, device=device).expand(b, g, t, s)
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t).expand(b, g, t, s)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Layout, scale: float) -> torch.Tensor:
    """The output of the path without weights: `(B, T, n_head * hv)` from SDPA, by layout."""
    b, n_head, t, hs = q.shape
    g, s = k.shape[1], k.shape[2]
    if isinstance(mask, _Causal):
        if t == s:  # the queries are every key: SDPA's causal kernel
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return y.transpose(1, 2).reshape(b, t, n_head * v.shape[-1])
        return attend_causal_suffix(q, k, v, scale)
    if isinstance(mask, HeadStarts):
        skipped = sum(map(sum, mask.host)) / (b * g * s)
        if skipped >= HEAD_RANGES_MIN_SKIPPED and t == 1 and not torch.compiler.is_compiling():
            return _attend_head_ranges(q, k, v, mask.host, scale)
        mask = mask.mask(s)
    if mask is not None and t > 1 and mask.shape[1] == 1:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return y.transpose(1, 2).reshape(b, t, n_head * v.shape[-1])
    # the group's query heads folded into the query axis: plain attention per KV head (a decode step's one query
    # per head becomes `q_per_kv` rows, which every kernel takes)
    q_per_kv = n_head // g
    folded_q = q.reshape(b, g, q_per_kv * t, hs)
    if mask is None:
        y = F.scaled_dot_product_attention(folded_q, k, v, scale=scale)
    else:
        mask = mask.expand(b, g, t, s)
        folded_mask = mask[:, :, None].expand(b, g, q_per_kv, t, s).reshape(b, g, q_per_kv * t, s)
        if torch.compiler.is_compiling():  # the eager kernel as one opaque op (inductor's is slower on CPU)
            y = masked_sdpa(folded_q, k, v, folded_mask, scale)
        else:
            y = F.scaled_dot_product_attention(folded_q, k, v, attn_mask=folded_mask, scale=scale)
    return y.view(b, n_head, t, v.shape[-1]).transpose(1, 2).reshape(b, t, n_head * v.shape[-1])


def _attend_head_ranges(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[list[int]], scale: float
) -> torch.Tensor:
    """A one-query call whose (row, KV head) attends its slots `[start, S)` (`HeadStarts`): SDPA per (row, KV
    head) with the group's query heads folded, no mask. `q` `(B, n_head, 1, hs)`, `k`/`v` `(B, G, S, hs/hv)` ->
    `(B, 1, n_head * hv)`."""
    b, n_head, t, hs = q.shape
    g, hv = k.shape[1], v.shape[-1]
    folded = q.reshape(b, g, n_head // g * t, hs)
    rows = []
    for r, row_starts in enumerate(starts):
        heads = [
            F.scaled_dot_product_attention(
                folded[r, h, None, None], k[r, h, None, None, s0:], v[r, h, None, None, s0:], scale=scale
            )  # fmt: skip
            for h, s0 in enumerate(row_starts)
        ]
        rows.append(torch.cat(heads, dim=1))
    y = torch.cat(rows) if len(rows) > 1 else rows[0]
    return y.view(b, n_head, t, hv).transpose(1, 2).reshape(b, t, n_head * hv)


def attend_causal_suffix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, expand: bool | None = None
) -> torch.Tensor:
    """Attention where the call's `T` queries are the last `T` of the `S` keys, in order, and every earlier key is
    valid and earlier than every query (a prefill chunk without pads over a cache whose slots are all filled):
    query `i` sees keys `0 .. S - T + i`. No `(B, G, T, S)` mask is built.

    On CUDA the keys and values are expanded over each group's query heads (a copy of the `S` keys, small
    against the `T x S` products) and SDPA takes a lower-right causal bias (`causal_lower_right`), which its
    flash and memory-efficient kernels take without a mask. On the CPU, SDPA's flash kernel takes grouped
    queries with a `(T, S)` additive mask (`_suffix_mask`: 0 or `-inf`, what SDPA would make of a boolean one,
    built once for the layers of a chunk).

    Args:
        q: `(B, n_head, T, hs)`; `k`: `(B, G, S, hs)`; `v`: `(B, G, S, hv)`; `scale`: factor of `q @ k^T`.
        expand: take the CUDA way (expanded keys, causal bias) or the CPU way; default: by `q`'s device.

    Returns:
        `(B, T, n_head * hv)`.
    """
    b, n_head, t, _ = q.shape
    g, s = k.shape[1], k.shape[2]
    if t > s:
        raise ValueError(f"attend_causal_suffix: {t} queries over {s} keys (the queries are the last keys)")
    if not (q.device.type != "cpu" if expand is None else expand):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=_suffix_mask(t, s, q), scale=scale, enable_gqa=True)
    else:
        per = n_head // g
        k = k[:, :, None].expand(b, g, per, s, k.shape[-1]).reshape(b, n_head, s, k.shape[-1])
        v = v[:, :, None].expand(b, g, per, s, v.shape[-1]).reshape(b, n_head, s, v.shape[-1])
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(t, s), scale=scale)
    return y.transpose(1, 2).reshape(b, t, n_head * v.shape[-1])


# The largest `(T, S)` additive mask `_suffix_mask` keeps for the next layers (elements).
SUFFIX_MASK_KEPT_ELEMENTS = 1 << 24


def _suffix_mask(t: int, s: int, q: torch.Tensor) -> torch.Tensor:
    """`attend_causal_suffix`'s `(T, S)` mask in `q`'s dtype: 0 where query `i` sees key `j <= S - T + i`, else
    `-inf` (what SDPA makes of the boolean mask, so the same bits). The last one is kept (up to
    `SUFFIX_MASK_KEPT_ELEMENTS`) for the other layers of the chunk, which ask for the same."""
    if t * s > SUFFIX_MASK_KEPT_ELEMENTS or torch.compiler.is_compiling():
        return _new_suffix_mask(t, s, q.dtype, q.device)
    return _kept_suffix_mask(t, s, q.dtype, q.device)


def _new_suffix_mask(t: int, s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    allowed = torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)
    return torch.zeros(t, s, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


@functools.lru_cache(maxsize=1)
def _kept_suffix_mask(t: int, s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a plain tensor: calls with gradients may save it
        return _new_suffix_mask(t, s, dtype, device)


@torch.library.custom_op("litkv::masked_sdpa", mutates_args=())
def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)` as one op that
    `torch.compile` calls as it is: `q` `(B, G, M, hs)`, `k`/`v` `(B, G, S, hs/hv)`, `mask` `(B, G, M, S)`
    bool -> `(B, G, M, hv)`."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@masked_sdpa.register_fake
def _masked_sdpa_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _scores_pass(
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    mask: Layout,
    scale: float,
    softcap: float | None,
    need_weights: bool,
    query_valid: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Blockwise scores and their softmax: the weight sums (`need_weights`) and, when `v` is given (soft-capping),
    the output. `qg`: `(B, G, q_per_kv, T, hs)`; returns `(B, G, q_per_kv, T, hv)` or `None`, and `(B, G, S)`
    float32 or `None`.

    Products run in the model dtype (as in Hugging Face's eager attention; no float32 copy of the keys),
    float32 for float16 models (whose range a `q . k` can exceed), the softmax in float32 (float64 for
    float64 models). Each block of queries holds at most about `WEIGHTS_BLOCK_ELEMENTS` scores; the group's
    query heads are folded into the query axis so that both products are plain batched matrix products over
    `(B, G)`. A `CAUSAL` layout masks the block's own keys only (the earlier ones are all visible).
    """
    b, g, q_per_kv, t, hs = qg.shape
    s = k.shape[2]
    block = max(1, WEIGHTS_BLOCK_ELEMENTS // max(1, b * g * q_per_kv * s))
    score_dtype, product_dtype = _score_dtypes(qg.dtype)
    keys_t = k.transpose(2, 3).to(product_dtype)
    if isinstance(mask, torch.Tensor):
        mask = mask.expand(b, g, t, s)
    outputs = []
    weight_sum = None
    for start in range(0, t, block):
        end = min(start + block, t)
        n = end - start
        q_block = qg[:, :, :, start:end].reshape(b, g, q_per_kv * n, hs)
        scores = torch.matmul(q_block.to(product_dtype), keys_t)
        scores = (scores if scores.dtype == score_dtype else scores.to(score_dtype)).mul_(scale)
        scores = scores.view(b, g, q_per_kv, n, s)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if isinstance(mask, torch.Tensor):
            scores = torch.where(mask[:, :, None, start:end], scores, float("-inf"))
        elif mask is not None:  # CAUSAL: query `i` sees keys up to `s - t + i`; only the call's own keys are hidden
            own = torch.arange(t, device=qg.device)
            scores[..., s - t :].masked_fill_(own[None, :] > own[start:end, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if v is not None:
            flat = probs.view(b, g, q_per_kv * n, s)
            out = torch.matmul(flat if flat.dtype == v.dtype else flat.to(v.dtype), v)
            outputs.append(out.view(b, g, q_per_kv, n, v.shape[-1]))
        if need_weights:
            part = _weight_sum(probs.detach(), None if query_valid is None else query_valid[:, start:end])
            weight_sum = part if weight_sum is None else weight_sum + part
    y = None if v is None else torch.cat(outputs, dim=3) if len(outputs) > 1 else outputs[0]
    return y, weight_sum


def _one_query_pass(
    qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Layout, scale: float, query_valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_scores_pass` of a one-query call with the output and the weight sums, without soft-capping (a decode step
    on the CPU), in a third of its operators: batched products over the flattened `(B x G)` heads. The same
    products, softmax and sums in the same order: bitwise its result.

    `qg` `(B, G, q_per_kv, 1, hs)`, `k`/`v` `(B, G, S, hs/hv)`, `mask` a bool tensor `(B, G or 1, 1, S)`, `CAUSAL`
    (the query is the last key: it sees every key) or `None`; `query_valid` `(B, 1)` or `None`. Returns `y`
    `(B, 1, n_head * hv)` and the weights `(B, G, S)` float32.
    """
    b, g, q_per_kv, _, hs = qg.shape
    s, hv = k.shape[2], v.shape[-1]
    score_dtype, product_dtype = _score_dtypes(qg.dtype)
    q, keys = qg.reshape(b * g, q_per_kv, hs), k.reshape(b * g, s, hs)
    if q.dtype != product_dtype:
        q, keys = q.to(product_dtype), keys.to(product_dtype)
    scores = torch.bmm(q, keys.transpose(1, 2))
    scores = (scores if scores.dtype == score_dtype else scores.to(score_dtype)).mul_(scale)
    if isinstance(mask, torch.Tensor):
        scores = torch.where(mask.expand(b, g, 1, s).reshape(b * g, 1, s), scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (B x G, q_per_kv, S)
    y = torch.bmm(probs if probs.dtype == v.dtype else probs.to(v.dtype), v.reshape(b * g, s, hv))
    weights = _weight_sum(probs.detach().view(b, g, q_per_kv, 1, s), query_valid)
    return y.view(b, 1, g * q_per_kv * hv), weights


def _score_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(scores and softmax, `q . k` products) dtypes of the weights pass for a model `dtype`: products in the
    model dtype (no float32 copy of the keys), except float16, whose range (65,504) a `q . k` product can exceed
    (inf scores would give NaN weights; bfloat16 has float32's range); scores float32 at least."""
    score_dtype = torch.promote_types(dtype, torch.float32)
    return score_dtype, score_dtype if dtype == torch.float16 else dtype


def _weight_sum(probs: torch.Tensor, query_valid: torch.Tensor | None) -> torch.Tensor:
    """`probs` `(B, G, q_per_kv, n, S)` summed over the group's heads and the valid queries
    (`query_valid` `(B, n)`) -> `(B, G, S)` float32."""
    per_query = probs.sum(dim=2)  # (B, G, n, S)
    if per_query.shape[2] == 1:  # one query (a decode step): no sum over the queries
        summed = per_query[:, :, 0].float()
        return summed if query_valid is None else torch.where(query_valid[:, None, :], summed, 0.0)
    if query_valid is not None:
        per_query = torch.where(query_valid[:, None, :, None], per_query, 0.0)
    return per_query.sum(dim=2, dtype=torch.float32)
