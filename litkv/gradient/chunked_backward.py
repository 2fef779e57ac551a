"""`chunked_loss_backward`: exact gradients of a chunked pass through a KV cache policy.

The gradient is that of `forward_chunked` followed by cross-entropy, with the policy's discrete choices
(which slots are evicted) held fixed. Compute-device memory does not grow with the sequence length:

1. Forward without grad, chunk by chunk, with the real policy. Each layer's `LayerTape` records on
   the host every token's key/value as the cache stored it, and per chunk which slots changed.
2. Backward over the chunks in reverse. Chunk `c` is recomputed through all layers with a
   `ReplayKVCache` per layer holding the slots it attended to (gathered from the tape as leaves that
   require grad). The backward roots are the chunk's share of the loss and, for each layer, the
   chunk's own stored keys/values with the gradient that later chunks sent them (the tape's
   accumulators). The leaves' gradients are then added to the accumulators. When chunk `c` is
   reached, every later reader of its keys/values has already contributed, so the result is exact.

Device memory: one chunk's graph through all layers plus one cache snapshot per layer. Host memory:
keys/values and float32 gradient accumulators of every token, `O(T * n_layer * G * head_size)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from litkv.core.validation import is_number
from litkv.gradient.recurrent_tape import RecurrentTape
from litkv.gradient.replay import ReplayKVCache, stored_view, stores_gradients
from litkv.gradient.tape import LayerTape
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.recurrent import RecurrentCache
from litkv.modeling.model import GPT

__all__ = ["IGNORE_INDEX", "backward_chunk", "chunked_loss_backward", "record_forward", "replay_caches"]

IGNORE_INDEX = -100


def chunked_loss_backward(
    model: GPT,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    kv_cache: KVCacheConfig | Sequence[KVCacheConfig],
    *,
    loss_scale: float = 1.0,
) -> float:
    """Loss of a chunked pass through KV caches; accumulates its exact gradient into `.grad`.

    The loss is the mean cross-entropy over all targets of the batch that are not `-100`, i.e.
    ``F.cross_entropy(forward_chunked(model, input_ids, kv_cache).flatten(0, 1), targets.flatten(),
    ignore_index=-100)``. Its gradient, with the policy's eviction choices held fixed, is added to the
    `.grad` of every parameter that requires grad (LoRA: the adapters only).

    Args:
        model: the GPT (unwrapped, e.g. `fabric_module.module`); no caches need to be attached.
        input_ids: `(B, T)` token ids; every row starts at position 0.
        targets: `(B, T)` target ids, `-100` where no loss is taken.
        kv_cache: cache config for all layers, or one per layer; `ChunkPlan.of(kv_cache)` gives the chunks.
        loss_scale: factor applied to the gradients (not to the returned loss), e.g. `1 / accumulation
            steps`.

    Returns:
        The loss as a float.
    """
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        raise RuntimeError(
            "chunked_loss_backward needs gradients enabled: it was called under torch.no_grad() or "
            "torch.inference_mode(); call it outside those blocks (or under torch.enable_grad())"
        )
    configs = _layer_configs(model, kv_cache)
    _check_batch(model, input_ids, targets)
    if not is_number(loss_scale):
        raise TypeError(f"loss_scale must be a float, got {type(loss_scale).__name__} {loss_scale!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("no parameter of the model requires grad: there is nothing to accumulate gradients into")
    device = model.lm_head.weight.device
    idx, targets = input_ids.to(device), targets.to(device, torch.long)
    n_valid = int((targets != IGNORE_INDEX).sum())
    if n_valid == 0:
        raise ValueError("every target is -100 (ignored): the mean cross-entropy is undefined")
    b, t = idx.shape
    input_pos = torch.arange(t, device=device).expand(b, t)
    bounds = ChunkPlan.of(configs).bounds(t)  # every row starts at 0, unpadded: the rows' chunks coincide
    tapes = record_forward(model, idx, input_pos, configs, bounds)
    total = 0.0
    weight = float(loss_scale) / n_valid
    for chunk in reversed(range(len(bounds))):
        start, end = bounds[chunk]
        total += _backward_chunk(
            model, idx[:, start:end], input_pos[:, start:end], targets[:, start:end], tapes, chunk, weight
        )
    return total / n_valid


def record_forward(
    model: GPT,
    idx: torch.Tensor,
    input_pos: torch.Tensor,
    configs: Sequence[KVCacheConfig],
    bounds: Sequence[tuple[int, int]],
    *,
    grads: bool = True,
    after_chunk: Callable[[int, int], None] | None = None,
) -> list[LayerTape | RecurrentTape]:
    """Run the chunks without grad through the real policy and record one `LayerTape` per attention layer
    (a `RecurrentTape` per recurrent layer of a hybrid model: its state before each chunk).

    Args:
        idx: `(B, T)` token ids on the model's device.
        input_pos: `(B, T)` positions `0..T-1` of every row.
        configs: one cache config per layer.
        bounds: the chunks, `[(start, end), ...]` covering `[0, T)`.
        grads: keep gradient accumulators (False: a tape that is only replayed, e.g. a teacher's).
        after_chunk: called with `(start, end)` after each chunk's forward (still without grad).
    """
    b, t = idx.shape
    caches = model.build_kv_caches(list(configs), b)
    tapes = [
        RecurrentTape(c)
        if isinstance(c, RecurrentCache)
        else LayerTape(c, t, grads and stores_gradients(c.config, c.shape, idx.device, c.dtype))
        for c in caches
    ]
    with model.kv_caches_attached(caches), torch.no_grad():
        for start, end in bounds:
            before = [None if isinstance(c, RecurrentCache) else c.positions.clone() for c in caches]
            for tape, cache in zip(tapes, caches, strict=True):
                if isinstance(tape, RecurrentTape):
                    tape.record_start(cache)  # type: ignore[arg-type]
            model(idx[:, start:end], input_pos[:, start:end], lm_head=False)
            for tape, cache, positions in zip(tapes, caches, before, strict=True):
                if isinstance(tape, LayerTape):
                    tape.record_chunk(cache, positions, start, end)
            if after_chunk is not None:
                after_chunk(start, end)
    for tape, cache in zip(tapes, caches, strict=True):
        if isinstance(tape, LayerTape):
            tape.finish(cache)
    return tapes


def replay_caches(
    tapes: Sequence[LayerTape | RecurrentTape], chunk: int, start: int, length: int, device: torch.device
) -> list[ReplayKVCache | RecurrentCache]:
    """One `ReplayKVCache` per layer holding the slots chunk `chunk` (tokens `[start, start + length)`)
    attended to in the recorded pass, on `device`, as leaves that require grad where the tape tracks
    gradients.

    Must be called for the chunks in reverse order (`LayerTape.rewind`). A recurrent layer gets a
    `RecurrentCache` starting from its state before the chunk, as leaves (`RecurrentTape.replay_cache`)."""
    caches: list[ReplayKVCache | RecurrentCache] = []
    for tape in tapes:
        if isinstance(tape, RecurrentTape):
            caches.append(tape.replay_cache(chunk, device))
            continue
        positions = tape.rewind(chunk)
        keys, values = tape.gather(positions)
        keys = keys.to(device).requires_grad_(tape.track_grads)
        values = values.to(device).requires_grad_(tape.track_grads)
        recorded = tape.recorded(start, start + length) if tape.config.storage != "float" else None
        caches.append(ReplayKVCache(keys, values, positions.to(device), tape.config, recorded))
    return caches


def _backward_chunk(
    model: GPT,
    idx: torch.Tensor,
    input_pos: torch.Tensor,
    targets: torch.Tensor,
    tapes: Sequence[LayerTape | RecurrentTape],
    chunk: int,
    weight: float,
) -> float:
    """Recompute chunk `chunk` (`idx`, `input_pos`, `targets`: `(B, t)`) and backpropagate it.

    Returns:
        The chunk's summed cross-entropy.
    """

    def loss(logits: torch.Tensor) -> tuple[torch.Tensor, float]:
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss_sum * weight, float(loss_sum.detach())

    return backward_chunk(model, idx, input_pos, tapes, chunk, loss)


def backward_chunk(
    model: GPT,
    idx: torch.Tensor,
    input_pos: torch.Tensor,
    tapes: Sequence[LayerTape | RecurrentTape],
    chunk: int,
    loss: Callable[[torch.Tensor], tuple[torch.Tensor, float]],
) -> float:
    """Recompute chunk `chunk` (`idx`, `input_pos`: `(B, t)`) through the recorded slots and backpropagate
    `loss(logits)`'s tensor (the chunk's share of the total, `logits` `(B, t, V)`) together with the
    gradients later chunks sent its keys/values; add the gradients of the slots it read to the tapes.

    Returns:
        `loss`'s float.
    """
    device = idx.device
    start = int(input_pos[0, 0])  # every row holds positions 0..T-1: tape index == position
    caches = replay_caches(tapes, chunk, start, idx.shape[1], device)
    with model.kv_caches_attached(caches):
        logits = model(idx, input_pos)
    root, value = loss(logits)
    roots: list[torch.Tensor] = [root]
    grads: list[torch.Tensor | None] = [None]
    for tape, cache in zip(tapes, caches, strict=True):
        if isinstance(tape, RecurrentTape):  # the state after the chunk, with the next chunk's gradient
            for tensor, grad in tape.roots(cache):  # type: ignore[arg-type]
                roots.append(tensor)
                grads.append(grad)
            continue
        grad_keys, grad_values = tape.grads_of(start, start + idx.shape[1])
        if not tape.track_grads or cache.new_keys is None or not (bool(grad_keys.any()) or bool(grad_values.any())):
            continue
        stored = stored_view(tape.config, cache.new_keys, cache.new_values)
        for tensor, grad in zip(stored, (grad_keys, grad_values), strict=True):
            if tensor.requires_grad:
                roots.append(tensor)
                grads.append(grad.to(device, tensor.dtype))
    torch.autograd.backward(roots, grads)
    for tape, cache in zip(tapes, caches, strict=True):
        if isinstance(tape, RecurrentTape):
            tape.take_grads()
            continue
        if tape.track_grads and cache.num_filled:
            grad_keys, grad_values = cache.cached_keys.grad, cache.cached_values.grad
            zeros = torch.zeros_like
            tape.accumulate(
                cache.positions,
                zeros(cache.cached_keys) if grad_keys is None else grad_keys,
                zeros(cache.cached_values) if grad_values is None else grad_values,
            )
    return value


def _layer_configs(model: GPT, kv_cache: KVCacheConfig | Sequence[KVCacheConfig]) -> list[KVCacheConfig]:
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a litkv GPT (unwrap Fabric/DDP modules first), got {type(model).__name__}")
    n_layer = model.config.n_layer
    if isinstance(kv_cache, KVCacheConfig):
        return [kv_cache] * n_layer
    if not isinstance(kv_cache, Sequence) or not all(isinstance(c, KVCacheConfig) for c in kv_cache):
        raise TypeError(f"kv_cache must be a KVCacheConfig or a list of them, got {type(kv_cache).__name__}")
    if len(kv_cache) != n_layer:
        raise ValueError(f"expected one KVCacheConfig per layer ({n_layer}), got {len(kv_cache)}")
    return list(kv_cache)


def _check_batch(model: GPT, input_ids: torch.Tensor, targets: torch.Tensor) -> None:
    integer = (torch.int32, torch.int64)
    for name, tensor in (("input_ids", input_ids), ("targets", targets)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in integer:
            raise TypeError(f"{name} must be an int64 tensor, got {getattr(tensor, 'dtype', type(tensor).__name__)}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must have shape (B, T) with T >= 1, got {tuple(input_ids.shape)}")
    if targets.shape != input_ids.shape:
        raise ValueError(
            f"targets must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(targets.shape)}"
        )
    vocab = model.config.padded_vocab_size
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise ValueError(f"target id {value} is outside the vocabulary: targets must be in [0, {vocab}) or -100")
