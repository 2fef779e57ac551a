"""A float64 brute-force KVzip / KVzip+ reconstruction pass (tests/kvcache/test_kvzip.py,
tests/finetune/test_gate_lstsq.py): one row alone, the whole context + each repeat call through the plain
model forward (no cache), every attention weight of the scored subset written out per (layer, head, query)."""

from __future__ import annotations

import math

import torch

from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.modeling.model import GPT


def reconstruction_calls(
    ctx: list[int], repeat: RepeatPrompt, prefix: int, chunk: int
) -> list[tuple[int, int, list[int]]]:
    """(start, end, ids) of each reconstruction call, written from kvpress's `KVzipPress.prepare`."""
    body = ctx[prefix:]
    chunks = [body[i : i + chunk] for i in range(0, len(body), chunk)]
    out, start = [], prefix
    for i, part in enumerate(chunks):
        head = list(repeat.first) if i == 0 else list(repeat.later) + chunks[i - 1][-repeat.overlap :]
        out.append((start, start + len(part), head + list(repeat.suffix) + part))
        start += len(part)
    return out


@torch.no_grad()
def brute_scores(
    model: GPT, ctx: list[int], plus: bool, repeat: RepeatPrompt, prefix: int, n_sink: int, chunk: int
) -> torch.Tensor:
    """`(n_layer, G, n)` float64 scores of one row's positions, by the definition (0 where no chunk scores)."""
    c = model.config
    n = len(ctx)
    q_per = c.n_head // c.n_query_groups
    scores = torch.zeros(c.n_layer, c.n_query_groups, n, dtype=torch.float64)
    for start, end, call in reconstruction_calls(ctx, repeat, prefix, chunk):
        seq = torch.tensor(ctx + call)[None]
        inputs: dict[int, torch.Tensor] = {}
        hooks = [
            block.attn.register_forward_pre_hook(lambda m, a, i=i, store=inputs: store.__setitem__(i, a[0]))
            for i, block in enumerate(model.transformer.h)
        ]
        try:
            model(seq)
        finally:
            for h in hooks:
                h.remove()
        cos, sin = model.rope(torch.arange(seq.shape[1])[None])
        sink = min(n_sink, start)
        for layer, block in enumerate(model.transformer.h):
            x = inputs[layer]
            q, k, v = block.attn._qkv(x, cos, sin)
            w_o = block.attn.proj.weight
            for h in range(c.n_head):
                g = h // q_per
                for j in range(len(call)):
                    t = n + j
                    keys = list(range(sink)) + list(range(start, end)) + list(range(n, t + 1))
                    logits = torch.stack([q[0, h, t] @ k[0, g, p] for p in keys]) / math.sqrt(c.head_size)
                    weights = torch.softmax(logits, dim=0)
                    for col, p in enumerate(keys):
                        if not start <= p < end:
                            continue
                        a = weights[col]
                        if plus:
                            wov = w_o[:, h * c.head_size : (h + 1) * c.head_size] @ v[0, g, p]
                            a = a * wov.norm() / x[0, t].norm()
                        scores[layer, g, p] = a if _first(h, j, q_per) else max(scores[layer, g, p], a)
    return scores


def _first(h: int, j: int, q_per: int) -> bool:
    """The first (query head, query) of a KV group visits a position: it replaces the initial score."""
    return h % q_per == 0 and j == 0
