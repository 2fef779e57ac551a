"""Chunked forward and batched generation through per-layer KV caches (library code, no CLI)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from litkv.core.validation import is_int, is_number, require_finite_logits, require_int
from litkv.modeling.config import KVCacheConfig
from litkv.modeling.model import GPT, check_integer_tensor, kv_cache_configs
from litkv.modeling.runner import ChunkPlan, run_chunks
from litkv.states.prefix import PrefixCache

__all__ = ["check_sampling", "decode_greedy", "forward_chunked", "generate", "sample", "pad_prompts"]

KVCacheSpec = KVCacheConfig | Sequence[KVCacheConfig]


def forward_chunked(
    model: GPT, idx: torch.Tensor, kv_cache: KVCacheSpec, input_pos: torch.Tensor | None = None
) -> torch.Tensor:
    """Run sequences chunk by chunk with fresh caches in place; differentiable with plain autograd.

    Each row is chunked from its own first token (`litkv.modeling.runner`), so its logits do not depend on
    its batch-mates.

    Args:
        model: the GPT.
        idx: `(B, T)` token ids.
        kv_cache: one config for all layers, or one per layer; `ChunkPlan.of(kv_cache)` gives the chunks.
        input_pos: `(B, T)` positions (`-1` for left padding); default `0..T-1` for every row.

    Returns:
        `(B, T, padded_vocab_size)` logits of every position.
    """
    kv_cache_configs(kv_cache)  # TypeError for anything but configs
    check_integer_tensor("idx", idx)
    if idx.dim() != 2:
        raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
    b, t = idx.shape
    if input_pos is None:
        input_pos = torch.arange(t, device=idx.device).expand(b, t)
    check_integer_tensor("input_pos", input_pos, what="token positions")
    if input_pos.shape != idx.shape:
        raise ValueError(f"input_pos must have the shape of idx {tuple(idx.shape)}, got {tuple(input_pos.shape)}")
    with model.kv_caches_attached(kv_cache, b):
        return run_chunks(model, idx, input_pos, ChunkPlan.of(kv_cache))


def pad_prompts(prompts: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts into one batch.

    Returns:
        `idx` `(B, T_max)` (pads are token 0) and `input_pos` `(B, T_max)` (`-1` at pads).
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError(f"prompts must be a non-empty list of 1-D token tensors, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        check_integer_tensor(f"prompt {i}", p)
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-D tensor of token ids, got {p!r:.80}")
    t_max = max(p.numel() for p in prompts)
    idx = torch.zeros(len(prompts), t_max, dtype=torch.long, device=device)
    pos = torch.full_like(idx, -1)
    for i, p in enumerate(prompts):
        n = p.numel()
        idx[i, t_max - n :] = p.to(device=device, dtype=torch.long)
        pos[i, t_max - n :] = torch.arange(n, device=device)
    return idx, pos


TEMPERATURE_FLOOR = 1e-6
"""Below it a temperature samples greedily: float32 logits then only break ties within their own
rounding, and a temperature that underflows in float32 (1e-300, 5e-324) would divide by zero."""


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next tokens `(B,)` from `(B, V)` logits: greedy at a temperature below `TEMPERATURE_FLOOR` (0
    included), else top-k/top-p sampling in float32 with the row's largest logit shifted to 0 before the
    division (so a huge temperature or a tiny top-p never makes a NaN; the nucleus keeps at least the top
    token). A NaN logit is never drawn; a row with no finite logit falls back to its argmax."""
    _check_sampling_options(temperature, top_k, top_p)
    if temperature < TEMPERATURE_FLOOR:
        return logits.argmax(dim=-1)
    x = logits.float().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    top = x.amax(dim=-1, keepdim=True)
    finite = torch.isfinite(top)
    if top_k is not None:  # on the logits: a huge temperature makes ties of every scaled logit
        kth = torch.topk(x, min(top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    x = ((x - torch.where(finite, top, 0.0)) / temperature).nan_to_num(nan=float("-inf"))  # <= 0, no NaN
    if top_p is not None and top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        remove_sorted = (p.cumsum(dim=-1) - p) >= top_p
        remove_sorted[..., 0] = False  # a top_p that rounds to 0 in float32 still keeps the top token
        x = x.masked_fill(torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted), float("-inf"))
    # Exponential race (Gumbel-max in another form): argmax of p / E with E ~ Exp(1) draws from p, with
    # device ops only (torch.multinomial reads the host), so a sampling decode step never syncs.
    probs = torch.softmax(x, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    drawn = (probs / race).argmax(dim=-1)
    return torch.where(finite.squeeze(-1), drawn, logits.argmax(dim=-1))


def _check_sampling_options(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError/TypeError naming the value for a NaN/inf/negative temperature, bad top_k or top_p."""
    if not is_number(temperature):
        raise TypeError(f"temperature must be a float >= 0, got {type(temperature).__name__} {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite float >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None:
        if not is_int(top_k):
            raise TypeError(f"top_k must be an int >= 1 or None, got {type(top_k).__name__} {top_k!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None:
        if not is_number(top_p):
            raise TypeError(f"top_p must be a float in (0, 1] or None, got {type(top_p).__name__} {top_p!r}")
        if not 0.0 < top_p <= 1.0:  # also refuses NaN
            raise ValueError(f"top_p must be a float in (0, 1] or None, got {top_p!r}")


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """The checks `generate` makes of its options, for callers that want them before loading a model."""
    require_int("max_new_tokens", max_new_tokens, 0)
    _check_sampling_options(temperature, top_k, top_p)


def _check_dense_room(kv_cache: KVCacheSpec, prompt_len: int, max_new_tokens: int) -> None:
    configs = kv_cache_configs(kv_cache) or [kv_cache]
    needed = prompt_len + max(max_new_tokens - 1, 0)
    for cfg in configs:
        limit = cfg.policy_class.max_tokens(cfg)
        if limit is not None and needed > limit:
            raise ValueError(
                f"a {cfg.policy} cache of cache_length={cfg.cache_length} is smaller than prompt + new tokens "
                f"({prompt_len} + {max_new_tokens}), at most {limit} tokens; raise cache_length or use a "
                "policy that evicts, e.g. policy='h2o' or 'last-recent'"
            )


@torch.inference_mode()
def generate(
    model: GPT,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    kv_cache: KVCacheSpec,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    generator: torch.Generator | None = None,
    on_tokens: Callable[[torch.Tensor], None] | None = None,
    progress: bool = False,
    prefix_cache: PrefixCache | None = None,
    compile: bool = False,
) -> list[torch.Tensor]:
    """Generate from a batch of prompts of different lengths.

    Prompts are left-padded; pad tokens get position `-1` and are never attended, stored or scored.
    The prefill runs in chunks cut from each prompt's own first token (`litkv.modeling.runner`: a row's tokens
    do not depend on its batch-mates), then one token per step.

    Args:
        model: the GPT.
        prompts: list of 1-D token tensors.
        max_new_tokens: tokens to generate per prompt.
        kv_cache: cache config for all layers (or one per layer).
        temperature, top_k, top_p, generator: sampling (temperature 0: greedy).
        stop_tokens: a row stops after producing one of these (it is included in the output).
        on_tokens: called after each step with the step's new tokens `(B,)`, for streaming.
        progress: show a progress bar over the prefill chunks.
        prefix_cache: a `litkv.PrefixCache`: each row restores its longest stored prompt prefix and
            prefills the rest alone (its tokens are those of the prompt alone); new blocks are stored.
        compile: run the decode steps through `torch.compile` (static shapes: every step attends all
            `cache_length` slots; compiled once per model and cache shape, then reused).

    Returns:
        Per prompt, the new tokens `(n_i,)` with `n_i <= max_new_tokens`.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {type(compile).__name__} {compile!r}")
    kv_cache_configs(kv_cache)  # TypeError for anything but configs
    device = model.lm_head.weight.device
    idx, input_pos = pad_prompts(prompts, device)
    b, t = idx.shape
    if max_new_tokens == 0:
        return [idx.new_empty(0) for _ in range(b)]
    _check_dense_room(kv_cache, t, max_new_tokens)
    plan = ChunkPlan.of(kv_cache)
    if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
        raise TypeError(f"prefix_cache must be a litkv.PrefixCache or None, got {type(prefix_cache).__name__}")
    with model.kv_caches_attached(kv_cache, b):
        next_pos = input_pos[:, -1] + 1
        if prefix_cache is not None:  # litkv.states.prefix: restore stored prefixes, prefill the rest row by row
            hidden, next_pos = prefix_cache.prefill(model, prompts, kv_cache, progress)
        else:
            hidden = run_chunks(model, idx, input_pos, plan, lm_head=False, last_only=True, progress=progress)
        model.caches.end_prefill()  # one-shot policies compress the prompt here
        return _decode(
            model,
            hidden,
            next_pos,
            max_new_tokens,
            stop_tokens,
            lambda logits: sample(logits, temperature, top_k, top_p, generator),
            on_tokens,
            compile,
        )


# Without a streaming callback (which reads every step's tokens anyway), whether all rows have
# stopped is read from the device only every this many steps.
STOP_CHECK_INTERVAL = 8


def _decode(
    model: GPT,
    hidden: torch.Tensor,
    next_pos: torch.Tensor,
    max_new_tokens: int,
    stop_tokens: Sequence[int],
    pick: Callable[[torch.Tensor], torch.Tensor],
    on_tokens: Callable[[torch.Tensor], None] | None,
    compile: bool = False,
) -> list[torch.Tensor]:
    """Decode loop after the prefill. `hidden`: `(B, T, n_embd)` of the last chunk; `next_pos`: `(B,)`.

    The inputs of every step are valid by construction (sampled tokens, the next positions), so the
    steps run under `model.trusted_inputs`: no step reads a tensor on the host, except every
    `STOP_CHECK_INTERVAL` steps to see whether all rows have stopped (every step with `on_tokens`).
    """
    stops = torch.tensor(list(stop_tokens), dtype=torch.long, device=hidden.device)
    logits = model.logits(hidden[:, -1])
    if not bool(torch.isfinite(logits).all()):  # the one host sync of this check, after the prefill
        raise ValueError(
            "the model produced NaN/inf logits after the prefill; check the checkpoint's weights "
            "(or use a wider precision)"
        )
    tokens = pick(logits)
    steps = [tokens]
    done = torch.isin(tokens, stops)
    if on_tokens is not None:
        on_tokens(tokens)
    interval = 1 if on_tokens is not None else STOP_CHECK_INTERVAL
    last_position = int(next_pos.max()) + max_new_tokens
    finite = torch.ones((), dtype=torch.bool, device=hidden.device)  # read on the host only where done is
    with model.trusted_inputs(last_position), _decode_steps(model, compile) as step:
        for i in range(max_new_tokens - 1):
            if len(stop_tokens) and i % interval == 0:
                _check_finite(finite, i + 1)
                if bool(done.all()):
                    break
            logits = step(tokens[:, None], next_pos[:, None])
            finite = finite & torch.isfinite(logits).all()
            tokens = pick(logits)
            next_pos = next_pos + 1
            steps.append(tokens)
            done = done | torch.isin(tokens, stops)
            if on_tokens is not None:
                _check_finite(finite, i + 2)
                on_tokens(tokens)
    _check_finite(finite, len(steps))
    out = torch.stack(steps, dim=1)
    results = []
    for row in out:
        hits = torch.isin(row, stops).nonzero()
        results.append(row[: int(hits[0]) + 1] if len(hits) else row)
    return results


def _check_finite(finite: torch.Tensor, step: int) -> None:
    """ValueError when a decode step's logits held NaN/inf (`finite` is a bool scalar; one host read): in a
    float16 model, an overflow; no token of such a step is handed out."""
    require_finite_logits(bool(finite), step)


@contextmanager
def _decode_steps(model: GPT, compile: bool) -> Iterator[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The decode step `(tokens (B, 1), positions (B, 1)) -> logits (B, V)`: eager, or compiled with the
    caches in `static_shapes` mode (their host counters advanced here, outside the compiled code).

    Compiled on CUDA, the step is one CUDA graph (`GPT.compiled_decode_step`: inductor's
    "reduce-overhead"): the caches' tensors and the RoPE table are marked static (written in place, never
    copied), each call starts a new graph step, and the logits it returns live until the next call."""
    if not compile:
        yield lambda tokens, positions: model(tokens, positions)[:, -1]
        return
    caches = model.caches
    compiled = model.compiled_decode_step()
    on_cuda = model.lm_head.weight.device.type == "cuda"
    model.mark_static_addresses()

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if on_cuda:
            torch.compiler.cudagraph_mark_step_begin()
        logits = compiled(tokens, positions)
        caches.advance(tokens.shape[1])
        return logits

    caches.static_shapes = True
    try:
        yield step
    finally:
        caches.static_shapes = False


@torch.inference_mode()
def decode_greedy(
    model: GPT, hidden: torch.Tensor, next_pos: torch.Tensor, max_new_tokens: int, stop_tokens: Sequence[int] = ()
) -> list[torch.Tensor]:
    """Greedy decoding through the attached caches after a prefill the caller ran (and compressed): `hidden`
    `(B, T, n_embd)` of its last call (`run_chunks(..., lm_head=False)`), `next_pos` `(B,)` the rows' next
    positions. The tokens are those `generate` gives after the same prefill."""
    require_int("max_new_tokens", max_new_tokens, 1)
    return _decode(model, hidden, next_pos, max_new_tokens, stop_tokens, lambda logits: logits.argmax(dim=-1), None)
