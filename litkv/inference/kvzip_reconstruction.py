"""KVzip's context-reconstruction pass: the model repeats each prompt from its caches, and every layer's
`kvzip` cache scores its pairs by the attention they receive (`litkv/kvcache/kvzip.py`), then all layers
are compressed at once to the budget.

Usage, after a prefill through `kvzip` caches (one-shot, `cache_length >=` the prompt):

    repeat = RepeatPrompt.build(tokenizer, ChatTemplate.load(checkpoint_dir))
    kvzip_compress(model, prompts, repeat, prefix_length=repeat.prefix_length)

`generate(..., kvzip_repeat=repeat)` and `litkv generate --kv-cache kvzip` run it after the prefill (the whole
prompt compressed), `litkv evaluate --tasks` per sample batch; a `kvzip` cache asked to compress without it
raises. Chat and serve refuse `kvzip` (docs/kvzip.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from litkv.core.tokens import encode_plain
from litkv.inference.chat_template import ChatTemplate
from litkv.kvcache.kvzip import KVzipKVCache, Scoring, compress_kvzip
from litkv.modeling.model import GPT

__all__ = ["FIRST_PROMPT", "LATER_PROMPT", "RepeatPrompt", "kvzip_compress", "kvzip_score", "reconstruct"]

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass(frozen=True)
class RepeatPrompt:
    """Token ids of the reconstruction prompt (KVzip's, as kvpress 0.5.5 words it).

    Attributes:
        first: the instruction before the first chunk.
        later: the instruction before a later chunk (followed by the previous chunk's last `overlap` tokens).
        suffix: what follows the instruction: the chat template's end of the user turn and generation
            prompt, or a newline without a template.
        prefix_length: tokens the chat template writes before a user message's content (not scored).
        overlap: tokens of the previous chunk repeated after `later`.
    """

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]
    prefix_length: int = 0
    overlap: int = 8

    @classmethod
    def build(cls, tokenizer: Any, template: ChatTemplate | None) -> RepeatPrompt:
        """The prompt for `tokenizer`, with `template`'s turn markers (kvpress's dummy-context split)."""
        prefix, suffix = "", "\n"
        if template is not None:
            dummy = "dummy context"
            separator = "\n" + "#" * len(dummy)
            text = template.render([("user", dummy + separator)], add_generation_prompt=True)
            context, suffix = text.split(separator, 1)
            prefix = context.split(dummy)[0]
        return cls(
            tuple(encode_plain(tokenizer, FIRST_PROMPT)),
            tuple(encode_plain(tokenizer, LATER_PROMPT)),
            tuple(encode_plain(tokenizer, suffix)),
            len(encode_plain(tokenizer, prefix)) if prefix else 0,
        )


def _kvzip_caches(model: GPT) -> list[KVzipKVCache]:
    caches = model.caches
    if caches is None:
        raise ValueError("kvzip: the model has no caches attached (prefill the prompts through kvzip caches first)")
    policies = [getattr(c, "policy", c) for c in caches]  # a layer cache's policy (a recurrent layer has none)
    if not all(isinstance(p, KVzipKVCache) for p in policies):
        kinds = sorted({type(p).__name__ for p in policies})
        raise ValueError(f"kvzip's reconstruction pass needs a kvzip cache in every layer, got {kinds}")
    return policies  # type: ignore[return-value]


def _row_call(ctx: list[int], start: int, end: int, first: bool, repeat: RepeatPrompt, prev_start: int) -> list[int]:
    """The reconstruction call of one row's chunk `ctx[start:end]`."""
    overlap = ctx[max(prev_start, start - repeat.overlap) : start]
    head = list(repeat.first) if first else list(repeat.later) + overlap
    return head + list(repeat.suffix) + ctx[start:end]


@contextmanager
def _hidden_hooks(model: GPT, scorings: list[Scoring]) -> Iterator[None]:
    """While open, each layer's `Scoring.hidden` is the attention's input of the call (KVzip+)."""
    handles = []
    for block, scoring in zip(model.transformer.h, scorings, strict=True):

        def hook(module: torch.nn.Module, args: tuple[Any, ...], scoring: Scoring = scoring) -> None:
            scoring.hidden = args[0]

        handles.append(block.attn.register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def kvzip_score(model: GPT, prompts: Sequence[torch.Tensor], repeat: RepeatPrompt, prefix_length: int = 0) -> None:
    """Score every cached pair by context reconstruction (`KVzipKVCache.kvzip_scores`); nothing is evicted.
    Runs without autograd, in inference mode when the caches were filled in it (their tensors are inference
    tensors), else under `no_grad`: the scores are tensors the caller's mode can update in place.

    Args:
        model: the GPT with `kvzip` caches attached, holding `prompts` (prefilled at positions `0..n-1`).
        prompts: each row's prompt `(n_r,)`, as prefilled (left padding is the caches' business).
        repeat: the reconstruction prompt's token ids.
        prefix_length: leading tokens of each prompt that are not repeated (a chat template's prefix).
    """
    caches = _kvzip_caches(model)
    with torch.inference_mode() if caches[0].positions.is_inference() else torch.no_grad():
        _score(model, caches, prompts, repeat, prefix_length)


def _score(
    model: GPT, caches: list[KVzipKVCache], prompts: Sequence[torch.Tensor], repeat: RepeatPrompt, prefix_length: int
) -> None:
    saved = model.caches.last_pos.clone()
    plus = caches[0].options.kvzip_plus

    def run(idx: torch.Tensor, pos: torch.Tensor, scorings: list[Scoring]) -> None:
        if plus:
            with _hidden_hooks(model, scorings):
                model(idx, pos, lm_head=False)
        else:
            model(idx, pos, lm_head=False)
        model.caches.last_pos = saved.clone()

    try:
        reconstruct(caches, prompts, repeat, prefix_length, [b.attn.proj.weight for b in model.transformer.h], run)
    finally:
        model.caches.last_pos = saved


def reconstruct(
    caches: Sequence[KVzipKVCache],
    prompts: Sequence[torch.Tensor],
    repeat: RepeatPrompt,
    prefix_length: int,
    proj_weights: Sequence[torch.Tensor],
    run: Callable[[torch.Tensor, torch.Tensor, list[Scoring]], None],
) -> None:
    """The reconstruction pass over `caches` (one `kvzip` cache per layer, holding `prompts`), whatever model
    runs it: per chunk of `chunk_size` tokens of each row, the layers' `Scoring` set and `run(idx, pos, scorings)`
    called with the call's left-padded ids and positions `(B, T)` (`-1` at pads; row `r` at `n_r, ...`); `run`
    runs the model (sets each `Scoring.hidden` for KVzip+) and leaves the caches' positions as they were.
    `proj_weights`: each layer's output projection `(n_embd, n_head x D)` (read for KVzip+ only)."""
    rows = [p.tolist() for p in prompts]
    if len(rows) != caches[0].shape.batch_size:
        raise ValueError(f"kvzip: {len(rows)} prompts for caches of batch size {caches[0].shape.batch_size}")
    options = caches[0].options
    size = options.chunk_size
    starts = [list(range(min(prefix_length, len(r)), len(r), size)) for r in rows]
    device = caches[0].positions.device
    for cache in caches:
        cache.start_scores()
    try:
        for i in range(max(len(s) for s in starts)):
            calls, bounds = [], []
            for ctx, row_starts in zip(rows, starts, strict=True):
                if i >= len(row_starts):
                    calls.append([])
                    bounds.append((0, 0))
                    continue
                start = row_starts[i]
                end = min(start + size, len(ctx))
                calls.append(_row_call(ctx, start, end, i == 0, repeat, row_starts[i - 1] if i else 0))
                bounds.append((start, end))
            idx, pos = _pad_calls(calls, [len(r) for r in rows], device)
            start_t = torch.tensor([b[0] for b in bounds], device=device)
            end_t = torch.tensor([b[1] for b in bounds], device=device)
            sink_t = start_t.clamp(max=options.n_sink)
            scorings = [Scoring(start_t, end_t, sink_t, w if options.kvzip_plus else None) for w in proj_weights]
            for cache, scoring in zip(caches, scorings, strict=True):
                cache.begin_scoring(scoring)
            run(idx, pos, scorings)
    finally:
        for cache in caches:
            cache.begin_scoring(None)


def _pad_calls(calls: list[list[int]], lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `(B, T)` ids and positions (row `r`'s call at `lengths[r], ...`; `-1` at pads)."""
    t = max(max(len(c) for c in calls), 1)
    idx = torch.zeros(len(calls), t, dtype=torch.long, device=device)
    pos = torch.full_like(idx, -1)
    for r, (call, n) in enumerate(zip(calls, lengths, strict=True)):
        if call:
            idx[r, t - len(call) :] = torch.tensor(call, dtype=torch.long, device=device)
            pos[r, t - len(call) :] = torch.arange(n, n + len(call), device=device)
    return idx, pos


def kvzip_compress(model: GPT, prompts: Sequence[torch.Tensor], repeat: RepeatPrompt, prefix_length: int = 0) -> None:
    """`kvzip_score`, then every layer compressed to its share of the budget (`compress_kvzip`)."""
    kvzip_score(model, prompts, repeat, prefix_length)
    compress_kvzip([policy.cache for policy in _kvzip_caches(model)])
