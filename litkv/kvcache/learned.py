"""`learned`: evict by trained eviction gates (`litkv.gates`, `litkv finetune --learn_eviction true`).

Each token gets one retention logit per KV head from the layer's gate, linear in its input
(`EvictionGates.input`): its key before RoPE (`"key"`, in the keys' precision: the call's new keys are
rotated back to position 0 with the model's RoPE table at their own positions, `_pre_rope`), or the layer's
attention input, the normed hidden state the keys are made from (`"hidden"`, KVzap's input: the model hands
it to the cache, `needs_hidden`; a call without it is refused). The logit
is computed once, when the token arrives, from the key as computed (not as stored: with int8/int4 storage
the gate sees the un-quantised key). It then travels with the token's slot (`slot_state`), so snapshots,
restores, row selection, files and the undo log carry it; the stored keys are never scored again. When the
cache is full, the lowest logits are evicted, outside the `sinks` first tokens and the `recent` newest (by
default the gates' own `sinks`, at most a quarter of the cache, and half of the rest for the recent window,
as H2O).

With `threshold`, the cache also empties, after every call, the slots whose logit is below it, outside
the sinks and the recent window: it then holds a variable number of tokens, at most `cache_length`, and
freed slots are taken by new tokens before anything else is evicted. Costs of that mode: an undo log
(`litkv.keep_undo_log`) records every slot of each call, not only the overwritten ones; while the
cache fills, slots emptied below `num_filled` stay empty until the cache has taken `cache_length`
tokens (the fill path writes the next slots in order).

The model hands the cache its gates (`GPT.eviction_gates`, loaded with the checkpoint by `load_model`
when `eviction_gates.safetensors` is there) and its RoPE table when attaching it (`needs_gates`,
`needs_rope`). No attention weights are needed: the layer keeps the fast attention path; scoring reads
nothing on the host (compiled decoding works).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from litkv.core.rope import BoundRope, RopeTable
from litkv.gates.gate import EvictionGates
from litkv.kvcache.base import Candidates, Placement, SlotState
from litkv.kvcache.options import PolicyOptions, ScoreOptions, check_bool, check_float, check_int, check_mode
from litkv.kvcache.policy import Policy, StateUpdate
from litkv.kvcache.registry import register_kv_cache
from litkv.kvcache.score import ScoreKVCache

__all__ = ["LearnedKVCache", "LearnedOptions", "NO_GATES"]

#: The error of a `learned` cache attached to a model without gates.
NO_GATES = (
    "policy 'learned' needs trained eviction gates: load a checkpoint that has eviction_gates.safetensors "
    "(litkv/assets/default ships them) or train them with `litkv finetune --learn_eviction true`"
)


@dataclass
class LearnedOptions(ScoreOptions):
    """Options of `learned`.

    Args:
        sinks: first tokens never evicted; `None`: the gates' `sinks` (resolved when the gates are bound).
        recent: newest tokens never evicted; `None`: half the room the sinks leave.
        mode, budget: as every score policy (`ScoreOptions`).
        threshold: `None`, or a logit: after every call, slots whose logit is below it are emptied
            (outside the sinks and the recent window).
        across_layers: one-shot only: the compression keeps, per row, the `budget x G x n_layers` highest
            logits over all layers and KV heads (as `kvzip`'s default), not `budget` per head; the sinks and
            the recent window of every head are kept (`KVCaches.end_prefill` compresses the layers together).
            `None` (the default): on in one-shot mode when the gates' logits are on one scale across layers
            (`EvictionGates.one_scale`: KVzap's target), off otherwise (resolved when the gates are bound).
    """

    sinks: int | None = None  # type: ignore[assignment]
    recent: int | None = None
    threshold: float | None = None
    across_layers: bool | None = None

    def protected_sinks(self) -> int:
        """The explicit `sinks`, else 0 until the gates are bound (`LearnedKVCache.bind_gates`)."""
        return 0 if self.sinks is None else self.sinks

    def recent_length(self, cache_length: int) -> int:
        """The explicit `recent`, else 0 until the gates are bound (`LearnedKVCache.bind_gates`)."""
        return 0 if self.recent is None else self.recent

    def check(self, cache_length: int) -> None:
        if self.sinks is not None:
            check_int("sinks", self.sinks, minimum=0)
        if self.recent is not None:
            check_int("recent", self.recent, minimum=0)
        protected = (self.sinks or 0) + self.recent_length(cache_length)
        if protected > cache_length:
            raise ValueError(
                f"sinks + recent must be <= cache_length, got sinks={self.sinks}, recent={self.recent}, "
                f"cache_length={cache_length}"
            )
        check_mode(self.mode, self.budget, cache_length, protected)
        if self.threshold is not None:
            check_float("threshold", self.threshold)
        if self.across_layers is not None:
            check_bool("across_layers", self.across_layers)
        if self.across_layers and self.mode != "one-shot":
            raise ValueError(f"across_layers=True is for mode='one-shot' (a budget over layers), got {self.mode!r}")


def _pre_rope(keys: torch.Tensor, rope: BoundRope, pos: torch.Tensor) -> torch.Tensor:
    """Keys `(B, G, T, D)` (after RoPE) at positions `pos` `(B, T)` rotated back to position 0, as
    `unrotate_keys` rotates them, then divided by `cos^2 + sin^2` at their positions and multiplied by its
    value at position 0.

    The factor is 1 (or YaRN's scaling squared, the same at every position) up to the rounding of the
    table: without the correction one token id at two positions (one pre-RoPE key in the first layer)
    would get logits that differ in float32 and the tie would be broken by the table's rounding, not
    by position as `drop_lowest` does. Written out in the fewest tensor operations (a decode step runs it
    in every layer): per element the arithmetic of `unrotate_keys` followed by the correction.
    """
    n_elem, half = rope.n_elem, rope.n_elem // 2
    cos, sin = rope.at(pos)
    c, s = cos.to(keys)[:, None], sin.to(keys)[:, None]  # (B, 1, T, n_elem): broadcast over heads
    c0, s0 = (t.to(keys)[:, None] for t in rope.at_zero())
    gain = (c0 * c0 + s0 * s0) / (c * c + s * s)
    x = keys[..., :n_elem]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    unrotated = (x * c + rotated * -s) * gain
    return unrotated if n_elem == keys.shape[-1] else torch.cat((unrotated, keys[..., n_elem:]), dim=-1)


def _gate_new_keys(gates: EvictionGates, rope: BoundRope, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`(B, H, T)` float32 logits of gate layer 0 for new keys `(B, H, T, D)` (after RoPE) at positions
    `pos` `(B, T)`: rotated back to position 0 in the keys' precision (float64 models: one token id at two
    positions gets one float32 logit, so the tie is broken by position in `drop_lowest`, not by rounding).

    The logit is `EvictionGates.logits`' value, its dot product summed along the head dim of each token
    alone (the same operations for one token in a decode step as in a prefill chunk of many)."""
    keys = keys.detach()
    keys = keys.to(torch.promote_types(keys.dtype, torch.float32))
    keys_pre = _pre_rope(keys, rope, pos)
    weight, bias = gates.weight[0].to(keys), gates.bias[0].to(keys)  # (H, D), (H,)
    dots = (keys_pre * weight[:, None, :]).sum(dim=-1)
    return (dots / math.sqrt(weight.shape[1]) + bias[:, None]).to(torch.float32)


def _gate_hidden(weight: torch.Tensor, bias: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """`(B, n, G, T)` float32 logits of hidden-input gates `weight` `(n, G, C)`, `bias` `(n, G)` (`n` layers) for
    their layers' attention inputs `hidden` `(B, n, T, C)`: `x . w / sqrt(C) + b`, in the inputs' precision
    (float32 at least). One layer is `n = 1`: per element the same operations, so the logits of layers computed
    together are bitwise those of each alone; the dot product is summed along `C` for each token alone."""
    x = hidden.detach()
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    w, b = weight.to(x), bias.to(x)
    dots = (x[:, :, None] * w[None, :, :, None, :]).sum(dim=-1)  # (B, n, G, T)
    return (dots / math.sqrt(w.shape[-1]) + b[None, :, :, None]).to(torch.float32)


def _hidden_of(record: Candidates, gates: EvictionGates) -> torch.Tensor:
    """The call's attention input `(B, T, C)`; ValueError when the caller gave none or one of another width."""
    hidden = record.hidden
    if hidden is None:
        raise ValueError(
            "policy 'learned': these eviction gates read the layer's hidden state (input='hidden'), which this "
            "call did not hand to the cache (use key-input gates where the hidden state is not at hand)"
        )
    if hidden.shape[-1] != gates.weight.shape[-1]:
        raise ValueError(
            f"policy 'learned': the gates read hidden states of width {gates.weight.shape[-1]}, the call gave "
            f"{tuple(hidden.shape)}"
        )
    return hidden


def _stacked_new_logits(policies: Sequence[Policy], records: Sequence[Candidates]) -> torch.Tensor | None:
    """`(n_layers, B, G, T)` the new tokens' gate logits of the layers' calls in one pass, each layer's
    remembered in its record (what `new_logits` returns for it); `None` (nothing computed) unless every
    policy is a bound `LearnedKVCache` of one RoPE table. The keys of all layers sit side by side on the head
    axis `(B, n_layers * G, T, D)`: per element the operations of one layer alone, so the values are bitwise
    those of `new_logits` layer by layer."""
    if not all(isinstance(p, LearnedKVCache) and p._gates is not None and p._rope is not None for p in policies):
        return None
    rope = policies[0]._rope  # type: ignore[attr-defined]
    if not all(p._rope == rope for p in policies):  # type: ignore[attr-defined]
        return None
    gates = [p._gates for p in policies]  # type: ignore[attr-defined]
    if gates[0].input == "hidden":  # every layer's gates are a slice of one model's
        weight, bias = torch.cat([g.weight for g in gates]), torch.cat([g.bias for g in gates])  # (n, G, C), (n, G)
        hidden = torch.stack([_hidden_of(r, g) for r, g in zip(records, gates, strict=True)], dim=1)
        new = _gate_hidden(weight, bias, hidden).transpose(0, 1)  # (n, B, G, T)
    else:
        weight, bias = torch.cat([g.weight for g in gates], dim=1), torch.cat([g.bias for g in gates], dim=1)
        stacked = EvictionGates(weight, bias, 0, 0)
        keys = torch.cat([r.new_keys for r in records], dim=1)
        logits = _gate_new_keys(stacked, rope, keys, records[0].query_pos)  # (B, n * G, T)
        b, _, t = logits.shape
        new = logits.view(b, len(policies), -1, t).transpose(0, 1)  # (n, B, G, T)
    for layer, record in zip(new, records, strict=True):
        record.remember(LearnedKVCache._new_logits, layer)
    return new


@register_kv_cache("learned")
class LearnedKVCache(ScoreKVCache):
    """Keeps the sinks, the recent window and the tokens with the highest gate logits.

    Attributes:
        logits: `(B, G, L)` float32 gate logit of each slot's token (0 for empty slots).
    """

    Options: ClassVar[type[PolicyOptions]] = LearnedOptions
    needs = frozenset({"rope", "gates", "hidden"})
    slot_state: ClassVar[Mapping[str, SlotState]] = {"logits": SlotState()}
    logits: torch.Tensor
    _gates: EvictionGates | None = None  # this layer's gates only, on the cache's device (bind_gates)
    _rope: BoundRope | None = None  # bind_rope
    _across: bool = False  # `across_layers` as resolved by bind_gates

    @property
    def threshold(self) -> float | None:
        """Slots whose logit is below it are emptied after every call (`None`: none)."""
        return self.options.threshold  # type: ignore[attr-defined]

    def empties_slots(self) -> bool:
        """In threshold mode, a call empties the slots whose logit is below the threshold (the undo log then
        records every slot; a run of compiled steps keeps the mask from its first step and one graph)."""
        return self.threshold is not None

    # -- binding --------------------------------------------------------------------------------

    def bind_gates(self, gates: EvictionGates | None, layer: int) -> None:
        """Take layer `layer` of `gates` (`(n_layer, G, D)`); resolve `sinks`/`recent` left to the gates.

        Raises:
            ValueError: no gates, gates of another shape, or sinks + recent longer than the cache.
        """
        if gates is None:
            raise ValueError(NO_GATES)
        if not isinstance(gates, EvictionGates):
            raise TypeError(f"bind_gates expects EvictionGates, got {type(gates).__name__}")
        source = f"policy 'learned' (layer {layer})"
        gates.check_model(gates.n_layer, self.shape.n_query_groups, self.shape.key_size, None, source)
        if not 0 <= layer < gates.n_layer:
            raise ValueError(f"{source}: layer must be in [0, {gates.n_layer}) (the gates' n_layer), got {layer}")
        o = self.options
        room = o.budget if o.mode == "one-shot" else self.cache_length
        self.sinks = min(gates.sinks, room // 4) if o.sinks is None else o.sinks
        # half of what the sinks leave, as H2O's default (on the shipped model this halved the KL of a
        # 128-slot cache against the gates' training window of 32, at the same recall: docs/learned.md)
        self.recent = (room - self.sinks) // 2 if o.recent is None else o.recent
        if self.sinks + self.recent > room:
            what = f"budget={room}" if o.mode == "one-shot" else f"cache_length={room}"
            raise ValueError(
                f"{source}: sinks + recent must be <= {what}, got sinks={self.sinks}, recent={self.recent} "
                f"(the gates' defaults: sinks={gates.sinks}, window={gates.window}; set --kv_cache.sinks/recent)"
            )
        across = o.across_layers
        self._across = bool(gates.one_scale and o.mode == "one-shot") if across is None else across
        part = EvictionGates(
            gates.weight[layer : layer + 1], gates.bias[layer : layer + 1], gates.window, gates.sinks, input=gates.input
        )
        self._gates = part.to(self.positions.device)

    def bind_rope(self, table: RopeTable, n_elem: int, column: int | None = None) -> None:
        """The model's RoPE: `table(n)` gives cos and sin `(N, n_elem[, k])` covering the positions of the
        calls the model runs (`column` picks the last dim of per-layer tables)."""
        self._rope = BoundRope(table, n_elem, column)

    # -- scoring --------------------------------------------------------------------------------

    def new_logits(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, T)` float32 gate logits of the call's new tokens (computed once per call, from
        `candidates.new_keys` as computed, rotated back to position 0, or from `candidates.hidden` for
        hidden-input gates; pads get a meaningless value)."""
        return candidates.once(self._new_logits)

    def _new_logits(self, candidates: Candidates) -> torch.Tensor:
        gates, rope = self._bound()
        if gates.input == "hidden":
            hidden = _hidden_of(candidates, gates)[:, None]  # (B, 1, T, C)
            return _gate_hidden(gates.weight, gates.bias, hidden)[:, 0]
        return _gate_new_keys(gates, rope, candidates.new_keys, candidates.query_pos)

    @classmethod
    def stacked_scores(cls, policies: Sequence[ScoreKVCache], records: Sequence[Candidates]) -> torch.Tensor:
        """The layers' scores `(n_layers, B, G, L + 1)` built at once: the new tokens' gate logits of every
        layer in one pass (`_stacked_new_logits`), then the slots' carried logits stacked and the new ones
        appended in one copy. Each layer's record gets its view (what `score` returns for it), so the values
        are those of `score` layer by layer."""
        new = _stacked_new_logits(policies, records)
        if new is None:
            return super().stacked_scores(policies, records)
        slots = torch.stack([c.logits for c in policies])  # type: ignore[attr-defined]  # (n, B, G, L)
        scores = torch.cat((slots, new.to(slots.dtype)), dim=3)
        for i, record in enumerate(records):
            record.remember(LearnedKVCache._score, scores[i])
        return scores

    @classmethod
    def prepare_layers(cls, policies: Sequence[Policy], records: Sequence[Candidates]) -> None:
        """A decode step into empty slots (a compressed one-shot cache, a cache still filling): every layer's
        new gate logits in one pass (`_stacked_new_logits`), which each layer's `update_state` then reads."""
        _stacked_new_logits(policies, records)

    def score(self, candidates: Candidates) -> torch.Tensor:
        """`(B, G, L + T)` float32: the slots' carried logits, then the new tokens' fresh ones (built once
        per call: `select_drop` and `update_state` both read it)."""
        return candidates.once(self._score)

    def _score(self, candidates: Candidates) -> torch.Tensor:
        return torch.cat((self.logits, self.new_logits(candidates)), dim=2)

    def oneshot_scores(self) -> torch.Tensor:
        """`(B, G, L)` the slots' logits; sinks and the recent window `inf`."""
        self._bound()
        return self.protect(self.logits.clone(), self.positions)

    def compresses_across_layers(self) -> bool:
        """`across_layers` (as resolved: by default with one-scale gates) in one-shot mode: the layers
        compress together (`compress_all`)."""
        return self.one_shot is not None and self._across

    def update_state(self, placement: Placement, candidates: Candidates) -> StateUpdate:
        """Carry each surviving candidate's logit into its slot; in threshold mode, empty the old slots
        whose logit is below the threshold. A direct call (tokens into the empty slots `[start, start + T)`,
        nothing evicted) writes its new logits there in place and nothing else (0 at pads)."""
        compiling = torch.compiler.is_compiling()  # (static shapes: in place is what they need)
        in_place = compiling or not self.logits.is_inference() or torch.is_inference_mode_enabled()
        if placement.start is not None and self.threshold is None and in_place:
            s, new = placement.start, self.new_logits(candidates)
            pads = candidates.positions[..., -new.shape[-1] :] < 0
            self.logits[..., s : s + new.shape[-1]] = new.masked_fill(pads, 0.0)
            return {}
        logits = placement.carry(self.score(candidates))
        if self.threshold is not None:
            protected = self._protected(self.positions)
            below = logits < self.threshold
            self.positions.masked_fill_(below if protected is None else below & ~protected, -1)
        return {"logits": logits.masked_fill_(self.positions < 0, 0.0)}  # `carry` made a new tensor

    def _bound(self) -> tuple[EvictionGates, BoundRope]:
        if self._gates is None or self._rope is None:
            missing = "eviction gates (bind_gates)" if self._gates is None else "RoPE table (bind_rope)"
            raise RuntimeError(
                f"LearnedKVCache has no {missing}: attach the caches with GPT.set_kv_caches on a model whose "
                "eviction_gates are set (load_model reads them from the checkpoint), or call "
                "cache.bind_gates(gates, layer) and cache.bind_rope(table, n_elem)"
            )
        return self._gates, self._rope
