"""Evaluation of one-shot policies with one prefill per sample batch and policy, as kvpress evaluates presses.

A one-shot cache keeps every prompt token until it compresses, and the budget matters only then: the
prefill (and, for `kvzip`, the context-reconstruction pass, whose scores do not depend on the budget)
is the same for every budget. So each batch of prompts is prefilled once per policy through caches of
that policy (`cache_length` = the longest prompt + answer), the caches' state is taken
(`litkv.states.state.snapshot`), and for every budget the state is given back into caches whose config
has that budget (`restore`), compressed (`end_prefill`, or `compress_kvzip`), and the answer decoded
greedily.

What is compressed (`COMPRESS`): `"context"` (kvpress's pipeline, the default of `litkv evaluate`): the
prompts are contexts, compressed alone (kvzip reconstructs the context only), and each row's question is
then fed into the compressed cache, which keeps every question token, before the answer is decoded;
`"prompt"`: the whole prompt, question included, is compressed. The answers are those of a separate run per
(policy, budget) (tests/eval/test_oneshot.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from litkv.inference.generate import decode_greedy, pad_prompts
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_score
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.kvzip import KVzipKVCache, compress_kvzip
from litkv.kvcache.registry import get_kv_cache_class
from litkv.modeling.model import GPT
from litkv.modeling.runner import run_chunks
from litkv.states.state import CacheState, restore, snapshot

__all__ = ["COMPRESS", "KVZIP", "check_compress", "is_one_shot", "oneshot_answers"]

KVZIP = "kvzip"
#: What a one-shot evaluation compresses: the context alone (the question fed after, uncompressed; kvpress's
#: pipeline) or the whole prompt, question included.
COMPRESS = ("context", "prompt")


def check_compress(compress: object) -> str:
    """`compress` if it is one of `COMPRESS`, else ValueError naming what was given."""
    if compress not in COMPRESS:
        raise ValueError(
            f"oneshot_compress must be 'context' (compress the context, then feed the question uncompressed, as "
            f"kvpress does) or 'prompt' (compress the whole prompt, question included), got {compress!r}"
        )
    return str(compress)


def is_one_shot(policy: str, options: Mapping[str, Any] | None) -> bool:
    """Whether `evaluate` runs `policy` one-shot (at each budget, one prefill shared by all budgets): its
    options say `mode: one-shot`, or its class does without a `mode` (`kvzip`, a `one_shot(policy)` class)."""
    defaults = {f.name: f.default for f in dataclasses.fields(get_kv_cache_class(policy).Options)}
    return (options or {}).get("mode", defaults.get("mode")) == "one-shot"


def _with_config(state: CacheState, config: KVCacheConfig) -> CacheState:
    layers = [dataclasses.replace(layer, config=config) for layer in state.layers]
    return CacheState(layers, state.last_pos, state.fingerprint, state.dtype, state.token_ids, state.last_hidden)


@torch.inference_mode()
def oneshot_answers(
    model: GPT,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    configs: Mapping[int, KVCacheConfig],
    repeat: RepeatPrompt | None = None,
    on_answer: Callable[[int], None] | None = None,
    questions: Sequence[torch.Tensor] | None = None,
) -> dict[int, list[torch.Tensor]]:
    """Greedy answers to `prompts` for each budget's one-shot config, from one prefill.

    Args:
        model: the GPT.
        prompts: 1-D token tensors (one batch, left-padded here): the whole prompts, or with `questions`
            their contexts (what is compressed).
        max_new_tokens: tokens decoded per prompt.
        configs: budget -> config of one policy in mode `one-shot` (they differ in `budget` only); their
            `cache_length` must hold each prompt, its question and its answer.
        repeat: the reconstruction prompt (`kvzip` only).
        on_answer: called with the budget after each budget's answers (a progress bar).
        questions: per prompt, its question `(m_r,)` (non-empty), fed at the positions after its context
            once the context is compressed; none: the prompts are compressed whole.

    Returns:
        budget -> the new tokens of each prompt.
    """
    if not configs:
        raise ValueError("oneshot_answers needs at least one (budget, config)")
    first = next(iter(configs.values()))
    kvzip = first.policy_class is KVzipKVCache or issubclass(first.policy_class, KVzipKVCache)
    if kvzip and repeat is None:
        raise ValueError("kvzip needs its reconstruction prompt (repeat=RepeatPrompt.build(tokenizer, template))")
    device = model.lm_head.weight.device
    idx, pos = pad_prompts(list(prompts), device)
    after = None if questions is None else _question_batch(questions, pos[:, -1] + 1, len(prompts), device)
    plan = ChunkPlan.of(first)
    out: dict[int, list[torch.Tensor]] = {}
    with model.kv_caches_attached(first, idx.shape[0]):
        hidden = run_chunks(model, idx, pos, plan, lm_head=False, last_only=True)
        if kvzip:
            kvzip_score(model, prompts, repeat, repeat.prefix_length)  # type: ignore[union-attr]
        state = snapshot(model)
        for budget, config in configs.items():
            restore(model, _with_config(state, config))
            if kvzip:
                compress_kvzip(list(model.caches))  # type: ignore[arg-type]
            else:
                model.caches.end_prefill()
            last, next_pos = hidden, pos[:, -1] + 1
            if after is not None:  # the question, into the compressed cache (which keeps all of it)
                last = run_chunks(model, after[0], after[1], plan, lm_head=False, last_only=True)
                next_pos = after[1][:, -1] + 1
            out[budget] = decode_greedy(model, last, next_pos, max_new_tokens)
            if on_answer is not None:
                on_answer(budget)
    return out


def _question_batch(
    questions: Sequence[torch.Tensor], starts: torch.Tensor, rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `(B, M)` question ids and their positions (row `r` from `starts[r]`, `-1` at pads)."""
    if len(questions) != rows:
        raise ValueError(f"{len(questions)} questions for {rows} prompts: give one question per prompt")
    idx, pos = pad_prompts(list(questions), device)
    return idx, torch.where(pos >= 0, pos + starts[:, None], pos)
