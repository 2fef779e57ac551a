"""`kvzip`: query-agnostic one-shot compression by context reconstruction (Kim et al., 2025, "KVzip:
Query-Agnostic KV Cache Compression with Context Reconstruction"; kvpress 0.5.5 `KVzipPress`).

Each cached pair is scored by the largest attention it receives while the model repeats the context
from the cache: after the prompt is prefilled (every token kept, as every one-shot policy), a driver
(`litkv.inference.kvzip_reconstruction.kvzip_compress`, which owns the model) feeds, per chunk of `chunk_size`
context tokens, "Repeat the previous context exactly." (later chunks: "Repeat the part of the previous
context exactly, starting with" and the previous chunk's last 8 tokens), the chat template's end of
the user turn, then the chunk itself, at the positions after the prompt. Every layer's cache is then in
*scoring* mode (`begin_scoring`): the call attends the whole cache as an ordinary call would (so the
next layer's input is the model's), nothing is stored, and the chunk's slots get

    score(l) = max over the KV head's query heads h and the call's queries t of a[h, t, l]

where `a` is the softmax of `q . k / sqrt(D)` over the first `n_sink` positions, the chunk and the
call's own tokens (causal), as kvpress computes it. With `kvzip_plus` (KVzip+, kvpress's
`kvzip_plus_normalization`), `a[h, t, l]` is multiplied by `||W_o^h v_l|| / ||x_t||` (`W_o^h`: head h's
block of the output projection; `x_t`: the attention's input, after the block's norm). Positions no
chunk covers (a chat template's prefix) score 0; the first `n_sink` positions are always kept (kvpress
0.5.5 gives them the highest score at the compression; they count against the budget).

`compress_kvzip(caches)` then keeps, per row, the `budget x G x n_layers` best scores over all layers
and KV heads (`layerwise=false`, the paper's and kvpress's default) or `budget x G` per layer
(`layerwise=true`); within a layer the heads share its count by score (kvpress's masking, per head).
The kept slots move before `num_filled`, right-aligned in each head (`compact_slots`). After that the cache takes
new tokens without eviction; if it fills up, the lowest scores go first (new tokens score the largest float32).

KVzip is a one-shot method, and `kvzip` runs one-shot only (`mode="one-shot"`, the default; `budget` defaults
to `cache_length`): the caller that owns the model runs the reconstruction pass after the prefill (`generate`
with `kvzip_repeat=`, `litkv generate`, `litkv evaluate`). `mode="continuous"` is refused: no reconstruction
can run inside a call, so every token would score the same and the cache would keep the newest tokens, as
`last-recent` does, under KVzip's name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from litkv.kvcache.base import Candidates, KVCache, Placement, SlotState, drop_lowest
from litkv.kvcache.candidates import newest
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.one_shot import OneShot, compress_layers, keep_across_layers
from litkv.kvcache.options import PolicyOptions, ScoreOptions, check_bool, check_int
from litkv.kvcache.policy import StateUpdate
from litkv.kvcache.registry import register_kv_cache

__all__ = ["KVzipCompression", "KVzipKVCache", "KVzipOptions", "Scoring", "compress_kvzip", "kvzip_keep"]


@dataclass
class KVzipOptions(ScoreOptions):
    """Args (besides `mode` and `budget`; `sinks`/`recent` apply only to eviction outside the compression):
    mode: `one-shot` only (the default; `continuous` is refused: no reconstruction can run inside a call).
    budget: tokens kept per KV head (on average over layers) by the compression; default `cache_length`.
    n_sink: first positions always attended by the reconstruction queries (kvpress: 4).
    kvzip_plus: KVzip+ normalisation (`||W_o v|| / ||x||`).
    layerwise: the same count kept in every layer (`budget x G`); default: across layers by score.
    chunk_size: context tokens repeated per reconstruction call (kvpress: 2048).
    """

    default_recent_fraction: ClassVar[float] = 0.0  # as kvpress's KVzipPress: no recent window

    mode: str = "one-shot"
    n_sink: int = 4
    kvzip_plus: bool = False
    layerwise: bool = False
    chunk_size: int = 2048

    def check(self, cache_length: int) -> None:
        if self.mode == "continuous":
            raise ValueError(
                "kvzip has no mode='continuous': its scores come from a reconstruction pass over a whole prompt, "
                "which cannot run inside a call (it would keep the newest tokens, as last-recent does); use "
                "mode='one-shot' (its default) or policy 'last-recent'"
            )
        budget = cache_length if self.budget is None else self.budget
        ScoreOptions.check(dataclasses.replace(self, budget=budget), cache_length)
        check_int("n_sink", self.n_sink, minimum=0)
        check_bool("kvzip_plus", self.kvzip_plus)
        check_bool("layerwise", self.layerwise)
        check_int("chunk_size", self.chunk_size, minimum=1)

    def one_shot_budget(self, cache_length: int) -> int | None:
        """`budget`, or without one `cache_length` (compress only what does not fit)."""
        return cache_length if self.budget is None else self.budget


@dataclass
class Scoring:
    """One reconstruction call's chunk, per row: positions `[start, end)` are scored, positions below `sink`
    are attended too; `proj_weight` `(n_embd, n_head x D)` and `hidden` `(B, T, n_embd)` (the attention's
    input) for KVzip+ (else `None`)."""

    start: torch.Tensor  # (B,)
    end: torch.Tensor  # (B,)
    sink: torch.Tensor  # (B,)
    proj_weight: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class KVzipCompression(OneShot):
    """kvzip's one-shot compression: every layer at once, after the reconstruction pass (`compress_kvzip`)."""

    def compress(self) -> None:
        """A single layer cannot rank against the others: `compress_kvzip` compresses every layer at once."""
        raise RuntimeError(
            "kvzip scores the prompt with a context-reconstruction pass that needs the model: run "
            "litkv.inference.kvzip_reconstruction.kvzip_compress(model, prompts, repeat) after the prefill ("
            "`litkv evaluate` does), not end_prefill()/compress() of a layer"
        )


@register_kv_cache("kvzip")
class KVzipKVCache(KVCache):
    """One-shot cache whose scores come from a context-reconstruction pass (module docstring).

    Attributes:
        kvzip_scores: `(B, G, L)` float32 score of each slot's token (the largest float32 for tokens that
            came after the compression).
        scoring: the chunk of the reconstruction call under way (`begin_scoring`), else `None`.
    """

    Options: ClassVar[type[PolicyOptions]] = KVzipOptions
    needs = frozenset({"queries"})
    slot_state: ClassVar[dict[str, SlotState]] = {"kvzip_scores": SlotState(0.0)}
    compression = KVzipCompression

    def __init__(self, cache: SlotMachine) -> None:
        super().__init__(cache)
        self.sinks = self.options.sinks
        self.recent = self.options.recent_length(self.cache_length)
        self.scoring: Scoring | None = None
        self.scored = False

    # -- the reconstruction pass ------------------------------------------------------------------

    def start_scores(self) -> None:
        """Before the first reconstruction call: every score 0."""
        if not self.before_compression():
            raise RuntimeError("KVzipKVCache: the reconstruction pass is for mode='one-shot', before the compression")
        self.cache.set_state("kvzip_scores", torch.zeros_like(self.positions, dtype=torch.float32))
        self.scored = True

    def begin_scoring(self, scoring: Scoring | None) -> None:
        """Set (or clear, `None`) the chunk of the next call: that call scores and stores nothing."""
        self.scoring = scoring

    def flags(self) -> dict[str, bool]:
        """Whether the reconstruction pass scored the slots (`"row.kvzip_scored"`)."""
        return {"kvzip_scored": self.scored}

    def set_flags(self, flags: Mapping[str, bool]) -> None:
        self.scored = flags["kvzip_scored"]

    def reads_only(self) -> bool:
        """While scoring (`begin_scoring`): the reconstruction call is read, not stored."""
        return self.scoring is not None

    def read_call(
        self,
        slot_keys: torch.Tensor,
        slot_values: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        input_pos: torch.Tensor,
        queries: torch.Tensor,
    ) -> None:
        """A reconstruction call: the scores of the chunk's slots from its queries `(B, H, T, D)` (module
        docstring)."""
        s = self.scoring
        if s is None:
            raise RuntimeError("KVzipKVCache.read_call outside a reconstruction call")
        b, g, t, d = new_keys.shape
        q_per = queries.shape[1] // g
        ct = torch.promote_types(queries.dtype, torch.float32)
        pos = self.positions
        in_chunk = (pos >= s.start[:, None, None]) & (pos < s.end[:, None, None])
        visible = (pos >= 0) & (in_chunk | (pos < s.sink[:, None, None]))
        # the visible slots first, per (row, head): (B, G, M), M = the most any head sees
        m = max(int(visible.sum(dim=2).max()), 1)
        order = torch.sort((~visible).to(torch.int8), dim=2, stable=True).indices[..., :m]
        sub_visible = visible.gather(2, order)
        sub_keys = slot_keys.gather(2, order[..., None].expand(b, g, m, d)).to(ct)
        q = queries.to(ct).view(b, g, q_per, t, d)
        scale = 1.0 / math.sqrt(d)
        logits_slots = torch.einsum("bgqtd,bgmd->bgqtm", q, sub_keys) * scale
        logits_new = torch.einsum("bgqtd,bgsd->bgqts", q, new_keys.to(ct)) * scale
        causal = (input_pos[:, None, :] <= input_pos[:, :, None]) & (input_pos[:, None, :] >= 0)  # (B, T, S)
        logits_slots = logits_slots.masked_fill(~sub_visible[:, :, None, None, :], float("-inf"))
        logits_new = logits_new.masked_fill(~causal[:, None, None], float("-inf"))
        weights = torch.softmax(torch.cat((logits_slots, logits_new), dim=-1), dim=-1)[..., :m]
        if self.options.kvzip_plus:
            weights = weights * self._plus_factor(s, slot_values, order, ct)
        weights = weights.masked_fill((input_pos < 0)[:, None, None, :, None], 0.0)
        best = weights.amax(dim=(2, 3))  # (B, G, M)
        scores = torch.zeros_like(self.kvzip_scores).scatter(2, order, best.to(torch.float32))
        self.cache.set_state("kvzip_scores", torch.where(in_chunk, scores, self.kvzip_scores))

    def _plus_factor(self, s: Scoring, slot_values: torch.Tensor, order: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
        """KVzip+: `(B, G, q, T, M)` factor `||W_o^h v_m|| / ||x_t||`."""
        if s.proj_weight is None or s.hidden is None:
            raise ValueError("kvzip_plus needs the output projection and the attention's input (Scoring)")
        b, g, m = order.shape
        dv = slot_values.shape[-1]
        sub_values = slot_values.gather(2, order[..., None].expand(b, g, m, dv)).to(ct)
        w_o = s.proj_weight.to(ct).view(s.proj_weight.shape[0], g, -1, dv)  # (E, G, q, D)
        wov = torch.einsum("egqd,bgmd->bgqme", w_o, sub_values).norm(dim=-1)  # (B, G, q, M)
        inv_h = 1.0 / s.hidden.to(ct).norm(dim=-1)  # (B, T)
        return inv_h[:, None, None, :, None] * wov[:, :, :, None, :]

    # -- the compression ---------------------------------------------------------------------------

    def oneshot_scores(self) -> torch.Tensor:
        return self.kvzip_scores

    def score(self, candidates: Candidates) -> torch.Tensor:
        """After the compression, if the cache fills up: the slots' scores, new tokens the largest float32
        (below the `inf` of the sinks and the recent window, so that those stay protected)."""
        t = candidates.num_new
        top = torch.finfo(torch.float32).max
        new = torch.full((*self.kvzip_scores.shape[:2], t), top, device=self.kvzip_scores.device)
        return torch.cat((self.kvzip_scores, new), dim=2)

    def drops_valid_by_construction(self) -> bool:
        return True

    def select_drop(self, candidates: Candidates) -> torch.Tensor:
        """The `T` lowest `score()`s; empty slots and pads first, the `sinks` first positions and the
        `recent` newest never."""
        pos = candidates.positions
        scores = self.score(candidates)
        protected = (pos >= 0) & (pos < self.sinks)
        if self.recent > 0:
            protected = protected | newest(pos, self.recent)
        scores = scores.masked_fill(protected, float("inf")).masked_fill(pos < 0, float("-inf"))
        return drop_lowest(scores, pos, candidates.num_new)

    def update_state(self, placement: Placement, candidates: Candidates) -> StateUpdate:
        return {"kvzip_scores": placement.carry(self.score(candidates))}


#: The kept slots of the compression (`litkv.kvcache.one_shot.keep_across_layers`).
kvzip_keep = keep_across_layers


def compress_kvzip(caches: Sequence[SlotMachine]) -> None:
    """Compress every layer's cache (each running a `KVzipKVCache`) to its share of the budget (after the
    reconstruction pass)."""
    if not caches:
        raise ValueError("compress_kvzip needs at least one KVzipKVCache")
    policies = [cache.policy for cache in caches]
    if not all(isinstance(p, KVzipKVCache) for p in policies):
        raise ValueError(f"compress_kvzip: every layer needs kvzip, got {sorted({type(p).__name__ for p in policies})}")
    first = policies[0]
    for policy in policies:
        if not policy.scored:  # type: ignore[attr-defined]
            raise RuntimeError("compress_kvzip before the reconstruction pass (KVzipKVCache.start_scores)")
        if policy.options != first.options:
            raise ValueError("kvzip: every layer must have the same options (budget, layerwise, n_sink)")
    options = first.options
    scores = torch.stack([p.kvzip_scores for p in policies])  # type: ignore[attr-defined]
    compress_layers(caches, scores, options.layerwise, options.n_sink)  # type: ignore[attr-defined]
