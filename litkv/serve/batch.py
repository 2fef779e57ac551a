"""The rows of `litkv serve`'s running batch: one set of caches with `rows` rows, a row per conversation.

A row's result must not depend on its batch-mates, to the bit, so that a conversation gets the same
tokens alone and under load, and from a stored state or recomputed. Two things would make it depend:

- **The attended length.** A lossless cache that is still filling attends only its filled prefix, and
  the prefix of a batch is its fullest row's (a host counter shared by the rows): a shorter row would
  attend more (masked) slots than alone, and float sums over more terms round differently. So every
  cache here runs with `static_shapes`: every call attends all slots (empty ones masked by position
  `-1`), for every row, whatever its batch-mates hold.
- **The matrix products' row count.** A CPU matmul rounds a row differently with the number of rows
  `M` (the classes of counts that round alike depend on the CPU), though not with the row's place or its
  neighbours. The counts that round alike are measured at start (`litkv.serve.rounding`), and every
  decode step runs the smallest count of `rows`' class that holds the rows in use (a lone conversation
  in a batch of 8: 2 rows where 2..15 round alike), so a row rounds the same alone and under load. The rows in use
  are kept first in the caches (a leaving row's place is taken by the last one: one row's copy), and a
  step runs on views of the first rows (`_Narrowed`); an idle row among them is padding (position `-1`,
  nothing attended, nothing stored). A reply replayed from its ids is fed in decode steps, as decoding
  fed it.

Prompt text is fed at batch one, in a scratch set of caches of one row: the row's state is copied
there, the text runs through the chunk runner (`litkv.modeling.runner.run_chunks`: the scheduler gives
one chunk of `litkv.inference.conversation.segment_plan`'s chunking at a time, documents go in whole), and
the row is copied back: the other rows are neither run nor copied. Joining and leaving the batch is one
row's copy (`KVCaches.copy_row`).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch

from litkv.inference.blocks import feed_blocks
from litkv.kvcache.caches import KVCaches
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.recurrent import RecurrentCache
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT
from litkv.modeling.runner import run_chunks
from litkv.serve.rounding import RoundingClasses, probe_rounding_classes
from litkv.states.block_store import BlockStore
from litkv.states.state import CacheState, LayerState, RecurrentLayerState

__all__ = ["RowBatch"]

log = logging.getLogger(__name__)


class RowBatch:
    """The running batch's caches (`rows` rows) and the scratch caches of one row for prompt text.

    Rows are named by the caller (`0..rows-1`, a job's row); where a row lives in the caches is this
    object's business: a row is in use from `clear` or `load` until `release`.

    Args:
        model: the GPT (the batch's caches are attached to it between calls).
        kv_cache: the cache config of every layer.
        rows: rows of the batch (`--max_batch`).
        classes: the rounding classes of counts `1..rows` (default: measured now,
            `litkv.serve.rounding.probe_rounding_classes`).
    """

    def __init__(
        self,
        model: GPT,
        kv_cache: KVCacheConfig,
        rows: int,
        classes: RoundingClasses | None = None,
    ) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        self.model = model
        self.kv_cache = kv_cache
        self.rows = rows
        self.device = model.lm_head.weight.device
        self.classes = classes if classes is not None else probe_rounding_classes(model, rows)
        if rows in self.classes.place_dependent:
            warnings.warn(
                f"a matmul of {rows} rows rounds a row by its place here: replies may depend on their batch-mates",
                stacklevel=2,
            )
        self.rounding_rows = min(self.classes.class_of(rows))  # every step rounds as a step of this many rows
        log.info(
            "rounding classes of 1..%d rows: %s; decode steps run %d..%d rows",
            rows,
            self.classes.describe(),
            self.rounding_rows,
            rows,
        )
        self.batch = self._caches(rows)
        self.scratch = self._caches(1)
        self.blank = self._caches(1)  # never run: what an empty row holds
        self.fingerprint = model_fingerprint(model)
        self.place: dict[int, int] = {}  # a row in use -> its index in the caches (0..in use - 1)
        self._narrowed: dict[int, _Narrowed] = {}
        self.narrowing = not any(cache.policy.row_state for cache in self.batch.policy_caches)
        self.last_step_rows = 0
        model.set_kv_caches(self.batch)

    def _caches(self, rows: int) -> KVCaches:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. qh2o choosing its storage: said once at start
            caches = KVCaches(self.model.build_kv_caches(self.kv_cache, rows))
        caches.static_shapes = True
        for cache in caches.policy_caches:
            cache.num_filled = cache.cache_length  # static: never trimmed, never a filled-prefix call
        caches.last_pos = torch.full((rows,), -1, dtype=torch.long, device=self.device)
        return caches

    def nbytes_per_row(self) -> int:
        """Bytes of keys and values one row holds."""
        return self.batch.nbytes() // self.rows

    def step_rows(self) -> int:
        """Rows the next decode step runs: the smallest count of the batch's rounding class that holds
        the rows in use (every row without narrowing)."""
        if not self.narrowing:
            return self.rows
        return self.classes.step_rows(len(self.place), self.rows)

    # -- rows in and out ------------------------------------------------------------------------

    def _index(self, row: int, take: bool = False) -> int:
        """Where `row` lives in the caches; `take`: put a row not in use after the rows in use."""
        if not 0 <= row < self.rows:
            raise ValueError(f"row must be in [0, {self.rows}), got {row}")
        if row not in self.place:
            if not take:
                raise ValueError(f"row {row} is not in use (clear or load it first)")
            self.place[row] = len(self.place)
        return self.place[row]

    @torch.inference_mode()
    def release(self, row: int) -> None:
        """`row` is free (nothing copied out); the last row in use takes its place in the caches."""
        index = self.place.pop(row, None)
        if index is None:
            return
        last = len(self.place)
        if index != last:
            moved = next(r for r, i in self.place.items() if i == last)
            self.batch.copy_row(index, self.batch, last)
            self.place[moved] = index

    @torch.inference_mode()
    def clear(self, row: int) -> None:
        """Empty `row` (a conversation that starts from nothing); it is in use until `release`."""
        self.batch.copy_row(self._index(row, take=True), self.blank, 0)

    @torch.inference_mode()
    def load(self, row: int, state: CacheState) -> None:
        """Set `row` to `state` (one row, taken by `take` from caches of this config; a hybrid model's
        recurrent layers too); it is in use until `release`."""
        if state.batch_size != 1:
            raise ValueError(f"a row's state has one row, got {state.batch_size}")
        if len(state.layers) != len(self.scratch):
            raise ValueError(f"the state has {len(state.layers)} layers, the server's caches {len(self.scratch)}")
        for i, (cache, layer) in enumerate(zip(self.scratch.layers, state.layers, strict=True)):
            if isinstance(cache, RecurrentCache) or isinstance(layer, RecurrentLayerState):
                if not (isinstance(cache, RecurrentCache) and isinstance(layer, RecurrentLayerState)):
                    raise ValueError(f"layer {i} of the state is of another kind than the server's")
                if layer.kind != cache.kind or dataclasses.replace(layer.shape, batch_size=1) != cache.shape:
                    raise ValueError(f"layer {i} of the state has another recurrent kind or shape than the server's")
                cache.load_state_tensors(layer.full_tensors(self.device))
                continue
            if layer.config != cache.config or layer.shape.cache_length != cache.cache_length:
                raise ValueError(f"layer {i} of the state has another cache config than the server's")
            cache.load_state_tensors(layer.full_tensors(self.device), cache.cache_length)
        self.scratch.last_pos = torch.full((1,), -1, dtype=torch.long, device=self.device)
        if state.last_pos is not None:
            self.scratch.last_pos[0] = state.last_pos[0]
        self.batch.copy_row(self._index(row, take=True), self.scratch, 0)

    @torch.inference_mode()
    def take(self, row: int) -> CacheState:
        """A host copy of `row` as a state of one row (the other rows are not copied)."""
        index = self._index(row)
        layers: list[LayerState | RecurrentLayerState] = []
        for cache in self.batch.layers:
            tensors = {name: t[index : index + 1].to("cpu", copy=True) for name, t in cache.state_tensors().items()}
            shape = dataclasses.replace(cache.shape, batch_size=1)
            if isinstance(cache, RecurrentCache):  # a hybrid model's recurrent layer: its row of the state
                layers.append(RecurrentLayerState(shape, tensors, cache.kind))
            else:
                layers.append(LayerState(cache.config, shape, tensors, cache.cache_length, cache.cache_length))
        last = self.batch.last_pos
        last_pos = None if last is None else last[index : index + 1].to("cpu", copy=True)
        return CacheState(layers, last_pos, self.fingerprint, self.batch[0].dtype)

    def next_pos(self, row: int) -> int:
        """The position `row`'s next token takes (0 for an empty row or one not in use)."""
        last = self.batch.last_pos
        index = self.place.get(row)
        return 0 if last is None or index is None else int(last[index]) + 1

    # -- calls ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, row: int, ids: list[int], plan: ChunkPlan) -> torch.Tensor:
        """Feed prompt `ids` to `row` at batch one (the scratch caches); final hidden state `(1, n_embd)`
        of the last token."""
        start, index = self.next_pos(row), self._index(row)
        self.scratch.copy_row(0, self.batch, index)
        self.model.set_kv_caches(self.scratch)
        try:
            idx = torch.tensor([ids], dtype=torch.long, device=self.device)
            pos = torch.arange(start, start + len(ids), device=self.device)[None]
            hidden = run_chunks(self.model, idx, pos, plan, lm_head=False, last_only=True)
        finally:
            self.model.set_kv_caches(self.batch)
        self.batch.copy_row(index, self.scratch, 0)
        return hidden[:, -1]

    @torch.inference_mode()
    def feed_blocks(
        self,
        row: int,
        blocks: list[tuple[int, ...]],
        text: tuple[int, ...] | None,
        store: BlockStore,
        recompute: float,
    ) -> torch.Tensor:
        """Splice documents `blocks` into `row`, then feed `text` (the prompt text after them, or `None`), at
        batch one (the scratch caches; `litkv.inference.blocks.feed_blocks`, each document's KV computed alone with the
        config's chunking); final hidden state `(1, n_embd)` of the last token."""
        start, index = self.next_pos(row), self._index(row)
        self.scratch.copy_row(0, self.batch, index)
        self.model.set_kv_caches(self.scratch)
        try:
            ids = [torch.tensor(b, dtype=torch.long) for b in blocks]
            after = None if text is None else torch.tensor(text, dtype=torch.long)
            plan = ChunkPlan.of(self.kv_cache)
            hidden = feed_blocks(self.model, ids, after, start, plan, store, recompute)
        finally:
            self.model.set_kv_caches(self.batch)
        self.batch.copy_row(index, self.scratch, 0)
        return hidden

    @torch.inference_mode()
    def step(self, tokens: list[int | None], positions: list[int]) -> torch.Tensor:
        """One decode step: `tokens[r]` at `positions[r]` for each row `r` (`None`: the row is not fed).
        Runs `step_rows()` rows of the caches (the rows in use first, the others padding). Returns the
        logits `(rows, V)` by row (those of a row not fed are meaningless)."""
        m = self.step_rows()
        idx_t, pos_t, where = self._step_inputs(tokens, positions, m)
        caches = self._narrow(m)
        self.model.set_kv_caches(caches.caches if caches is not None else self.batch)
        try:
            with self.model.trusted_inputs(max(positions) + 1):
                hidden = self.model(idx_t, pos_t, lm_head=False)
        finally:
            self.model.set_kv_caches(self.batch)
            if caches is not None:
                caches.write_back()
        self.last_step_rows = m
        logits = self.model.logits(hidden[:, -1])
        return logits[where]

    def _step_inputs(
        self, tokens: list[int | None], positions: list[int], m: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's token ids and positions `(m, 1)` (the rows not fed: padding), and each row's index."""
        if len(tokens) != self.rows or len(positions) != self.rows:
            raise ValueError(f"a step takes {self.rows} tokens and positions, got {len(tokens)}, {len(positions)}")
        idx, pos = [0] * m, [-1] * m
        where = [0] * self.rows
        for r, (t, p) in enumerate(zip(tokens, positions, strict=True)):
            if t is not None:
                where[r] = self._index(r)
                idx[where[r]], pos[where[r]] = t, p
        idx_t = torch.tensor(idx, dtype=torch.long, device=self.device)[:, None]
        pos_t = torch.tensor(pos, dtype=torch.long, device=self.device)[:, None]
        return idx_t, pos_t, torch.tensor(where, device=self.device)

    def _narrow(self, m: int) -> _Narrowed | None:
        """Caches of the first `m` rows, viewing the batch's (None: run the batch's own)."""
        if not self.narrowing or m == self.rows:
            return None
        narrowed = self._narrowed.get(m)
        if narrowed is None:
            narrowed = self._narrowed[m] = _Narrowed(self._caches(m))
        try:
            narrowed.bind(self.batch)
        except ValueError as err:  # a policy whose state is not batch-first: every step runs every row
            warnings.warn(f"every decode step runs all {self.rows} rows: {err}", stacklevel=2)
            self.narrowing = False
            return None
        return narrowed

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `(1, V)` of a prefill's last hidden state `(1, n_embd)`."""
        return self.model.logits(hidden)


class _Narrowed:
    """Caches of the first `m` rows of a batch, made of views of the batch's tensors.

    `bind` points every tensor of each layer cache (and its storage) at the batch's: a batch-first
    tensor at its first `m` rows, a tensor of the same shape at the tensor itself. A call writes most
    of them in place (static shapes); `write_back` copies into the batch any tensor the call rebound.
    """

    def __init__(self, caches: KVCaches) -> None:
        self.caches = caches
        self.bound: list[tuple[object, str, object, object]] = []  # (holder, name, view, target)
        self.sources: list[tuple[object, str, object]] = []  # (batch's holder, name, what the views view)

    def bind(self, batch: KVCaches) -> None:
        """ValueError when a tensor of these caches has no counterpart in `batch`'s. Nothing to do when the
        batch holds the tensors the views were made of (the batch's tensors are rebound only by row copies
        of recurrent layers)."""
        if self.sources and all(vars(h).get(name) is src for h, name, src in self.sources):
            return
        m = self.caches.batch_size
        self.bound, sources = [], []
        for small, full in zip(self.caches.layers, batch.layers, strict=True):
            holders = [(small, full)]
            if isinstance(small, SlotMachine) and isinstance(full, SlotMachine):
                holders += [(small.storage, full.storage), (small.policy, full.policy)]
            for h_small, h_full in holders:
                for name, value in list(vars(h_small).items()):
                    if isinstance(value, torch.Tensor):
                        view = _view_of(vars(h_full).get(name), value, m, name)
                    elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
                        target = vars(h_full).get(name)
                        if not isinstance(target, tuple) or len(target) != len(value):
                            raise ValueError(f"{type(h_small).__name__}.{name} has no counterpart in the batch")
                        view = tuple(_view_of(t, v, m, name) for t, v in zip(target, value, strict=True))
                    else:
                        continue
                    setattr(h_small, name, view)
                    self.bound.append((h_small, name, view, view))
                    sources.append((h_full, name, vars(h_full).get(name)))
        if batch.last_pos is not None:
            self.caches.last_pos = batch.last_pos[:m]
            self.bound.append((self.caches, "last_pos", self.caches.last_pos, self.caches.last_pos))
        sources.append((batch, "last_pos", batch.last_pos))
        self.sources = sources

    def write_back(self) -> None:
        """Copy into the batch every tensor a call rebound (then view the batch's again)."""
        for holder, name, view, target in self.bound:
            now = getattr(holder, name)
            if now is view:
                continue
            for dst, src in zip(
                target if isinstance(target, tuple) else (target,),
                now if isinstance(now, tuple) else (now,),
                strict=True,
            ):
                dst.copy_(src)
            setattr(holder, name, view)


def _view_of(full: object, small: torch.Tensor, m: int, name: str) -> torch.Tensor:
    """`full`'s first `m` rows when `small` is that shape, `full` itself when it is `small`'s shape."""
    if isinstance(full, torch.Tensor) and full.dtype == small.dtype:
        if full.shape == small.shape:
            return full
        if full.dim() >= 1 and small.shape[0] == m and full.shape[1:] == small.shape[1:]:
            return full[:m]
    raise ValueError(f"the cache tensor {name!r} {tuple(small.shape)} has no batch-first counterpart in the batch")
