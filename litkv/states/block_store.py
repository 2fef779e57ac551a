"""The KV of a block (a document, a system prompt) computed once, alone, and kept by its token ids.

A block is a token sequence whose keys and values are computed **alone**, at positions `0..n-1`, in
a lossless float cache of the run's dtype, with the run's chunking (`ChunkPlan`: the first chunk,
then `size`). `litkv.inference.blocks` splices them into a later prompt at any offset.

**Keys: token ids and the weights, never text.** The block is cut as the prefill cuts it (the plan's
bounds); piece `k` (tokens `[s_k, e_k)`) is stored under `key_k = sha256(key_{k-1} || ids of piece
k)`, seeded with the model's fingerprint (config and every weight), the dtype and the plan. Since a
token's keys and values depend only on the tokens before it, the chain is a token-level trie with
edges of one chunk: blocks that share their first pieces share those entries (their storage and
their computation), and a different token sequence never reaches another sequence's entry, whatever
text the two decode to. Another tokenizer gives other ids (another key); the same ids under the same
weights are the same keys and values, so the tokenizer needs no place in the key.

**Entries prove their keys.** The store is `litkv.states.state_store.StateStore` (memory LRU and optional
directory, bounded by bytes): a piece is a `CacheState` of one dense cache per layer holding exactly
its tokens (positions `s..e-1`, `last_hidden` of its last token); its file proves its key and the
number of tokens it covers, carries its token ids and an HMAC under the store's key (a file nobody
holding the key wrote is refused), and it is restored only if its fingerprint, dtype and shapes are the
caller's (`EntryCheck`). A corrupt, truncated or foreign file is a miss with one logged line, removed,
and the piece is computed again; two processes writing one entry write the same bytes atomically.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.storage import CacheShape
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT
from litkv.states.state import CacheState, LayerState
from litkv.states.state_store import EntryCheck, StateStore

__all__ = ["BlockKV", "BlockStore"]


@dataclass
class BlockKV:
    """The keys and values of a block computed alone at positions `0..n-1`.

    Attributes:
        ids: `(n,)` int64 token ids (on the CPU).
        keys: per layer `(1, G, n, hs)`, after RoPE at positions `0..n-1` (as the caches hold keys).
        values: per layer `(1, G, n, hs)`.
        last_hidden: `(1, n_embd)` final hidden state of the last token (the block alone).
        inputs: per layer `(1, n, n_embd)` the layer's attention input of each token (the block alone), kept
            only for a model whose eviction gates read the hidden state (`keeps_inputs`); else `None`.
    """

    ids: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    last_hidden: torch.Tensor
    inputs: list[torch.Tensor] | None = None

    @property
    def length(self) -> int:
        return int(self.ids.numel())

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.keys, *self.values, *(self.inputs or ())))


class BlockStore:
    """Blocks' keys and values by token ids and weights, in pieces of one chunk (a token-level trie).

    Args:
        max_bytes: most bytes of pieces kept in memory (0: none; blocks are then computed at every use).
        directory: where pieces are also written, to be found again by later runs (created if needed).
        disk_bytes: most bytes of files in `directory` (default: `max_bytes`).
        key: the secret that authenticates the directory's files (default: the user's secret,
            `litkv.core.secret.user_secret`); a file the store's key did not sign is never restored.

    Attributes:
        hits, misses: pieces found / computed.
        reused_tokens: block tokens restored instead of computed.
    """

    def __init__(
        self,
        max_bytes: int,
        directory: str | Path | None = None,
        disk_bytes: int | None = None,
        key: bytes | None = None,
    ) -> None:
        self._store = StateStore(max_bytes, directory, disk_bytes=disk_bytes, name="block store", key=key)
        self.directory = self._store.directory
        self.hits = self.misses = self.reused_tokens = 0

    def nbytes(self) -> int:
        """Bytes of the pieces held in memory."""
        return self._store.nbytes

    def disk_bytes(self) -> int:
        """Bytes of the files in `directory` (0 without one)."""
        return self._store.disk_bytes()

    def clear(self) -> None:
        """Forget the pieces held in memory (files stay)."""
        self._store.clear()

    @staticmethod
    def seed(model: GPT, dtype: torch.dtype, plan: ChunkPlan) -> str:
        """Root of the key chains: the model's fingerprint, the dtype and the chunking."""
        seed = {"model": model_fingerprint(model), "dtype": str(dtype), "plan": [plan.first, plan.size]}
        return hashlib.sha256(json.dumps(seed, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def piece_keys(seed: str, ids: torch.Tensor, bounds: list[tuple[int, int]]) -> list[str]:
        """`key_k` of each piece `(s, e)` of `ids` `(n,)`: the hash chain over the pieces' ids."""
        keys, key = [], seed
        host = ids.detach().to("cpu", torch.int64)
        for s, e in bounds:
            key = hashlib.sha256(key.encode() + b"block" + host[s:e].numpy().tobytes()).hexdigest()
            keys.append(key)
        return keys

    @torch.inference_mode()
    def get(self, model: GPT, ids: torch.Tensor, plan: ChunkPlan, dtype: torch.dtype | None = None) -> BlockKV:
        """The block's keys and values: its stored pieces restored, the rest computed (and stored).

        Args:
            model: the GPT (its caches, if any, are left as they are).
            ids: `(n,)` token ids of the block, `n >= 1`.
            plan: the run's chunking (the block is computed with the same calls as a prefill from 0).
            dtype: the caches' dtype (default: the model's).
        """
        ids = _check_ids(ids, model.config.padded_vocab_size)
        dtype = model.lm_head.weight.dtype if dtype is None else dtype
        bounds = plan.bounds(ids.numel())
        keys = self.piece_keys(self.seed(model, dtype, plan), ids, bounds)
        pieces: list[CacheState] = []
        for key, (s, e) in zip(keys, bounds, strict=True):
            state = self._store.get(key, EntryCheck.of(model, _piece_config(e - s), dtype), tokens=e, token_ids=ids[:e])
            if state is None or state.last_hidden is None or _positions(state) != list(range(s, e)):
                break
            if keeps_inputs(model) and _INPUTS not in state.layers[0].tensors:
                break
            pieces.append(state)
        self.hits += len(pieces)
        self.misses += len(bounds) - len(pieces)
        self.reused_tokens += bounds[len(pieces) - 1][1] if pieces else 0
        if len(pieces) < len(bounds):
            pieces = self._compute(model, ids, bounds, keys, pieces, dtype)
        device = model.lm_head.weight.device
        n_layer = model.config.n_layer
        k = [_joined(pieces, i, "storage.keys").to(device) for i in range(n_layer)]
        v = [_joined(pieces, i, "storage.values").to(device) for i in range(n_layer)]
        inputs = None
        if keeps_inputs(model):
            inputs = [
                torch.cat([p.layers[i].tensors[_INPUTS] for p in pieces], dim=1).to(device) for i in range(n_layer)
            ]
        return BlockKV(ids.cpu(), k, v, pieces[-1].last_hidden.to(device), inputs)  # type: ignore[union-attr]

    def _compute(
        self,
        model: GPT,
        ids: torch.Tensor,
        bounds: list[tuple[int, int]],
        keys: list[str],
        found: list[CacheState],
        dtype: torch.dtype,
    ) -> list[CacheState]:
        """Compute the pieces after `found` (restored into a dense cache of the block's length) and store them."""
        n, device = ids.numel(), model.lm_head.weight.device
        config = KVCacheConfig(policy="dense", cache_length=n)
        previous = model.caches
        caches = model.build_kv_caches(config, 1, dtype=dtype)
        start = bounds[len(found) - 1][1] if found else 0
        for i, cache in enumerate(caches):
            if found:
                parts = {name: _joined(found, i, name).to(device) for name in _PIECE_TENSORS}
                full = LayerState(config, cache.shape, parts, start, start).full_tensors()
                cache.load_state_tensors(full, start)
        inputs: list[torch.Tensor] = []  # each layer's attention input of the piece being computed
        hooks = [block.attn.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach().clone()))
                 for block in model.transformer.h] if keeps_inputs(model) else []  # fmt: skip
        try:
            model.set_kv_caches(caches)
            if found:
                model.last_pos = torch.tensor([start - 1], device=device)
            pieces = list(found)
            ids = ids.to(device)
            for key, (s, e) in zip(keys[len(found) :], bounds[len(found) :], strict=True):
                inputs.clear()
                hidden = model(ids[None, s:e], torch.arange(s, e, device=device)[None], lm_head=False)[:, -1]
                piece = _piece_state(model, s, e, hidden, inputs if hooks else None)
                self._store.put(key, piece, tokens=e, token_ids=ids[:e])
                pieces.append(piece)
        finally:
            for hook in hooks:
                hook.remove()
            model.set_kv_caches(previous)
        return pieces


_PIECE_TENSORS = ("positions", "storage.keys", "storage.values")
# a piece layer's attention inputs `(1, T, n_embd)`: a per-row tensor of the piece's state (a state file's names
# are positions, storage.*, slot.* and row.*), never loaded into a cache (a piece restores `_PIECE_TENSORS`)
_INPUTS = "row.block_inputs"


def keeps_inputs(model: GPT) -> bool:
    """Whether blocks of `model` keep each layer's attention inputs: its eviction gates read the hidden state
    (`learned` scores spliced tokens from them; the store's key covers the gates through the fingerprint)."""
    gates = getattr(model, "eviction_gates", None)
    return gates is not None and gates.input == "hidden"


def _joined(pieces: list[CacheState], layer: int, name: str) -> torch.Tensor:
    """Tensor `name` of `layer` of consecutive pieces, joined along the slots (dim 2)."""
    return torch.cat([p.layers[layer].tensors[name] for p in pieces], dim=2)


def _piece_config(length: int) -> KVCacheConfig:
    """The cache config a piece of `length` tokens is stored with (one dense cache per layer)."""
    return KVCacheConfig(policy="dense", cache_length=length)


def _piece_state(
    model: GPT, s: int, e: int, hidden: torch.Tensor, inputs: list[torch.Tensor] | None = None
) -> CacheState:
    """The piece `[s, e)` of the attached dense caches as a `CacheState` (a copy), with `hidden` `(1, n_embd)`
    and, when given, each layer's attention inputs `(1, e - s, n_embd)` (`_INPUTS`)."""
    config, layers = _piece_config(e - s), []
    for i, cache in enumerate(model.kv_caches):
        tensors = {
            name: t[:, :, s:e].detach().clone()
            for name, t in cache.state_tensors().items()  # type: ignore[union-attr]
            if name in _PIECE_TENSORS
        }
        if inputs is not None:
            tensors[_INPUTS] = inputs[i]
        shape = CacheShape(1, cache.shape.n_query_groups, e - s, cache.shape.key_size, cache.shape.value_size)  # type: ignore[union-attr]
        layers.append(LayerState(config, shape, tensors, e - s, e - s))
    last_pos = torch.tensor([e - 1], device=hidden.device)
    return CacheState(layers, last_pos, model_fingerprint(model), model.kv_caches[0].dtype, None, hidden.clone())  # type: ignore[union-attr]


def _positions(state: CacheState) -> list[int]:
    """The positions of a piece's first layer, first head (a piece holds consecutive positions)."""
    return state.layers[0].tensors["positions"][0, 0].tolist()


def _check_ids(ids: object, vocab: int) -> torch.Tensor:
    """`ids` as a 1-D int64 tensor; TypeError/ValueError naming what was given."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        what = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"a block's token ids must be an integer tensor, got {what}")
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"a block must be a non-empty 1-D tensor of token ids, got shape {tuple(ids.shape)}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"a block's token id {low if low < 0 else high} is outside the vocabulary [0, {vocab})")
    return ids.long()
