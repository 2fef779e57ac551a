"""Checks of one cache call (`litkv.kvcache.base.KVCache`): what `attend_inputs` is given, what a policy's
`select_drop` returns, and whether the call's tokens fit a cache that does not evict. Errors name the policy
and what it was given."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from litkv.kvcache.storage import CacheShape

__all__ = ["check_call_inputs", "check_drops", "check_full", "check_no_nan", "row_overflow"]


def check_call_inputs(
    shape: CacheShape, dtype: torch.dtype, keys: torch.Tensor, values: torch.Tensor, input_pos: torch.Tensor
) -> None:
    """Raise ValueError unless `keys` `(B, G, T, key_size)`, `values` `(B, G, T, value_size)` of `dtype` and
    `input_pos` `(B, T)` fit a cache of `shape`, with `1 <= T <= shape.cache_length`."""
    s = shape
    for name, tensor, size in (("keys", keys, s.key_size), ("values", values, s.value_size)):
        if tensor.dtype != dtype:
            raise ValueError(f"{name} have dtype {tensor.dtype}, but the cache holds {dtype}")
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, G, T, head_size), got shape {tuple(tensor.shape)}")
        if tensor.shape[0] != s.batch_size:
            raise ValueError(
                f"batch size changed mid-sequence: the cache was built for batch size "
                f"{s.batch_size}, got {name} with batch size {tensor.shape[0]}"
            )
        expected = (s.batch_size, s.n_query_groups, keys.shape[2], size)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
    t = keys.shape[2]
    if tuple(input_pos.shape) != (s.batch_size, t):
        raise ValueError(f"input_pos must have shape {(s.batch_size, t)}, got {tuple(input_pos.shape)}")
    if t == 0:
        raise ValueError("a call must bring at least one new token, got T=0")
    if t > s.cache_length:
        raise ValueError(
            f"chunk of {t} tokens is longer than allowed: at most cache_length={s.cache_length} new tokens per call"
        )


def check_drops(name: str, drop: object, expected: tuple[int, int, int], cache_length: int, values: bool) -> None:
    """Raise naming the policy `name` if `drop` is not an int64 tensor of shape `expected` `(B, G, T)`; with
    `values`, also unless its indices are distinct per (row, KV head) and in `[0, cache_length + T)` (one host
    read: skipped for a policy whose drops are valid by construction)."""
    if not isinstance(drop, torch.Tensor) or drop.dtype != torch.int64:
        got = drop.dtype if isinstance(drop, torch.Tensor) else type(drop).__name__
        raise TypeError(f"{name}.select_drop must return an int64 tensor, got {got}")
    if tuple(drop.shape) != expected:
        raise ValueError(f"{name}.select_drop must return shape {expected} (B, G, T), got {tuple(drop.shape)}")
    if not values:
        return
    t = expected[2]
    n = cache_length + t
    ordered = torch.sort(drop, dim=2).values
    out_of_range = (ordered[..., 0] < 0) | (ordered[..., -1] >= n)
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=2)
    if bool((out_of_range | repeated).any()):
        row, head = (out_of_range | repeated).nonzero()[0].tolist()
        raise ValueError(
            f"{name}.select_drop must return {t} distinct candidate indices in [0, {n}) per (row, KV head); "
            f"row {row}, head {head} got {drop[row, head].tolist()}"
        )


def check_full(name: str, cache_length: int, over: tuple[int, int, int] | None) -> None:
    """Raise ValueError naming the policy `name` when `over` (`row_overflow`'s answer) names a row that does not fit."""
    if over is not None:
        row, held, need = over
        raise ValueError(
            f"{name} is full: cache_length={cache_length}, row {row} holds {held} tokens "
            f"and {need - held} new tokens do not fit (need {need}). Use a larger cache_length or a policy "
            "that evicts, e.g. 'last-recent' or 'h2o'"
        )


def row_overflow(
    positions: torch.Tensor, num_filled: int, input_pos: torch.Tensor, limit: int
) -> tuple[int, int, int] | None:
    """`(row, tokens held, tokens needed)` of a row whose own tokens would exceed `limit` with this call, else `None`.

    Args:
        positions: `(B, G, L)` the slots' token positions (`-1`: empty).
        num_filled: the cache's host counter (it counts pad columns too).
        input_pos: `(B, T)` the call's positions (`-1`: pad).

    Only when `num_filled` says "over" are the rows' own tokens counted (one host read): pads never take a slot,
    so a ragged batch fits where each row fits.
    """
    if num_filled + input_pos.shape[1] <= limit:
        return None
    held = (positions >= 0).sum(dim=2).amax(dim=1)  # (B,) tokens held per row
    need = held + (input_pos >= 0).sum(dim=1)
    if not bool((need > limit).any()):
        return None
    row = int(need.argmax())
    return row, int(held[row]), int(need[row])


def check_no_nan(scores: torch.Tensor, where: str, inputs: Sequence[torch.Tensor | None] = ()) -> None:
    """ValueError naming the policy's method when `scores` holds a NaN (it would evict arbitrarily) while
    its `inputs` (the cached and new keys, the new values, the attention weights) are finite: a NaN the model produced
    is not the policy's, and the caller's own check (a NaN loss, NaN logits) names it."""
    if bool(torch.isnan(scores).any()) and all(t is None or bool(torch.isfinite(t).all()) for t in inputs):
        raise ValueError(f"{where} returned NaN scores: a NaN cannot be ranked, so the eviction would be arbitrary")
