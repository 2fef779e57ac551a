"""`--learn.target kvzip`: the eviction gates' regression target is the log KVzip+ score of each training
token (KVzap, Jegou et al., 2025: a per-layer surrogate of KVzip+ trained on the model's own text).

`kvzip_records(model, ids, repeat)` prefills each sequence through one-shot `kvzip` caches with KVzip+
normalisation (`litkv/kvcache/kvzip.py`), runs the context-reconstruction pass (`litkv.inference.kvzip_reconstruction`),
and returns per layer the pre-RoPE keys of every token and `log(score)` (scores floored at `FLOOR`), the
pairs `litkv.finetune.lstsq` regresses the gate logits on. Unlike kvpress's `kvzap/data.py`, which
repeats the whole prompt once under full attention, the scores are those `kvzip` ranks by (kvpress's
`KVzipPress`: chunks of `chunk_size`, softmax over the sinks, the chunk and the repeat).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from litkv.gates.gate import unrotate_keys
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_score
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.modeling.runner import run_chunks

__all__ = ["FLOOR", "kvzip_records"]

#: Smallest score whose log is taken (a token no reconstruction query attends: the sinks, a prefix).
FLOOR = 1e-10


@contextmanager
def _attention_inputs(model: nn.Module, store: list[list[torch.Tensor]]) -> Iterator[None]:
    """While open, each call's attention input (after the block's norm, `(B, T_call, C)`) of layer `l` is
    appended to `store[l]` (KVzap's input: the hidden state the layer's keys are made from)."""
    handles = []
    for block, calls in zip(model.transformer.h, store, strict=True):

        def hook(module: nn.Module, args: tuple[Any, ...], calls: list[torch.Tensor] = calls) -> None:
            calls.append(args[0].detach().clone())

        handles.append(block.attn.register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def kvzip_records(
    model: nn.Module,
    ids: torch.Tensor,
    repeat: RepeatPrompt,
    chunk_size: int = 2048,
    prefill_chunk: int = 512,
    hidden: list[torch.Tensor] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the pre-RoPE keys `(B, G, T, D)` and `log(max(KVzip+ score, FLOOR))` `(B, G, T)` of `ids`
    `(B, T)` (each row a whole sequence, from position 0). `hidden`: a list that receives, per layer, the
    attention's input of every token `(B, T, C)` (the prefill's, not the reconstruction's)."""
    b, t = ids.shape
    options = {"mode": "one-shot", "budget": t, "kvzip_plus": True, "chunk_size": chunk_size}
    cfg = KVCacheConfig("kvzip", cache_length=t, chunk_size=min(prefill_chunk, t), options=options)
    pos = torch.arange(t, device=ids.device).expand(b, t)
    cos, sin = model.rope(pos)
    records = []
    with torch.inference_mode(), model.kv_caches_attached(cfg, b) as caches:
        store: list[list[torch.Tensor]] = [[] for _ in model.transformer.h]
        with _attention_inputs(model, store) if hidden is not None else nullcontext():
            run_chunks(model, ids, pos, ChunkPlan.of(cfg), lm_head=False, last_only=True)
        if hidden is not None:
            hidden[:] = [torch.cat(calls, dim=1) for calls in store]
        kvzip_score(model, list(ids), repeat)
        for cache in caches:
            order = cache.positions.argsort(dim=2)  # (B, G, T): every token is held, slot -> position
            keys = cache.storage.read()[0].gather(2, order[..., None].expand(*order.shape, cache.shape.key_size))
            scores = cache.policy.kvzip_scores.gather(2, order)
            pre = unrotate_keys(keys, cos, sin, model.config.rope_n_elem)
            records.append((pre.clone(), torch.log(scores.double().clamp_min(FLOOR))))
    return records
