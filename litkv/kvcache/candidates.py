"""What a policy sees of a call (`Candidates`), where the call's new tokens go (`Placement`) and the
record a layer keeps of a call until its eviction is done (`OpenCall`): the records passed between
`KVCache`, its policy and `KVCaches`, and the choosing and pairing helpers they share
(`drop_lowest`, `pair_drops`, `staged_placement`). Re-exported by `litkv.kvcache.base`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch

from litkv.kvcache.storage import PackedSlots

T = TypeVar("T")

__all__ = [
    "Candidates",
    "OpenCall",
    "PackedCandidates",
    "Placement",
    "drop_lowest",
    "keep_highest",
    "newest",
    "pair_drops",
    "placement_of",
    "staged_placement",
]


@dataclass
class Candidates:
    """The `L` cached tokens, then the `T` new tokens of a call, per (row, KV head).

    Attributes:
        positions: `(B, G, L + T)` int64 token positions; `-1` for empty slots and pads.
        keys: `(B, G, L + T, key_size)` keys as the queries saw them (after RoPE; dequantised), or
            `None` while the cache is filling (nothing to choose then).
        values: `(B, G, L + T, value_size)`, or `None` while filling.
        new_keys: `(B, G, T, key_size)` keys of the new tokens as computed (what storage receives; with
            quantised storage the queries saw them rounded, as in `keys`).
        new_values: `(B, G, T, value_size)`.
        query_pos: `(B, T)` int64 positions of the call's queries, `-1` for pads.
        attn_weights: `(B, G, L + T)` float32 softmax weights summed over the call's (non-pad) queries
            and each KV group's query heads; `None` unless the class sets `needs_attn_weights`.
        queries: `(B, n_head, T, key_size)` the call's queries after RoPE; `None` unless the class sets
            `needs_queries`.
        hidden: `(B, T, n_embd)` the layer's attention input (the normed hidden state its keys are made from);
            `None` unless the class sets `needs_hidden`, and where the caller has none.

    What `score`/`select_drop` computed and `update_state` needs again is asked for through the call's
    typed memo, `once(self.method)`: computed on the first ask, the same value on the next; gone after
    the call.
    """

    positions: torch.Tensor
    keys: torch.Tensor | None
    values: torch.Tensor | None
    new_keys: torch.Tensor
    new_values: torch.Tensor
    query_pos: torch.Tensor
    attn_weights: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    _memo: dict[object, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_new(self) -> int:
        """`T`."""
        return self.new_keys.shape[2]

    def once(self, compute: Callable[[Candidates], T]) -> T:
        """`compute(self)`, computed once per call (the call's memo, keyed by the function: `score` and
        `update_state` both ask `candidates.once(self.accumulated)` and the second gets the first's value)."""
        key = getattr(compute, "__func__", compute)
        if key not in self._memo:
            self._memo[key] = compute(self)
        return self._memo[key]  # type: ignore[return-value]

    def remember(self, compute: Callable[[Candidates], T], value: T) -> None:
        """Set what `once(compute)` returns for this call (a batched scoring of several layers computed it)."""
        self._memo[getattr(compute, "__func__", compute)] = value

    @property
    def scratch(self) -> dict[str, object]:
        """Gone: the one-line answer of a policy written for the old string-keyed scratch space."""
        raise AttributeError(
            "Candidates.scratch is gone: compute once per call with candidates.once(self.method) "
            "(docs/custom_policy.md)"
        )


class PackedCandidates(Candidates):
    """Candidates whose `keys` and `values` arrive as a storage's packed slots (`PackedSlots`) and are
    unpacked on first read: a policy that never reads them costs no unpacking."""

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        return self._unpacked()[0]

    @keys.setter
    def keys(self, value: torch.Tensor | PackedSlots | None) -> None:
        self._keys = value

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        return self._unpacked()[1]

    @values.setter
    def values(self, value: torch.Tensor | PackedSlots | None) -> None:
        self._values = value

    def _unpacked(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        packed = [x for x in (self._keys, self._values) if isinstance(x, PackedSlots)]
        if packed:  # one object holds both
            keys, values = packed[0].unpack()
            self._keys = keys if isinstance(self._keys, PackedSlots) else self._keys
            self._values = values if isinstance(self._values, PackedSlots) else self._values
        return self._keys, self._values


@dataclass
class OpenCall:
    """A call between `attend_inputs` and the end of its eviction: the one record a layer keeps of it.

    Attributes:
        path: how its new tokens were attended: `"direct"` (written into the empty slots
            `[start, start + T)`, nothing to choose), `"staged"` (a decode step: the token waits in the
            room after the slots) or `"concat"` (a longer call: slots then new tokens).
        start: the first slot a direct call wrote.
        candidates: what the policy sees (`attn_weights` set once attention is done).
        waiting: attention is done and the eviction waits (`wait_for_eviction`): `KVCaches.evict_waiting`
            evicts it with the other layers after the block loop, or `settle` alone.
    """

    path: Literal["direct", "staged", "concat"]
    start: int
    candidates: Candidates
    waiting: bool = False


@dataclass
class Placement:
    """Where a call's new tokens went: the slot pairing, computed once per call.

    Attributes:
        dest: `(B, G, T)` slot indices; `src`: `(B, G, T)` new-token indices; `valid`: `(B, G, T)`
            bool. New token `src[j]` went into slot `dest[j]` where `valid[j]`.
        source: `(B, G, L)` int64, for each slot the index of the candidate (`0..L+T-1`) it holds now
            (`source >= L`: the slot received a new token in this call); empty when `start` is set.
        start: a direct call (`None`: another): new token `j` went into slot `start + j` of every row and
            head, every other slot kept its token (`carry` slices instead of gathering).
    """

    dest: torch.Tensor
    src: torch.Tensor
    valid: torch.Tensor
    source: torch.Tensor
    start: int | None = None

    def layer(self, i: int) -> Placement:
        """Layer `i` of a placement built for `n` layers at once (fields `(n, B, G, ...)`)."""
        source = self.source[i] if self.source.numel() else self.source
        return Placement(self.dest[i], self.src[i], self.valid[i], source, self.start)

    def carry(self, per_candidate: torch.Tensor) -> torch.Tensor:
        """Per-slot state after the call from per-candidate state `(B, G, L + T)` -> `(B, G, L)`."""
        if self.start is None:
            return per_candidate.gather(2, self.source)
        s, t = self.start, self.dest.shape[-1]
        length = per_candidate.shape[2] - t
        return torch.cat((per_candidate[..., :s], per_candidate[..., length:], per_candidate[..., s + t : length]), 2)


def drop_lowest(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` candidates with the lowest scores, equal scores broken by position (the older goes first).

    The tie-break makes the choice a function of the tokens, not of the slots they happen to sit in,
    so a row evicts the same tokens alone and in a batch (exact ties are common: RoPE keeps a key's
    norm, so one token id at two positions has two keys of one norm). One `topk` over an int64 key:
    the float32 score's order-preserving bit pattern, then the position.

    Args:
        scores: `(..., N)` float32 (may hold +-inf; no NaN), e.g. `(B, G, N)`.
        positions: `(..., N)` int64 token positions in `[-1, 2^31)`.
        k: how many to drop.

    Returns:
        `(..., k)` int64 candidate indices.
    """
    if k == 1:  # a decode step: the lowest score, then the oldest among equal ones (four ops, no int64 key)
        lowest = scores == scores.amin(dim=-1, keepdim=True)
        top = torch.iinfo(torch.long).max
        return torch.where(lowest, positions, top).argmin(dim=-1, keepdim=True)
    return torch.topk(_order_key(scores, positions), k, dim=-1, largest=False, sorted=False).indices


def newest(positions: torch.Tensor, count: int) -> torch.Tensor:
    """`(..., N)` bool: each row's `count` newest candidates, those whose position is at least the row's
    `count`-th largest (more where positions tie there; `1 <= count <= N`; positions `(..., N)` int64).

    A `topk`, not `torch.kthvalue`: the CPU's quickselect behind the latter takes quadratic time on positions in
    (nearly) increasing order, which is how a cache filled by a prompt holds them."""
    kth = torch.topk(positions, count, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    return positions >= kth


def keep_highest(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` candidates with the highest scores, equal scores broken by position as `drop_lowest` does
    (the newer is kept), so that a one-shot compression keeps the same tokens alone and in a batch.
    `scores` `(..., N)` float32 (no NaN), `positions` `(..., N)` int64 in `[-1, 2^31)`; returns `(..., k)`
    int64 candidate indices."""
    return torch.topk(_order_key(scores, positions), k, dim=-1, sorted=False).indices


def _order_key(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 key ordered as (score, position): the float32 score's order-preserving bit pattern, then the position."""
    bits = scores.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return ordered * (1 << 32) + (positions + 1)


def pair_drops(drop: torch.Tensor, cache_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair the slots freed by `drop` with the new tokens that survive.

    Args:
        drop: `(B, G, T)` distinct indices into the `L + T` candidates (slots first, then new tokens).
        cache_length: `L`.

    Returns:
        `dest` `(B, G, T)` slot indices, `src` `(B, G, T)` new-token indices, `valid` `(B, G, T)` bool:
        new token `src[j]` goes into slot `dest[j]` where `valid[j]`.
    """
    b, g, t = drop.shape
    if t == 1:  # decode step: the dropped slot takes the new token, unless the new token is dropped
        return drop.clamp(max=cache_length - 1), torch.zeros_like(drop), drop < cache_length
    is_drop = torch.zeros(b, g, cache_length + t, dtype=torch.bool, device=drop.device)
    is_drop.scatter_(2, drop, True)
    freed = is_drop[..., :cache_length].to(torch.int8)
    kept_new = (~is_drop[..., cache_length:]).to(torch.int8)
    dest = torch.sort(freed, dim=2, descending=True, stable=True).indices[..., :t]
    src = torch.sort(kept_new, dim=2, descending=True, stable=True).indices
    valid = torch.arange(t, device=drop.device) < kept_new.sum(dim=2, keepdim=True)
    return dest, src, valid


def staged_placement(drop: torch.Tensor, cache_length: int, with_source: bool = True) -> Placement:
    """The `Placement` of a one-token call whose token waits in the room (slot `L`).

    Args:
        drop: `(..., 1)` dropped candidate indices in `[0, L]` (`L`: the new token itself); leading dims
            `(B, G)`, or `(n, B, G)` for `n` layers at once.
        cache_length: `L`.
        with_source: also build `Placement.source` (only policies with per-slot state read it).
    """
    dest = drop.clamp(max=cache_length - 1)  # the freed slot, where the token is kept
    kept = drop < cache_length
    src = torch.zeros_like(dest)
    if with_source:
        return placement_of(dest, src, kept, cache_length)
    return Placement(dest, src, kept, dest.new_empty(0))  # `source` left empty: nothing reads it


def placement_of(dest: torch.Tensor, src: torch.Tensor, valid: torch.Tensor, cache_length: int) -> Placement:
    """The `Placement` of `dest`, `src`, `valid` `(..., T)` (leading dims `(B, G)`, or `(n, B, G)` for `n` layers)."""
    source = torch.arange(cache_length, device=dest.device).expand(*dest.shape[:-1], cache_length)
    source = source.scatter(-1, dest, torch.where(valid, cache_length + src, dest))
    return Placement(dest, src, valid, source)
