"""`litkv.hf.Cache`: litkv's layer caches as a transformers `Cache`, passed as `model.generate(...,
past_key_values=cache)` or to a plain forward loop.

Each attention layer gets the `SlotMachine` litkv's GPT would build from the same `KVCacheConfig` (`cache_length`
slots per row and KV head, the policy, the storage). The layers' `update` only hand the new keys and values on;
the registered attention function (`litkv.hf.attention`) gives the call to `Cache.attend`, which does what
litkv's `CausalSelfAttention` does: `attend_inputs`, attention by layout (with the weight sums or queries the
policy asks for), `evict_and_store`. A call longer than the config's chunks is cut as litkv's chunk runner cuts
it (`litkv.modeling.runner.schedule`: each row from its own first token, left pads never attended or stored),
inside each layer, which is the same computation as litkv's chunk-by-chunk run (a layer's cache depends on
that layer's inputs only). The sequence length transformers reads is the number of columns seen, not the slots,
so positions stay right after eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache as HFCache
from transformers.cache_utils import CacheLayerMixin

from litkv.gates.gate import EvictionGates
from litkv.hf.attention import ATTN_IMPLEMENTATION, note_mask_sizes, note_update, register, watch_hidden
from litkv.hf.compat import check_model_type
from litkv.hf.state import check_configs, restore_caches, snapshot_caches
from litkv.kvcache.caches import KVCaches
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.kvzip import KVzipKVCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.storage import CacheShape
from litkv.modeling.attention import attend
from litkv.modeling.runner import Schedule, schedule
from litkv.modeling.self_attention import call_layout
from litkv.states.state import CacheState

__all__ = ["Cache", "CacheLayer"]


def _refuse(what: str) -> Callable[..., None]:
    def refuse(self: object, *args: object, **kwargs: object) -> None:
        raise ValueError(f"litkv.hf.Cache does not support {what}")

    return refuse


class CacheLayer(CacheLayerMixin):
    """One layer's place in transformers' `Cache`: hands `update`'s keys and values to the attention function and
    answers transformers' questions (sequence length: columns seen; mask sizes); the slots are `kv_cache`'s."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: Cache, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index

    @property
    def kv_cache(self) -> SlotMachine | None:
        """litkv's cache of this layer (`None` before the first call)."""
        caches = self.owner.caches
        return None if caches is None else caches[self.index]  # type: ignore[return-value]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.build(key_states, value_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`key_states`/`value_states` `(B, G, T, hs)` handed on as they are: the attention function attends them
        through litkv's cache. The rest is not read (`cache_kwargs` up to transformers 5.23, `kwargs=` from 5.24)."""
        if self.owner.caches is None:
            self.owner.build(key_states, value_states)
        self.is_initialized = True
        note_update(self.owner, self.index, key_states)
        return key_states, value_states

    def get_mask_sizes(self, query: torch.Tensor | int, *args: object) -> tuple[int, int]:
        """`(columns seen + T, 0)`; `query`: the call's `cache_position` (transformers <5.4) or its length."""
        note_mask_sizes()
        return self.owner.seen + (query if isinstance(query, int) else int(query.shape[0])), 0

    def get_seq_length(self) -> int:
        return self.owner.seen

    def get_max_length(self) -> int:
        """No maximum: tokens seen are not bounded by the slots (transformers >=5.4 asks this)."""
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.owner.reset()

    def offload(self) -> None:
        """Nothing: the slots stay where they are."""

    def prefetch(self) -> None:
        """Nothing: the slots stay where they are."""

    reorder_cache = _refuse("beam search (num_beams > 1): each row's slots hold that row's own tokens")
    crop = _refuse("crop (assisted decoding): evicted tokens cannot come back; use litkv's undo log with its GPT")
    batch_repeat_interleave = _refuse("repeating rows of a cache (num_beams / num_return_sequences > 1)")
    batch_select_indices = _refuse("selecting rows of a cache")


class Cache(HFCache):
    """litkv's KV cache policies in a transformers model: `cache = litkv.hf.Cache(model, KVCacheConfig(policy="h2o",
    cache_length=256))`, then `model.generate(ids, past_key_values=cache, ...)` or `model(ids, past_key_values=cache)`.

    Building it sets the model's attention implementation to litkv's (`"litkv"`: a model so set attends with
    transformers' SDPA when given any other cache). One `Cache` serves one run (batch rows fixed at the first
    call); `reset()` empties it.

    Args:
        model: a transformers causal LM of a supported family (`litkv.hf.compat.FAMILIES`).
        kv_cache: one `KVCacheConfig` for every layer, or one per layer (they must chunk alike).
        gates: for `learned`: the litkv checkpoint directory its eviction gates were fitted in (a path, or a
            known model's name), refused unless `model`'s weights are the ones they were fitted for
            (`litkv.hf.gates.hf_gates`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCacheConfig | Sequence[KVCacheConfig],
        gates: str | Path | None = None,
    ) -> None:
        config = getattr(model, "config", None)
        if config is None:
            raise TypeError(f"model must be a transformers model, got {type(model).__name__}")
        text = config.get_text_config()
        check_model_type(getattr(config, "model_type", None))
        n_layer = int(text.num_hidden_layers)
        configs = [kv_cache] * n_layer if isinstance(kv_cache, KVCacheConfig) else list(kv_cache)
        check_configs(configs, n_layer, gates is not None)
        self.gates: EvictionGates | None = None
        if gates is not None:
            from litkv.hf.gates import hf_gates

            self.gates = hf_gates(model, gates)
        super().__init__(layers=[CacheLayer(self, i) for i in range(n_layer)])
        self.configs = configs
        self.plan = ChunkPlan.of(configs)
        self.caches: KVCaches | None = None
        self.seen = 0
        self._model = model
        self._prompt_open = False  # a prompt went in since the last end_prefill (one-shot policies compress then)
        # the call's positions `(B, T)`, its chunks (`None`: one call), whether its evictions wait for the last layer
        self._call: tuple[torch.Tensor, Schedule | None, bool] | None = None
        self._replay: torch.Tensor | None = None  # `whole_calls`: the caches' `last_pos` every call starts from
        register()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if any("hidden" in cfg.policy_class.needs for cfg in configs):
            watch_hidden(model)  # the attention inputs reach `attend` (`learned` with gates of the hidden state)

    # -- building -------------------------------------------------------------------------------

    def build(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """litkv's layer caches for the batch of the first call (`key_states` `(B, G, T, hs)`)."""
        b, g, _, hs = key_states.shape
        device, dtype = key_states.device, key_states.dtype
        layers: list[SlotMachine] = []
        for i, cfg in enumerate(self.configs):
            shape = CacheShape(b, g, cfg.cache_length, hs, value_states.shape[-1])
            cache = cfg.make_cache(shape, device, dtype)
            if cache.needs_rope:
                from litkv.hf.rope import rope_table

                table, n_elem = rope_table(self._model, i, device)
                cache.policy.bind_rope(table, n_elem)
            if cache.needs_gates:  # `learned`: the gates checked against the model's weights (`__init__`)
                cache.policy.bind_gates(self.gates, i)
            layers.append(cache)
        self.caches = KVCaches(layers)
        for layer in self.layers:
            layer.is_initialized = True

    def reset(self) -> None:
        """Forget everything: the next call builds fresh caches."""
        self.caches = None
        self.seen = 0
        self._prompt_open = False
        self._call = None
        for layer in self.layers:
            layer.is_initialized = False

    # -- transformers' questions ----------------------------------------------------------------

    def get_mask_sizes(self, query: torch.Tensor | int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns seen (tokens, with the left pads of a batch): positions continue from here after eviction."""
        return self.seen

    reorder_cache = CacheLayer.reorder_cache
    crop = CacheLayer.crop
    batch_repeat_interleave = CacheLayer.batch_repeat_interleave
    batch_select_indices = CacheLayer.batch_select_indices

    # -- litkv's side ---------------------------------------------------------------------------

    @property
    def kv_caches(self) -> list[SlotMachine]:
        """litkv's layer caches (empty before the first call)."""
        return [] if self.caches is None else self.caches.policy_caches

    def nbytes(self) -> int:
        """Bytes held by the layers' slots (keys, values, positions, the policy's state; quantised: codes, scales)."""
        return 0 if self.caches is None else self.caches.nbytes()

    def end_prefill(self) -> None:
        """The prompt is in: one-shot policies compress it to their budget. `generate` gets this before its first
        decode step without being asked; a plain forward loop calls it between prompt and decoding. A `kvzip`
        cache compresses with its reconstruction pass only (`litkv.hf.kvzip_compress`, before this)."""
        if self.caches is not None:
            layers = self.caches.policy_caches
            if any(isinstance(c.policy, KVzipKVCache) and c.policy.before_compression() for c in layers):
                raise ValueError(
                    "kvzip compresses the prompt by its reconstruction pass: call litkv.hf.kvzip_compress(model, "
                    "cache, input_ids, attention_mask, repeat) after the prefill, before decoding"
                )
            self.caches.end_prefill()
        self._prompt_open = False

    @contextmanager
    def whole_calls(self) -> Iterator[None]:
        """While open, every call reaches the layers' caches as one call (never cut into chunks) and leaves the
        caches' positions (`last_pos`) and the columns seen as they were: KVzip's reconstruction calls, which
        attend the cache and store nothing (`litkv.hf.kvzip_compress`)."""
        caches = self.caches
        if caches is None or caches.last_pos is None:
            raise ValueError("litkv.hf.Cache.whole_calls: run a prompt through the cache first")
        saved, seen, prompt_open = caches.last_pos.clone(), self.seen, self._prompt_open
        self._replay = saved
        try:
            yield
        finally:
            self._replay = None
            self._call = None
            caches.last_pos = saved
            self.seen, self._prompt_open = seen, prompt_open

    def snapshot(self, device: torch.device | str | None = None) -> CacheState:
        """The caches' state as a `litkv.CacheState` (a copy: restore it for each question, save it to a file)."""
        if self.caches is None:
            raise ValueError("litkv.hf.Cache has nothing to snapshot: run a prompt through it first")
        return snapshot_caches(self.caches, self._model, device, self.gates)

    def restore(self, state: CacheState) -> None:
        """Set the caches to `state` (bitwise; taken from this model with these configs). The columns seen become
        the longest row's tokens: pass that row's ids before the new ones (transformers' cached-generation rule)."""
        if self.caches is None:
            layers = state.layers[0]
            shape = layers.shape  # type: ignore[union-attr]
            keys = torch.empty(shape.batch_size, shape.n_query_groups, 0, shape.key_size, dtype=state.dtype,
                               device=self._model.device)  # fmt: skip
            values = keys.new_empty(*keys.shape[:3], shape.value_size)
            self.build(keys, values)
        restore_caches(self.caches, self._model, state, self.gates)  # type: ignore[arg-type]
        last = self.caches.last_pos  # type: ignore[union-attr]
        self.seen = 0 if last is None else int(last.max()) + 1
        self._prompt_open = False

    # -- a call ---------------------------------------------------------------------------------

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pad_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        scale: float,
        window: int | None,
        softcap: float | None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer's call through its litkv cache: queries `q` `(B, H, T, hs)` after RoPE, keys and
        values `(B, G, T, hs)`, `pad_mask` `(B, columns)` (`False` at pads) or `None`, transformers' `position_ids`
        `(B or 1, T)`, `hidden` `(B, T, C)` the layer's attention input (`None`: not watched) -> `(B, T, H * hv)`.
        Layer 0 starts the call (positions, chunks, one-shot compression)."""
        if layer == 0 or self._call is None:
            self._begin_call(q.shape[2], pad_mask, position_ids, q.device)
        caches = self.caches
        cache = caches[layer]  # type: ignore[index]
        input_pos, plan, later = self._call  # type: ignore[misc]
        if plan is None:
            y = _attend_one(cache, q, k, v, hidden, input_pos, scale, window, softcap, later)  # type: ignore[arg-type]
            if later and layer == len(caches) - 1:  # type: ignore[arg-type]
                caches.evict_waiting()  # type: ignore[union-attr]  # a decode step: every layer at once, as litkv's GPT
            return y
        outputs = []
        for call in plan.calls:
            src = call.idx
            q_, k_, v_ = (_gather(t, src) for t in (q, k, v))
            x = None if hidden is None else _gather(hidden[:, None], src)[:, 0]
            outputs.append(_attend_one(cache, q_, k_, v_, x, call.input_pos, scale, window, softcap, False))  # type: ignore[arg-type]
        return plan.gather(outputs)

    def _begin_call(
        self, t: int, pad_mask: torch.Tensor | None, position_ids: torch.Tensor | None, device: torch.device
    ) -> None:
        caches = self.caches
        if caches is None:
            raise RuntimeError("litkv.hf.Cache: a call reached attention before update built the caches")
        b = caches.batch_size
        valid = torch.ones(b, t, dtype=torch.bool, device=device) if pad_mask is None else pad_mask[:, -t:].bool()
        if valid.shape[0] != b:
            raise ValueError(f"litkv.hf.Cache was built for {b} rows, the call has {valid.shape[0]}")
        if position_ids is None:
            start = torch.zeros(b, dtype=torch.long, device=device) if caches.last_pos is None else caches.last_pos + 1
            position_ids = start[:, None] + valid.long().cumsum(dim=1) - 1
        input_pos = torch.where(valid, position_ids.to(device).long().expand(b, t), -1)
        if self._replay is not None:  # `whole_calls`
            caches.last_pos = self._replay.clone()
            later = caches.begin_call(t)
            caches.observe(input_pos, check=True)
            self._call = (input_pos, None, later)
            return
        if t == 1 and self._prompt_open and self.seen > 0:
            self.end_prefill()
        later = caches.begin_call(t)
        caches.observe(input_pos, check=t > 1)  # a one-token call: transformers' next position, no host read
        self.seen += t
        self._prompt_open = self._prompt_open or t > 1 or self.seen == 1
        if t == 1 or (t <= self.plan.first and bool(valid.all())):
            self._call = (input_pos, None, later)
            return
        columns = torch.arange(t, device=device).expand(b, t)
        self._call = (input_pos, schedule(columns, input_pos, self.plan), False)


def _gather(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """`x` `(B, H, T, D)` at `columns` `(B, W)` -> `(B, H, W, D)`."""
    b, h, _, d = x.shape
    index = columns[:, None, :, None].expand(b, h, columns.shape[1], d)
    return x.gather(2, index)


def _attend_one(
    cache: SlotMachine,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    hidden: torch.Tensor | None,
    input_pos: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    later: bool,
) -> torch.Tensor:
    """One call through `cache`, as `CausalSelfAttention.attend_cached`: attend, then evict (`later`: the eviction
    waits for `KVCaches.evict_waiting` after the last layer) -> `(B, T, H * hv)`. `hidden` `(B, T, C)` or `None`
    is handed on (by keyword) only to a cache that reads it."""
    no_pads = input_pos.shape[1] > 1 and bool((input_pos >= 0).all())
    if cache.needs_hidden:
        keys, values, k_pos = cache.attend_inputs(k, v, input_pos, q, hidden=hidden)
    else:
        keys, values, k_pos = cache.attend_inputs(k, v, input_pos, q)
    mask = call_layout(cache, keys, k_pos, input_pos, no_pads, window)
    y, weights = attend(q, keys, values, mask, scale, softcap, cache.needs_attn_weights, input_pos >= 0)
    if later:
        cache.wait_for_eviction(weights)
    else:
        cache.evict_and_store(weights)
    return y
