"""KVzip in a transformers model: the context-reconstruction pass of `kvzip` caches in a `litkv.hf.Cache`, then
every layer compressed at once, as `litkv.inference.kvzip_reconstruction.kvzip_compress` does for litkv's GPT.

    cache = litkv.hf.Cache(model, KVCacheConfig(policy="kvzip", cache_length=4096, options={"budget": 1024}))
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)       # the context, kept whole
    litkv.hf.kvzip_compress(model, cache, ids, mask, litkv.hf.repeat_prompt(tokenizer))
    state = cache.snapshot()                                                # then ask: restore, generate

The caller owns the model (as kvpress's `KVzipPress`): the pass feeds the model, per chunk of the context, the
reconstruction prompt and the chunk, at the positions after the context, through the cache (`Cache.whole_calls`:
each call attends the whole cache and stores nothing), while every layer's cache scores its slots.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from litkv.hf.cache import Cache
from litkv.hf.compat import cache_argument
from litkv.inference.kvzip_reconstruction import FIRST_PROMPT, LATER_PROMPT, RepeatPrompt, reconstruct
from litkv.kvcache.kvzip import KVzipKVCache, Scoring, compress_kvzip

__all__ = ["kvzip_compress", "repeat_prompt"]


@torch.no_grad()
def kvzip_compress(
    model: torch.nn.Module,
    cache: Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    repeat: RepeatPrompt,
    prefix_length: int = 0,
) -> None:
    """Score the context held by `cache` by reconstruction, then compress every layer to the budget.

    Args:
        model: the transformers model `cache` was built for, which prefilled the context through it.
        cache: a `litkv.hf.Cache` of `kvzip` caches holding the context (not compressed yet).
        input_ids: `(B, N)` the context as prefilled (left-padded for rows of different lengths).
        attention_mask: `(B, N)` 1 at tokens, 0 at pads (`None`: no pads), as given to the prefill; each row's
            tokens were at positions `0..n_r-1` (transformers' rule).
        repeat: the reconstruction prompt's token ids (`repeat_prompt(tokenizer)`).
        prefix_length: leading tokens of each row that are not repeated (a chat template's prefix).

    Raises:
        ValueError: another cache or model, not every layer `kvzip`, a compressed cache, ids that are not the
            context the cache holds.
    """
    caches = _kvzip_caches(model, cache)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, columns), got shape {tuple(input_ids.shape)}")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask {tuple(mask.shape)} must have the shape of input_ids {tuple(input_ids.shape)}"
        )
    rows = [ids[keep] for ids, keep in zip(input_ids, mask, strict=True)]
    held = cache.caches.last_pos  # type: ignore[union-attr]
    lengths = torch.tensor([r.numel() for r in rows], device=mask.device)
    if held is None or not torch.equal(held.to(mask.device) + 1, lengths):
        raise ValueError(
            f"kvzip_compress: the rows hold {lengths.tolist()} tokens, the cache holds "
            f"{None if held is None else (held + 1).tolist()}: give the ids and mask the context was prefilled with"
        )
    attn = _attention_modules(model, len(caches))
    plus = caches[0].options.kvzip_plus

    cache_kw = cache_argument(model)

    def run(idx: torch.Tensor, pos: torch.Tensor, scorings: list[Scoring]) -> None:
        columns = torch.ones(idx.shape[0], cache.seen, dtype=torch.long, device=idx.device)
        call_mask = torch.cat((columns, (pos >= 0).long()), dim=1)
        call = dict(input_ids=idx, attention_mask=call_mask, position_ids=pos.clamp(min=0), **{cache_kw: cache})
        if plus:
            with _hidden_hooks(attn, scorings):
                model(**call, logits_to_keep=1)
        else:
            model(**call, logits_to_keep=1)

    with cache.whole_calls():
        reconstruct(caches, rows, repeat, prefix_length, [m.o_proj.weight for m in attn], run)
    compress_kvzip([policy.cache for policy in caches])


def _kvzip_caches(model: torch.nn.Module, cache: Cache) -> list[KVzipKVCache]:
    if not isinstance(cache, Cache):
        raise ValueError(f"kvzip_compress needs a litkv.hf.Cache, got {type(cache).__name__}")
    if cache._model is not model:
        raise ValueError("kvzip_compress: the cache was built for another model")
    layers = cache.kv_caches
    if not layers:
        raise ValueError("kvzip_compress: the cache holds nothing: prefill the context through it first")
    policies = [c.policy for c in layers]
    if not all(isinstance(p, KVzipKVCache) for p in policies):
        kinds = sorted({type(p).__name__ for p in policies})
        raise ValueError(f"kvzip's reconstruction pass needs a kvzip cache in every layer, got {kinds}")
    if any(not p.before_compression() for p in policies):
        raise ValueError("kvzip_compress: the cache is compressed already (once per context)")
    return policies  # type: ignore[return-value]


def _attention_modules(model: torch.nn.Module, n_layer: int) -> list[torch.nn.Module]:
    """The model's attention modules (an `o_proj` and a `layer_idx`), in layer order."""
    found = {m.layer_idx: m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")}
    if sorted(found) != list(range(n_layer)):
        raise ValueError(f"kvzip_compress: {type(model).__name__} has no attention module (o_proj) in every layer")
    return [found[i] for i in range(n_layer)]


@contextmanager
def _hidden_hooks(modules: Sequence[torch.nn.Module], scorings: list[Scoring]) -> Iterator[None]:
    """While open, each layer's `Scoring.hidden` is its attention's input `(B, T, n_embd)` (KVzip+)."""
    handles = []
    for module, scoring in zip(modules, scorings, strict=True):

        def hook(
            module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], scoring: Scoring = scoring
        ) -> None:
            scoring.hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def repeat_prompt(tokenizer: Any) -> RepeatPrompt:
    """KVzip's reconstruction prompt for a transformers `tokenizer`, with its chat template's turn markers when it
    has one (as `RepeatPrompt.build` for litkv's tokenizer; `prefix_length`: the template's tokens before a user
    message's content)."""
    prefix, suffix = "", "\n"
    if getattr(tokenizer, "chat_template", None):
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        messages = [{"role": "user", "content": dummy + separator}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        context, suffix = text.split(separator, 1)
        prefix = context.split(dummy)[0]

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return RepeatPrompt(
        encode(FIRST_PROMPT), encode(LATER_PROMPT), encode(suffix), len(encode(prefix)) if prefix else 0
    )
