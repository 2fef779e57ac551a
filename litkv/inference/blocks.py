"""KV blocks: a prompt as segments, some of them blocks whose caches are computed once and spliced.

A prompt is a list of `Segment`s: token ids, some marked `block=True`. A block's keys and values are
computed alone at positions `0..n-1` (`litkv.states.block_store.BlockStore`, by token ids and weights) and
**spliced** at its offset `p` in the prompt:

- **keys** are rotated by the position delta `p` (RoPE is a rotation per pair of dims by angle
  `pos * theta_i`, so rotating a key computed at `j` by `p` gives the key at `j + p`, up to float
  rounding: `rotate_keys`); **values** are kept as they are;
- they enter each layer's cache through the cache's own `attend_inputs` / `evict_and_store` (so every
  policy and storage format takes them: positions, eviction, quantisation are the cache's own), in
  calls of the run's chunk size, at positions `p..p+n-1`;
- **the policy's state for spliced tokens** is that of a call whose queries are zero: a spliced token's
  queries are never computed, so what a policy derives from them is uniform attention over what each
  spliced token may attend (its block's tokens and everything before, causally by position):
  `needs_attn_weights` policies (h2o, tova) receive those uniform weight sums, `needs_queries` policies
  (snapkv, expected-attention, tova) zero queries. Recomputed tokens (below) are ordinary model calls
  and bring real weights and queries.

Text segments (between and after blocks) are prefilled normally, attending to everything before.

**Exact where it can be.** A block at position 0 needs no rotation: its keys and values are those of a
normal prefill of it (same calls, same chunking), so a prompt starting with a block gives bitwise the
tokens of a normal prefill of the same segments (float storage, output from SDPA: on the CPU a policy that
asks for attention weights takes its output from the weights pass, rounded otherwise). Elsewhere
the splice is an approximation: a spliced block never attended to what precedes it.

**Selective recomputation** (CacheBlend): `recompute=r` recomputes `ceil(r * n)` tokens of each block
spliced at `p > 0`, those whose layer-1 keys and values change most when the block sees its context.
Layer 1 is the first layer whose keys and values depend on the context (layer 0's depend on the token and
its position only), so the proxy costs one layer of attention over the block (a `1 / n_layer` of
recomputing it): layer 0 is run on the block with the context in its cache, layer 1's keys and values
computed from its output and compared with the spliced ones (relative L2 per token, summed over KV
heads). The chosen tokens are left out of the splice; those of a run of consecutive blocks run through
the model together with the text segment after the run, as one sequence of ordinary calls of the chunk
size at their positions (`feed_blocks`): they attend to the context, the spliced tokens before them and
the other chosen tokens before them. `r = 0` is the pure splice; `r = 1` recomputes every token, which is the
normal prefill of the block as a text segment.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from litkv.core.rope import apply_rope
from litkv.core.tokens import encode_plain, encode_text
from litkv.inference.chat_template import Format, TemplateFormat
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.machine import SlotMachine
from litkv.modeling.attention import build_mask
from litkv.modeling.model import GPT, check_integer_tensor
from litkv.states.block_store import BlockKV, BlockStore

__all__ = [
    "Segment",
    "encode_document",
    "check_recompute",
    "feed_blocks",
    "kv_deviation",
    "prefill_segments",
    "prompt_segments",
    "rope_delta",
    "rotate_keys",
    "select_recompute",
    "splice",
]


@dataclass(frozen=True)
class Segment:
    """A part of a prompt: `(n,)` token ids; `block=True`: its KV is computed alone once and spliced."""

    ids: torch.Tensor
    block: bool = False

    def __post_init__(self) -> None:
        check_integer_tensor("Segment.ids", self.ids)
        if self.ids.dim() != 1 or self.ids.numel() == 0:
            shape = tuple(self.ids.shape)
            raise ValueError(f"a segment must be a non-empty 1-D tensor of token ids, got shape {shape}")
        if not isinstance(self.block, bool):
            raise TypeError(f"Segment.block must be a bool, got {type(self.block).__name__}")


def encode_document(tokenizer: Any, text: str, name: str = "block") -> tuple[int, ...]:
    """A block's (document's) ids: `text` tokenized alone, no BOS/EOS or other special tokens added, so
    they are the same at every use wherever it stands; a control string in it (``<|im_end|>``) is text
    (`encode_text`); ValueError naming `name` when it has none."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a string, got {type(text).__name__}")
    ids = encode_text(tokenizer, text)
    if not ids:
        raise ValueError(f"{name} encodes to no tokens: give a non-empty {name.split()[0]}")
    return tuple(int(t) for t in ids)


def prompt_segments(fmt: Format, tokenizer: Any, blocks: Sequence[str], prompt: str) -> list[Segment]:
    """A user message made of `blocks` (texts) then `prompt`, as segments: each block tokenized alone
    (no BOS/EOS, no special tokens added), so its ids are the same at every use, wherever it stands.

    Raw text (`RawFormat`): BOS (when the tokenizer adds one), the blocks, the prompt. A chat template: the
    template's text before the user's content, the blocks, then the prompt with the template's text after
    it (the generation prompt included). Empty blocks are refused (ValueError naming the block).
    """
    ids = [encode_document(tokenizer, text, f"block {i}") for i, text in enumerate(blocks)]
    before, after = "", ""
    if isinstance(fmt, TemplateFormat):
        marker = f"<<litkv-blocks-{uuid.uuid4().hex}>>"
        before, after = fmt.template.render([("user", marker)], add_generation_prompt=True).split(marker, 1)
    out = []
    bos = getattr(tokenizer, "bos_id", None)
    if not isinstance(fmt, TemplateFormat) and getattr(tokenizer, "use_bos", False) and bos is not None:
        out.append(Segment(torch.tensor([int(bos)])))
    if before:
        out.append(Segment(torch.tensor(encode_plain(tokenizer, before), dtype=torch.long)))
    out += [Segment(torch.tensor(block, dtype=torch.long), block=True) for block in ids]
    if isinstance(fmt, TemplateFormat) and any(s in prompt for s in fmt.special):  # the user's are text
        tail = encode_text(tokenizer, prompt) + encode_plain(tokenizer, after)
    else:
        tail = encode_plain(tokenizer, prompt + after)
    if tail:
        out.append(Segment(torch.tensor(tail, dtype=torch.long)))
    return out


# -- rotation ---------------------------------------------------------------------------------------


def rope_delta(model: GPT, delta: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `(1, 1, rope_n_elem)` of a rotation by `delta` positions for `layer`'s keys.

    Taken from the model's table at `delta`, divided by the table's value at 0 (a table that carries an
    attention factor, as YaRN's may, then still gives a pure rotation)."""
    cos, sin = model._rope_table(delta + 1)
    indices = model.config.rope_indices
    if indices is not None:
        cos, sin = cos[..., indices[layer]], sin[..., indices[layer]]
    n = model.config.rope_n_elem
    norm = cos[0, :n]
    return (cos[delta, :n] / norm)[None, None], (sin[delta, :n] / norm)[None, None]


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_elem: int) -> torch.Tensor:
    """Keys after RoPE `(B, G, T, hs)` rotated further by the angles of `cos`, `sin` `(1, 1 or T, n_elem)`.

    Cached keys are in the half-split layout whatever the model's (`apply_rope`'s output), so the
    rotation is the half-split one; dims past `n_elem` are not rotated."""
    rotated = apply_rope(keys[..., :n_elem], cos.expand(1, keys.shape[2], n_elem), sin.expand(1, keys.shape[2], n_elem))
    return torch.cat((rotated, keys[..., n_elem:]), dim=-1)


# -- splicing into the run's caches -----------------------------------------------------------------


def _uniform_weights(cache: SlotMachine, input_pos: torch.Tensor, k_pos: torch.Tensor, q_per_kv: int) -> torch.Tensor:
    """`(B, G, S)` float32 weight sums of zero queries at `input_pos` `(B, T)` over keys at `k_pos` `(B, G, S)`:
    each query spreads 1 uniformly over what it may attend, summed over the call and the group's query heads."""
    mask = build_mask(input_pos, k_pos).float()  # (B, G, T, S)
    per_query = mask / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    return per_query.sum(dim=2) * q_per_kv


def _splice_layer(
    cache: SlotMachine,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    n_head: int,
    inputs: torch.Tensor | None,
) -> None:
    """One call of spliced tokens into a layer cache: keys/values `(1, G, T, hs)`, positions `(1, T)`, the
    tokens' attention inputs `(1, T, n_embd)` (the block alone) or `None`, handed to a cache that reads them."""
    queries = None
    if cache.needs_queries:
        queries = keys.new_zeros(keys.shape[0], n_head, keys.shape[2], keys.shape[3])
    if cache.needs_hidden:
        _, _, k_pos = cache.attend_inputs(keys, values, pos, queries, hidden=inputs)
    else:
        _, _, k_pos = cache.attend_inputs(keys, values, pos, queries)
    weights = None
    if cache.needs_attn_weights:
        weights = _uniform_weights(cache, pos, k_pos, n_head // keys.shape[1])
    cache.evict_and_store(weights)


def splice(model: GPT, block: BlockKV, offset: int, keep: torch.Tensor, chunk: int) -> None:
    """Write the block's tokens where `keep` `(n,)` bool is set into the attached caches at positions
    `offset + j`, keys rotated by `offset`, in calls of at most `chunk` tokens (each call through every
    layer, as a model call: an undo log records it as one call). `last_pos` is left as it was."""
    index = keep.nonzero().flatten().to(block.keys[0].device)
    if index.numel() == 0:
        return
    caches = model.caches
    if caches is None:
        raise ValueError("no KV caches are attached: call set_kv_caches() first")
    positions = (index + offset)[None]
    n_head, n_elem = model.config.n_head, model.config.rope_n_elem
    layers = []
    for layer in range(len(caches.policy_caches)):
        keys = block.keys[layer].index_select(2, index)
        if offset:
            cos, sin = rope_delta(model, offset, layer)
            keys = rotate_keys(keys, cos.to(keys.dtype), sin.to(keys.dtype), n_elem).to(keys.dtype)
        inputs = None if block.inputs is None else block.inputs[layer].index_select(1, index)
        layers.append((keys, block.values[layer].index_select(2, index), inputs))
    before = caches.last_pos
    try:
        for s in range(0, index.numel(), chunk):
            part = slice(s, s + chunk)
            if caches.undo_log is not None:
                caches.undo_log.before_call(caches)
            caches.last_pos = positions[:, part].amax(dim=1)  # what an undo log records after the call
            for cache, (keys, values, inputs) in zip(caches.policy_caches, layers, strict=True):
                x = None if inputs is None else inputs[:, part]
                _splice_layer(cache, keys[:, :, part], values[:, :, part], positions[:, part], n_head, x)
    finally:
        caches.last_pos = before


# -- selective recomputation ------------------------------------------------------------------------


class _ContextView:
    """A read-only `LayerCache` over a layer cache: its slots plus the call's tokens, nothing written."""

    needs_attn_weights = False
    needs_hidden = False
    heads_share_positions = False

    def __init__(self, cache: SlotMachine) -> None:
        self.cache = cache
        self.positions = cache.positions

    def attend_inputs(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        input_pos: torch.Tensor,
        queries: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = self.cache
        held = cache.num_filled if cache.storage.lossless else cache.cache_length  # lossless: a filled prefix
        old_keys, old_values = cache.storage.read_prefix(held)
        new_pos = input_pos[:, None, :].expand(*keys.shape[:3])
        return (
            torch.cat((old_keys.to(keys.dtype), keys), dim=2),
            torch.cat((old_values.to(values.dtype), values), dim=2),
            torch.cat((cache.positions[:, :, :held], new_pos), dim=2),
        )

    def evict_and_store(self, attn_weights: torch.Tensor | None) -> None:
        """Nothing is stored."""

    def nbytes(self) -> int:
        return 0


def _layer_cos_sin(model: GPT, pos: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = model.rope(pos)
    indices = model.config.rope_indices
    return (cos, sin) if indices is None else (cos[..., indices[layer]], sin[..., indices[layer]])


def kv_deviation(model: GPT, block: BlockKV, offset: int) -> torch.Tensor:
    """`(n,)` how much each block token's layer-1 keys and values change when the block sees its context.

    Layer 0 runs on the block with the attached layer-0 cache (the context) before it; layer 1's keys and
    values are computed from its output and compared with the block's spliced ones (relative L2 per
    token and KV head, summed over heads)."""
    caches = model.caches
    if caches is None or model.config.n_layer < 2:
        raise ValueError(f"selective recomputation needs attached caches and >= 2 layers, got {model.config.n_layer}")
    device = block.keys[0].device
    ids = block.ids.to(device)[None]
    pos = torch.arange(offset, offset + block.length, device=device)[None]
    first, second = model.transformer.h[0], model.transformer.h[1]
    x = model.transformer.wte(ids)
    if model.config.scale_embeddings:
        x = x * torch.tensor(model.config.n_embd**0.5, dtype=x.dtype)
    saved = first.attn.kv_cache
    first.attn.kv_cache = _ContextView(caches.policy_caches[0])  # type: ignore[assignment]
    try:
        x = first(x, *_layer_cos_sin(model, pos, 0), pos, False, False)
    finally:
        first.attn.kv_cache = saved
    _, k, v = second.attn._qkv(second.norm_1(x), *_layer_cos_sin(model, pos, 1))
    cos, sin = rope_delta(model, offset, 1)
    k_spliced = rotate_keys(block.keys[1], cos.to(k.dtype), sin.to(k.dtype), model.config.rope_n_elem)
    v_spliced = block.values[1]

    def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a - b).float().norm(dim=-1) / b.float().norm(dim=-1).clamp(min=1e-12)

    return (rel(k, k_spliced) + rel(v, v_spliced)).sum(dim=1)[0]


def select_recompute(model: GPT, block: BlockKV, offset: int, ratio: float, last: bool) -> torch.Tensor:
    """`(n,)` bool: the block's tokens to recompute (`ceil(ratio * n)` of the largest `kv_deviation`; none at
    offset 0, where the splice is exact; the last token too when `last`: the prompt's last hidden state)."""
    n = block.length
    chosen = torch.zeros(n, dtype=torch.bool, device=block.keys[0].device)
    count = 0 if offset == 0 else math.ceil(ratio * n - 1e-9)
    if count >= n:
        chosen[:] = True
    elif count > 0:
        deviation = kv_deviation(model, block, offset)
        chosen[deviation.topk(count).indices] = True
    if last and offset > 0:
        chosen[-1] = True
    return chosen


# -- a prompt of segments ---------------------------------------------------------------------------


def _run(model: GPT, ids: torch.Tensor, positions: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """Ordinary model calls over `ids`/`positions` `(n,)` cut at `bounds`; the last token's hidden `(1, n_embd)`."""
    hidden = None
    for s, e in bounds:
        hidden = model(ids[None, s:e], positions[None, s:e], lm_head=False)[:, -1]
    return hidden  # type: ignore[return-value]


def check_recompute(value: object, name: str = "recompute") -> float:
    """`value` as the fraction of each spliced document's tokens recomputed in context; ValueError naming
    `name` unless it is a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a fraction in [0, 1] (0: pure splice), got {value!r}")
    return float(value)


@torch.inference_mode()
def prefill_segments(
    model: GPT,
    segments: Sequence[Segment],
    kv_cache: KVCacheConfig | Sequence[KVCacheConfig],
    store: BlockStore | None = None,
    recompute: float = 0.0,
) -> tuple[torch.Tensor, int]:
    """Prefill one prompt given as segments into the attached caches (one row).

    Text segments run through the model (the first from position 0 with the plan's first chunk, later
    ones in chunks of `chunk_size`); each run of consecutive blocks is taken from `store` (computed alone
    if absent) and spliced, `recompute` of their tokens recomputed together with the text segment after
    the run (`feed_blocks`; module docstring).

    Returns:
        The last token's final hidden state `(1, n_embd)` and the prompt's length (the next position).
    """
    ratio = check_recompute(recompute)
    if not segments or not all(isinstance(s, Segment) for s in segments):
        raise TypeError("segments must be a non-empty list of litkv.inference.blocks.Segment")
    store = BlockStore(0) if store is None else store
    plan = ChunkPlan.of(kv_cache)
    device = model.lm_head.weight.device
    offset, hidden, i = 0, None, 0
    while i < len(segments):
        seg = segments[i]
        if not seg.block:
            ids, n = seg.ids.to(device=device, dtype=torch.long), seg.ids.numel()
            pos = torch.arange(offset, offset + n, device=device)
            bounds = plan.bounds(n) if offset == 0 else ChunkPlan(plan.size, plan.size).bounds(n)
            hidden = _run(model, ids, pos, bounds)
            offset, i = offset + n, i + 1
            continue
        end = next((j for j in range(i, len(segments)) if not segments[j].block), len(segments))
        text = segments[end].ids if end < len(segments) else None
        hidden = feed_blocks(model, [s.ids for s in segments[i:end]], text, offset, plan, store, ratio)
        offset += sum(int(s.ids.numel()) for s in segments[i : end + 1])
        i = end + 1
    return hidden, offset  # type: ignore[return-value]


def feed_blocks(
    model: GPT,
    blocks: Sequence[torch.Tensor],
    text: torch.Tensor | None,
    offset: int,
    plan: ChunkPlan,
    store: BlockStore,
    recompute: float,
) -> torch.Tensor:
    """A run of consecutive blocks (each `(n_k,)` ids) at `offset`, then `text` `(m,)` (the text segment
    after them; `None`: the prompt ends with the last block), into the attached caches (one row).

    Each block's KV comes from `store` (computed alone with `plan`'s chunking if absent); in order, each
    block's tokens to recompute are chosen (`select_recompute`, its probe seeing the context and the
    blocks before it as spliced) and the others spliced. Then the chosen tokens of every block and
    `text` run as one sequence of ordinary calls of `plan.size` tokens (fewer, fuller calls than one
    per block): a chosen token attends to the context, the spliced tokens before it and the chosen
    tokens before it. When `text` is `None` the last block's last token is chosen too (the prompt's
    last hidden state must see the context). `last_pos` becomes the run's last position.

    Returns:
        The last token's final hidden state `(1, n_embd)` (of `text`'s last token when given).
    """
    ratio = check_recompute(recompute)
    device = model.lm_head.weight.device
    dtype = model.caches.policy_caches[0].dtype  # type: ignore[union-attr]
    ids_run, pos_run, hidden, pos = [], [], None, offset
    for k, raw in enumerate(blocks):
        ids = raw.to(device=device, dtype=torch.long)
        block = store.get(model, ids, plan, dtype)
        chosen = select_recompute(model, block, pos, ratio, last=text is None and k == len(blocks) - 1)
        splice(model, block, pos, ~chosen, plan.size)
        index = chosen.nonzero().flatten()
        ids_run.append(ids[index])
        pos_run.append(index + pos)
        hidden = None if bool(chosen[-1]) else block.last_hidden
        pos += ids.numel()
    if text is not None:
        ids_run.append(text.to(device=device, dtype=torch.long))
        pos_run.append(torch.arange(pos, pos + text.numel(), device=device))
        pos += text.numel()
        hidden = None
    seq, seq_pos = torch.cat(ids_run), torch.cat(pos_run)
    if seq.numel():
        ran = _run(model, seq, seq_pos, ChunkPlan(plan.size, plan.size).bounds(seq.numel()))
        hidden = ran if hidden is None else hidden
    model.last_pos = torch.tensor([pos - 1], device=device)
    return hidden  # type: ignore[return-value]
