"""The chunk runner: the one place where a sequence is cut into calls through the KV caches.

Chunking is a property of the run (`ChunkPlan`: the first, prefill chunk of `prefill_length` tokens,
then chunks of `chunk_size`), and every chunked computation (generate's prefill, `forward_chunked`,
the gradient engine, the prefix store, evaluate, the fine-tuning loop) takes its calls from
`schedule` and runs them with `run_chunks` (or, for the gradient engine, iterates the same calls).

**Batch invariance.** Each row is cut from its *own* first token, exactly as it would be cut alone,
so a row's eviction points and chunk boundaries never depend on its batch-mates. Rows are aligned on
their last chunk: a row with fewer chunks sits out the first calls (its part of them is all padding),
and within a call a row's chunk is right-aligned (left-padded with position `-1`). So every row ends
on the last call, with its last token in the last column (what generate's decode needs), and pad
tokens are never attended, stored or scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from litkv.kvcache.config import ChunkPlan

if TYPE_CHECKING:
    from litkv.modeling.model import GPT

__all__ = ["Call", "ChunkPlan", "Schedule", "run_chunks", "schedule"]


@dataclass
class Call:
    """One call through the caches: `idx` `(B, W)` token ids (0 at pads), `input_pos` `(B, W)` (-1 at pads)."""

    idx: torch.Tensor
    input_pos: torch.Tensor


@dataclass
class Schedule:
    """The calls of a batch, and where each input column's output lies among them.

    Attributes:
        calls: the calls, in order.
        out_index: `(B, T)` int64: for each column of the input, its index along the concatenated
            outputs of the calls (dim 1); pad columns point at column 0 (their output is meaningless).
    """

    calls: list[Call]
    out_index: torch.Tensor

    def gather(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The calls' outputs `(B, W_j, *)` laid out as the input: `(B, T, *)` (differentiable)."""
        joined = torch.cat(list(outputs), dim=1)
        index = self.out_index.view(*self.out_index.shape, *([1] * (joined.dim() - 2)))
        return joined.gather(1, index.expand(*self.out_index.shape, *joined.shape[2:]))


def _row_starts(input_pos: torch.Tensor) -> list[int]:
    """First non-pad column of each row; ValueError unless pads (-1) only precede a row's tokens."""
    real = input_pos >= 0
    counts = real.sum(dim=1)
    t = input_pos.shape[1]
    starts = (t - counts).tolist()
    cols = torch.arange(t, device=input_pos.device)
    expected = cols[None, :] >= (t - counts)[:, None]
    if not torch.equal(real, expected):
        row = int((real != expected).any(dim=1).nonzero()[0])
        raise ValueError(f"padding must come before a row's tokens (left padding); row {row} has a pad after a token")
    return [int(s) for s in starts]


def schedule(idx: torch.Tensor, input_pos: torch.Tensor, plan: ChunkPlan) -> Schedule:
    """Cut each row of a left-padded batch from its own first token and align the rows on their last chunk.

    Args:
        idx: `(B, T)` token ids.
        input_pos: `(B, T)` positions, `-1` at (left) pads.
        plan: the chunking of the run.

    Returns:
        The calls (each `W_j <= max(plan.first, plan.size)` wide) and the output layout.
    """
    b, t = idx.shape
    starts = _row_starts(input_pos)
    rows = [[(s + starts[i], e + starts[i]) for s, e in plan.bounds(t - starts[i])] for i in range(b)]
    n_calls = max(len(r) for r in rows)
    out_index = torch.zeros(b, t, dtype=torch.long)
    calls, offset = [], 0
    device = idx.device
    for j in range(n_calls):
        parts = [r[j - (n_calls - len(r))] if j >= n_calls - len(r) else None for r in rows]
        width = max(e - s for s, e in (p for p in parts if p is not None))
        src = torch.zeros(b, width, dtype=torch.long)
        valid = torch.zeros(b, width, dtype=torch.bool)
        for i, part in enumerate(parts):
            if part is None:
                continue
            s, e = part
            src[i, width - (e - s) :] = torch.arange(s, e)
            valid[i, width - (e - s) :] = True
            out_index[i, s:e] = torch.arange(offset + width - (e - s), offset + width)
        src, valid = src.to(device), valid.to(device)
        call_idx = torch.where(valid, idx.gather(1, src), torch.zeros_like(src, dtype=idx.dtype))
        call_pos = torch.where(valid, input_pos.gather(1, src), torch.full_like(src, -1, dtype=input_pos.dtype))
        calls.append(Call(call_idx, call_pos))
        offset += width
    return Schedule(calls, out_index.to(device))


def run_chunks(
    model: GPT,
    idx: torch.Tensor,
    input_pos: torch.Tensor,
    plan: ChunkPlan,
    *,
    lm_head: bool = True,
    last_only: bool = False,
    progress: bool = False,
    on_call: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Run a left-padded batch through the attached caches, call by call (`schedule`).

    Args:
        model: the GPT, caches attached for `B` rows.
        idx: `(B, T)` token ids; `input_pos`: `(B, T)` positions, `-1` at left pads.
        plan: the run's chunking.
        lm_head: logits (else final hidden states).
        last_only: return only each row's last token's output `(B, 1, *)` (kept from the last call only).
        progress: a progress bar over the calls (shown when there are at least two).
        on_call: called with the call's index after each call.

    Returns:
        `(B, T, V or n_embd)` outputs laid out as `idx`, or `(B, 1, *)` with `last_only`.
    """
    plan_calls = schedule(idx, input_pos, plan)
    outputs = []
    calls = plan_calls.calls
    for j, call in enumerate(tqdm(calls, desc="prefill", unit="chunk", disable=not progress or len(calls) < 2)):
        out = model(call.idx, call.input_pos, lm_head=lm_head)
        outputs = [out[:, -1:]] if last_only else [*outputs, out]
        if on_call is not None:
            on_call(j)
    return outputs[0] if last_only else plan_calls.gather(outputs)
