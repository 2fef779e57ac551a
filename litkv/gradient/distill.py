"""`chunked_distill_backward`: the gates' distillation loss and its exact gradient, chunk by chunk.

The loss is that of `litkv.finetune.gate_training` (method `distill`) with the student run through KV caches:
`sum_t w_t KL(teacher_t || student_t) / sum_t w_t + compression_weight * relu(mean keep - target)`,
where the teacher is the model without eviction, the student the model with soft eviction
(`litkv.gates.soft`, `SoftEviction.attend_cached`) through caches of `kv_cache` (the `learned`
policy, whose hard choices of which slots to keep are held fixed, as the engine holds every policy's),
and the mean keep runs over every layer, row, KV head and evictable token (not a sink, not in the last
`window` tokens). With caches that keep every token, it is the whole-sequence loss, computed chunk by
chunk.

How (the engine's scheme, `litkv.gradient.chunked_backward`): the teacher is recorded chunk by chunk through
dense caches (a tape without gradient accumulators), the student through the real policy with soft
eviction; the soft keep fractions of the recording decide whether the compression term is active.
Then, chunk by chunk in reverse, the teacher's log-probabilities are replayed without grad and the
student's chunk is replayed and backpropagated. Memory: the tapes hold every token's keys and values
on the host (`O(T)`), the device one chunk's graph and one cache snapshot per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from litkv.gates.soft import SoftEviction, soft_eviction
from litkv.gradient.chunked_backward import backward_chunk, record_forward, replay_caches
from litkv.gradient.tape import LayerTape
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.modeling.model import GPT

__all__ = ["DistillStep", "chunked_distill_backward"]


@dataclass
class DistillStep:
    """The loss of one step (`loss` = `kl` + the compression term) and the mean soft keep fraction."""

    loss: float
    kl: float
    keep: float


def chunked_distill_backward(
    model: GPT,
    soft: SoftEviction,
    input_ids: torch.Tensor,
    token_weight: torch.Tensor,
    kv_cache: KVCacheConfig,
    compression_weight: float,
    target: float,
    teacher: Callable[[], AbstractContextManager] = nullcontext,
) -> DistillStep:
    """The distillation loss of `soft.gates`; accumulates its exact gradient into the gates' `.grad` and
    into that of every model parameter that requires grad (LoRA adapters trained with the gates).

    Args:
        model: the GPT; its `eviction_gates` are replaced by `soft.gates` during the call (the `learned`
            policy ranks slots by them).
        soft: the soft eviction whose gates (tensors requiring grad) are trained; a `noise_table` covering
            the batch makes the noise the same in the recording and the replay (needed with `noise`).
        input_ids: `(B, T)` token ids; every row starts at position 0.
        token_weight: `(B, T)` weight of each token's KL.
        kv_cache: the student's caches (the `learned` or `dense` policy, float storage; `cache_length >= T`
            evicts nothing).
        compression_weight, target: the compression term `compression_weight * relu(mean keep - target)`.
        teacher: inside `teacher()` the model is the teacher (e.g. its LoRA adapters switched off); the
            default: the model itself, without eviction.

    Returns:
        The step's loss, its KL part and the mean keep fraction.
    """
    if soft.noise and soft.noise_table is None:
        raise ValueError("chunked_distill_backward needs SoftEviction.noise_table when noise is on (same noise twice)")
    if input_ids.shape != token_weight.shape:
        raise ValueError(f"token_weight must be {tuple(input_ids.shape)}, got {tuple(token_weight.shape)}")
    device = model.lm_head.weight.device
    idx = input_ids.to(device)
    b, t = idx.shape
    gates = soft.gates
    window, sinks = gates.window, gates.sinks
    if t <= window + sinks:
        raise ValueError(f"sequence length {t} must be > the gates' window + sinks ({window} + {sinks})")
    input_pos = torch.arange(t, device=device).expand(b, t)
    configs = [kv_cache] * model.config.n_layer
    bounds = ChunkPlan.of(configs).bounds(t)
    teacher_config = replace(
        kv_cache, policy="dense", cache_length=max(t, kv_cache.cache_length), storage="float", options={}
    )
    with teacher():
        teacher_tapes = record_forward(
            model, idx, input_pos, [teacher_config] * model.config.n_layer, bounds, grads=False
        )
    evictable = (torch.arange(t, device=device) >= sinks) & (torch.arange(t, device=device) < t - window)
    kept = [0.0]

    def tally(start: int, end: int) -> None:
        mask = evictable[start:end]
        kept[0] += sum(float(keep[:, :, mask].sum()) for keep in soft.keep.values())

    previous = model.eviction_gates
    model.eviction_gates = gates
    try:
        with soft_eviction(model, soft):
            student = record_forward(model, idx, input_pos, configs, bounds, after_chunk=tally)
        count = model.config.n_layer * b * model.config.n_query_groups * int(evictable.sum())
        keep_mean = kept[0] / count
        coef = compression_weight / count if keep_mean > target else 0.0
        weight = token_weight.to(device, torch.promote_types(model.lm_head.weight.dtype, torch.float32))
        weight = weight / weight.sum()
        kl_total = 0.0
        for chunk in reversed(range(len(bounds))):
            kl_total += _chunk(
                model, soft, idx, input_pos, weight, evictable, coef, (teacher, teacher_tapes), student, chunk, bounds
            )
    finally:
        model.eviction_gates = previous
    loss = kl_total + compression_weight * max(0.0, keep_mean - target)
    return DistillStep(loss, kl_total, keep_mean)


def _chunk(
    model: GPT,
    soft: SoftEviction,
    idx: torch.Tensor,
    input_pos: torch.Tensor,
    weight: torch.Tensor,
    evictable: torch.Tensor,
    coef: float,
    teacher: tuple[Callable[[], AbstractContextManager], Sequence[LayerTape]],
    student: Sequence[LayerTape],
    chunk: int,
    bounds: Sequence[tuple[int, int]],
) -> float:
    """Replay chunk `chunk`: the teacher (its context, its tapes) without grad, then the student with its
    backward; its weighted KL."""
    start, end = bounds[chunk]
    ids, pos = idx[:, start:end], input_pos[:, start:end]
    caches = replay_caches(teacher[1], chunk, start, end - start, idx.device)
    with torch.no_grad(), teacher[0](), model.kv_caches_attached(caches):
        logits = model(ids, pos)
        teacher_logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    mask = evictable[start:end]

    def loss(logits: torch.Tensor) -> tuple[torch.Tensor, float]:
        student_logp = F.log_softmax(logits.to(teacher_logp.dtype), dim=-1)
        kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(dim=-1)  # (B, t)
        kl = (kl * weight[:, start:end]).sum()
        root = kl
        if coef:
            root = root + coef * sum(keep[:, :, mask].sum() for keep in soft.keep.values())
        return root, float(kl.detach())

    with soft_eviction(model, soft):
        return backward_chunk(model, ids, pos, student, chunk, loss)
