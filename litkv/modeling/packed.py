"""A packed call: one forward that runs several groups of tokens, each through its own caches, layer by layer.

A group is a call as `GPT.forward` would run it alone: `(B, T)` tokens at their positions through a set of
caches (a server's decode rows `(m, 1)` through the batch's caches, a prompt chunk `(1, T)` through one
row's). Per layer, the groups of one *pack* share the linear layers' matrix products (`qkv`, the attention's
output projection, the MLP's layers: one product over their tokens concatenated), and everything else runs
per group, on tensors of the shapes and layouts of the group's own call: norms, RoPE, the attention against
the group's cache (its positions, its eviction), activations, residuals, the final norm. So a group's result
is bitwise that of its own call whenever a product over the pack's `N` rows rounds each row as a product over
the group's own rows does: which packs are allowed is the caller's business (`plan_packs`, given a test of
two row counts, e.g. `litkv.serve.rounding.CountProbe.alike`).

Only plain attention blocks pack (`packing_refusal` says why a model does not): no recurrent mixer, no gated
attention output, no soft eviction, an MLP of a known kind (LLaMA, Gemma, GPT-NeoX); callers run the groups
as separate calls otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from litgpt.model import GemmaMLP, GptNeoxMLP, LLaMAMLP
from torch import nn

from litkv.kvcache.base import KVCache
from litkv.kvcache.caches import KVCaches
from litkv.modeling.model import GPT, Block
from litkv.modeling.self_attention import CausalSelfAttention

__all__ = ["Group", "packed_forward", "packing_refusal", "plan_packs"]


@dataclass
class Group:
    """One group of a packed call.

    Attributes:
        caches: the caches it runs through (`B` rows).
        idx: `(B, T)` token ids; input_pos: `(B, T)` positions (`-1`: padding).
        trusted: run as inside `GPT.trusted_inputs` (a decode step: no host-side checks).
    """

    caches: KVCaches
    idx: torch.Tensor
    input_pos: torch.Tensor
    trusted: bool = False

    @property
    def rows(self) -> int:
        """Rows of the group's matrix products: `B * T`."""
        return self.idx.numel()


def packing_refusal(model: GPT) -> str | None:
    """Why `model`'s calls cannot be packed (None: they can)."""
    for i, block in enumerate(model.transformer.h):
        attn = block.attn
        if not isinstance(attn, CausalSelfAttention):
            return f"layer {i} is a {type(attn).__name__}, not an attention layer"
        if attn.gate is not None:
            return f"layer {i} gates its attention output"
        if attn.soft_eviction is not None:
            return f"layer {i} trains eviction gates"
        if type(block.mlp) not in (LLaMAMLP, GemmaMLP, GptNeoxMLP):
            return f"layer {i}'s MLP is a {type(block.mlp).__name__}"
    return None


def plan_packs(rows: Sequence[int], alike: Callable[[int, int], bool]) -> list[list[int]]:
    """Groups (by index) put in packs, greedily in order: a group joins the first pack where a product over
    all the pack's rows rounds like each member's own (`alike(total, member's rows)` for every member, the
    group included), else starts its own."""
    packs: list[list[int]] = []
    for g, n in enumerate(rows):
        for pack in packs:
            total = n + sum(rows[i] for i in pack)
            if all(alike(total, rows[i]) for i in (*pack, g)):
                pack.append(g)
                break
        else:
            packs.append([g])
    return packs


@dataclass
class _Call:
    """A group's state through the layers: hidden states `(B, T, n_embd)`, positions, cos/sin, its call's flags."""

    group: Group
    x: torch.Tensor
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    no_pads: bool
    evict_later: bool


def packed_forward(model: GPT, groups: Sequence[Group], packs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Run `groups` through the model in one pass over the layers, the groups of each pack sharing the
    linear layers' products; each group's final hidden states `(B, T, n_embd)` (after the final norm).
    The caches attached to the model before the call are attached again after it.

    Raises ValueError when `packs` is not a partition of the groups or the model cannot pack
    (`packing_refusal`)."""
    refusal = packing_refusal(model)
    if refusal is not None:
        raise ValueError(f"this model's calls cannot be packed: {refusal}")
    if sorted(i for pack in packs for i in pack) != list(range(len(groups))):
        raise ValueError(f"packs {packs} are not a partition of the {len(groups)} groups")
    attached = model.caches
    try:
        calls = [_begin(model, g) for g in groups]
        for i, block in enumerate(model.transformer.h):
            _block(model, i, block, calls, packs)
    finally:
        model.set_kv_caches(attached)
    out = []
    for call in calls:
        if call.evict_later:
            call.group.caches.evict_waiting()
        out.append(model.transformer.ln_f(call.x))
    return out


def _begin(model: GPT, group: Group) -> _Call:
    """What `GPT.forward` does before its block loop, for one group (its caches attached for the checks)."""
    model.set_kv_caches(group.caches)
    previous = model._checks
    if group.trusted:
        model._rope_table(int(group.input_pos.max()) + 2)
        model._checks = False
    try:
        idx = model._check_idx(group.idx)
        pos = model._check_positions(idx, group.input_pos)
        cos, sin = model.rope(pos)
        t = idx.shape[1]
        no_pads = t > 1 and model._checks and bool((pos >= 0).all())
    finally:
        model._checks = previous
    x = model.transformer.wte(idx)
    if model.config.scale_embeddings:
        x = x * torch.tensor(model.config.n_embd**0.5, dtype=x.dtype)
    return _Call(group, x, pos, cos, sin, no_pads, group.caches.begin_call(t))


def _shared(linear: nn.Module, xs: Sequence[torch.Tensor], packs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """`linear` on each input `(B, T, C)`, one product per pack over its members' rows; each output in a
    fresh tensor of its own (the layout of the member's own call)."""
    out: list[torch.Tensor | None] = [None] * len(xs)
    for pack in packs:
        if len(pack) == 1:
            out[pack[0]] = linear(xs[pack[0]])
            continue
        joined = linear(torch.cat([xs[i].reshape(-1, xs[i].shape[-1]) for i in pack]))
        parts = joined.split([xs[i].shape[0] * xs[i].shape[1] for i in pack])
        for i, part in zip(pack, parts, strict=True):
            out[i] = part.reshape(*xs[i].shape[:-1], part.shape[-1]).clone()
    return out  # type: ignore[return-value]


def _mlp(mlp: nn.Module, xs: list[torch.Tensor], packs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The MLP's forward (litgpt's `LLaMAMLP`, `GemmaMLP`, `GptNeoxMLP`) with shared products."""
    if isinstance(mlp, GptNeoxMLP):
        h = [F.gelu(a, approximate=mlp.config.gelu_approximate) for a in _shared(mlp.fc, xs, packs)]
        return _shared(mlp.proj, h, packs)
    one, two = _shared(mlp.fc_1, xs, packs), _shared(mlp.fc_2, xs, packs)
    if isinstance(mlp, GemmaMLP):
        h = [F.gelu(a, approximate=mlp.config.gelu_approximate) * b for a, b in zip(one, two, strict=True)]
    else:
        h = [F.silu(a) * b for a, b in zip(one, two, strict=True)]
    return _shared(mlp.proj, h, packs)


def _block(model: GPT, i: int, block: Block, calls: list[_Call], packs: Sequence[Sequence[int]]) -> None:
    """`Block.forward` of layer `i` for every group (each `calls[g].x` replaced by the block's output)."""
    attn: CausalSelfAttention = block.attn
    rope_indices = model.config.rope_indices
    normed = [block.norm_1(c.x) for c in calls]
    ys = []
    for call, qkv in zip(calls, _shared(attn.qkv, normed, packs), strict=True):
        cos, sin = call.cos, call.sin
        if rope_indices is not None:
            cos, sin = cos[..., rope_indices[i]], sin[..., rope_indices[i]]
        q, k, v = attn.heads(qkv, cos, sin)
        cache = call.group.caches[i]
        if not isinstance(cache, KVCache):
            raise ValueError(f"layer {i} of a packed group has no KV cache")
        ys.append(attn.attend_cached(q, k, v, call.pos, cache, call.no_pads, call.evict_later))
    outs = _shared(attn.proj, ys, packs)
    mlp_in = []
    for call, out, x_normed in zip(calls, outs, normed, strict=True):
        attn_out = block.post_attention_norm(out)
        if model.config.parallel_residual:
            if block.norm_2 is not None:
                x_normed = block.norm_2(call.x)
            call.x = attn_out + call.x
        else:
            call.x = attn_out + call.x
            x_normed = block.norm_2(call.x)
        mlp_in.append(x_normed)
    for call, out in zip(calls, _mlp(block.mlp, mlp_in, packs), strict=True):
        call.x = block.post_mlp_norm(out) + call.x
