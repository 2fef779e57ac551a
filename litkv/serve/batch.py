"""The rows of `litkv serve`'s running batch: one set of caches with `rows` rows, a row per conversation.

A row's result must not depend on its batch-mates, to the bit, so that a conversation gets the same
tokens alone and under load, and from a stored state or recomputed. Two things would make it depend:

- **The attended length.** A lossless cache that is still filling attends only its filled prefix, and
  the prefix of a batch is its fullest row's (a host counter shared by the rows): a shorter row would
  attend more (masked) slots than alone, and float sums over more terms round differently. So every
  cache here runs with `static_shapes`: every call attends all slots (empty ones masked by position
  `-1`), for every row, whatever its batch-mates hold.
- **The matrix products' row count.** A CPU matmul rounds a row differently with the number of rows
  `M` (M = 1, 2..15 and 16 differ on the development CPU), though not with the row's place or its
  neighbours. So every decode step runs all `rows` rows (an idle row is padding: position `-1`,
  nothing attended, nothing stored), alone or under load, and a reply replayed from its ids is fed in
  the same steps as decoding fed it.

Prompt text is fed at batch one, in a scratch set of caches of one row: the row's state is copied
there, the segment runs through the chunk runner (`litkv.modeling.runner.run_chunks`, the chunking of
`litkv.inference.conversation.segment_plan`), and the row is copied back: the other rows are neither run nor
copied. Joining and leaving the batch is one row's copy (`KVCaches.copy_row`).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from litkv.inference.blocks import feed_blocks
from litkv.kvcache.caches import KVCaches
from litkv.kvcache.recurrent import RecurrentCache
from litkv.modeling.config import KVCacheConfig
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT
from litkv.modeling.runner import ChunkPlan, run_chunks
from litkv.states.block_store import BlockStore
from litkv.states.state import CacheState, LayerState, RecurrentLayerState

__all__ = ["RowBatch"]


class RowBatch:
    """The running batch's caches (`rows` rows) and the scratch caches of one row for prompt text.

    Args:
        model: the GPT (the batch's caches are attached to it between calls).
        kv_cache: the cache config of every layer.
        rows: rows of the batch (`--max_batch`): every decode step runs them all.
    """

    def __init__(self, model: GPT, kv_cache: KVCacheConfig, rows: int) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        self.model = model
        self.kv_cache = kv_cache
        self.rows = rows
        self.device = model.lm_head.weight.device
        self.batch = self._caches(rows)
        self.scratch = self._caches(1)
        self.blank = self._caches(1)  # never run: what an empty row holds
        self.fingerprint = model_fingerprint(model)
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

    # -- rows in and out ------------------------------------------------------------------------

    @torch.inference_mode()
    def clear(self, row: int) -> None:
        """Empty `row` (a conversation that starts from nothing)."""
        self.batch.copy_row(row, self.blank, 0)

    @torch.inference_mode()
    def load(self, row: int, state: CacheState) -> None:
        """Set `row` to `state` (one row, taken by `take` from caches of this config; a hybrid model's
        recurrent layers too)."""
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
        self.batch.copy_row(row, self.scratch, 0)

    @torch.inference_mode()
    def take(self, row: int) -> CacheState:
        """A host copy of `row` as a state of one row (the other rows are not copied)."""
        layers: list[LayerState | RecurrentLayerState] = []
        for cache in self.batch.layers:
            if isinstance(cache, RecurrentCache):  # a hybrid model's recurrent layer: its row of the state
                tensors = {name: t[row : row + 1].to("cpu", copy=True) for name, t in cache.state_tensors().items()}
                shape = dataclasses.replace(cache.shape, batch_size=1)
                layers.append(RecurrentLayerState(shape, tensors, cache.kind))
                continue
            tensors = {name: t[row : row + 1].to("cpu", copy=True) for name, t in cache.state_tensors().items()}
            shape = dataclasses.replace(cache.shape, batch_size=1)
            layers.append(LayerState(cache.config, shape, tensors, cache.cache_length, cache.cache_length))
        last = self.batch.last_pos
        last_pos = None if last is None else last[row : row + 1].to("cpu", copy=True)
        return CacheState(layers, last_pos, self.fingerprint, self.batch[0].dtype)

    def next_pos(self, row: int) -> int:
        """The position `row`'s next token takes (0 for an empty row)."""
        last = self.batch.last_pos
        return 0 if last is None else int(last[row]) + 1

    # -- calls ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, row: int, ids: list[int], plan: ChunkPlan) -> torch.Tensor:
        """Feed prompt `ids` to `row` at batch one (the scratch caches); final hidden state `(1, n_embd)`
        of the last token."""
        start = self.next_pos(row)
        self.scratch.copy_row(0, self.batch, row)
        self.model.set_kv_caches(self.scratch)
        try:
            idx = torch.tensor([ids], dtype=torch.long, device=self.device)
            pos = torch.arange(start, start + len(ids), device=self.device)[None]
            hidden = run_chunks(self.model, idx, pos, plan, lm_head=False, last_only=True)
        finally:
            self.model.set_kv_caches(self.batch)
        self.batch.copy_row(row, self.scratch, 0)
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
        start = self.next_pos(row)
        self.scratch.copy_row(0, self.batch, row)
        self.model.set_kv_caches(self.scratch)
        try:
            ids = [torch.tensor(b, dtype=torch.long) for b in blocks]
            after = None if text is None else torch.tensor(text, dtype=torch.long)
            plan = ChunkPlan.of(self.kv_cache)
            hidden = feed_blocks(self.model, ids, after, start, plan, store, recompute)
        finally:
            self.model.set_kv_caches(self.batch)
        self.batch.copy_row(row, self.scratch, 0)
        return hidden

    @torch.inference_mode()
    def step(self, tokens: list[int | None], positions: list[int]) -> torch.Tensor:
        """One decode step of every row: `tokens[r]` at `positions[r]`, `None` for an idle row (padding).
        Returns the logits `(rows, V)` (an idle row's are meaningless)."""
        if len(tokens) != self.rows or len(positions) != self.rows:
            raise ValueError(f"a step takes {self.rows} tokens and positions, got {len(tokens)}, {len(positions)}")
        idx = torch.tensor([[0 if t is None else t] for t in tokens], dtype=torch.long, device=self.device)
        pos = torch.tensor([[-1 if t is None else p] for t, p in zip(tokens, positions, strict=True)])
        pos = pos.to(self.device)
        with self.model.trusted_inputs(max(positions) + 1):
            hidden = self.model(idx, pos, lm_head=False)
        return self.model.logits(hidden[:, -1])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `(1, V)` of a prefill's last hidden state `(1, n_embd)`."""
        return self.model.logits(hidden)
