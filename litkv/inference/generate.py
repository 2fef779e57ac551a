"""Chunked forward and the one `generate` (token-id or segment prompts, one decode loop) through per-layer KV
caches (library code, no CLI)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager

import torch

from litkv.core.validation import require_finite_logits, require_int
from litkv.inference.blocks import Segment, check_recompute, prefill_segments
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_compress
from litkv.inference.sampling import Sampling
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.kvzip import KVzipKVCache
from litkv.modeling.memory import check_memory
from litkv.modeling.model import GPT, check_integer_tensor, kv_cache_configs
from litkv.modeling.runner import run_chunks
from litkv.states.block_store import BlockStore
from litkv.states.prefix import PrefixCache

__all__ = ["Prompt", "decode_greedy", "decode_tokens", "forward_chunked", "generate", "pad_prompts"]

KVCacheSpec = KVCacheConfig | Sequence[KVCacheConfig]

_BUSY_LOCK = threading.Lock()
_BUSY: set[int] = set()  # id() of the models a generate runs on now


@contextmanager
def _one_generate(model: GPT) -> Iterator[None]:
    """Mark `model` as running a generate for the block; a second one (another thread, or an `on_tokens`
    callback) is refused naming the model: its caches are the model's own, one run's at a time."""
    with _BUSY_LOCK:
        if id(model) in _BUSY:
            name = getattr(getattr(model, "config", None), "name", "") or type(model).__name__
            raise RuntimeError(
                f"model {name!r} is busy: another generate is running on it (another thread?); a model runs "
                "one generate at a time: serialise the calls (a threading.Lock) or load one model per thread"
            )
        _BUSY.add(id(model))
    try:
        yield
    finally:
        with _BUSY_LOCK:
            _BUSY.discard(id(model))


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


Prompt = torch.Tensor | Sequence[Segment]
"""A prompt: `(T,)` token ids, or a list of `Segment`s (some of them KV blocks, `litkv.inference.blocks`)."""


@torch.inference_mode()
def generate(
    model: GPT,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    kv_cache: KVCacheSpec,
    sampling: Sampling | None = None,
    *,
    on_tokens: Callable[[torch.Tensor], None] | None = None,
    progress: bool = False,
    prefix_cache: PrefixCache | None = None,
    block_store: BlockStore | None = None,
    recompute: float = 0.0,
    compile: bool = False,
    kvzip_repeat: RepeatPrompt | None = None,
) -> list[torch.Tensor]:
    """Generate from a batch of prompts of different lengths, each token ids or segments (KV blocks).

    Token-id prompts are left-padded (pads get position `-1` and are never attended, stored or scored)
    and prefilled together, in chunks cut from each prompt's own first token (`litkv.modeling.runner`: a
    row's tokens do not depend on its batch-mates). When a prompt is a list of segments, each prompt is
    prefilled alone (blocks spliced from `block_store`, `litkv.inference.blocks.prefill_segments`) and its
    cache row copied into the batch's; a row's tokens are then those of its prompt alone up to the
    rounding of batched matmuls. Then one token per row and step (`_decode`).

    Args:
        model: the GPT.
        prompts: per row, `(T_i,)` token ids or a non-empty list of `Segment`s.
        max_new_tokens: tokens to generate per prompt.
        kv_cache: cache config for all layers (or one per layer; one for all with several segment prompts).
        sampling: how tokens are picked and when a row stops (`Sampling`; default greedy, no stop token).
        on_tokens: called after each step with the step's new tokens `(B,)`, for streaming.
        progress: show a progress bar over the prefill chunks of token-id prompts.
        prefix_cache: with token-id prompts, a `litkv.PrefixCache`: each row restores its longest stored
            prompt prefix and prefills the rest alone (its tokens are those of the prompt alone); new
            blocks are stored.
        block_store: with segment prompts, where blocks' KV is kept (a `litkv.BlockStore`, shared by the
            rows; default: one that keeps nothing).
        recompute: with segment prompts, the fraction of each spliced block's tokens recomputed in
            context (0: pure splice; 1: a normal prefill; docs/blocks.md).
        compile: run the decode steps through `torch.compile` (static shapes: every step attends all
            `cache_length` slots; compiled once per model and cache shape, then reused).
        kvzip_repeat: with `kvzip` caches (needed then), KVzip's reconstruction prompt
            (`RepeatPrompt.build(tokenizer, template)`, in the chat template the prompts are in): after the
            prefill the model repeats each prompt from its caches, and the pairs that reconstruction attends
            least are evicted down to the budget (`litkv.inference.kvzip_reconstruction.kvzip_compress`),
            as `litkv evaluate` does with `--oneshot_compress prompt`.

    Returns:
        Per prompt, the new tokens `(n_i,)` with `n_i <= max_new_tokens`.
    """
    sampling = _sampling(sampling)
    require_int("max_new_tokens", max_new_tokens, 0)
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {type(compile).__name__} {compile!r}")
    kv_cache_configs(kv_cache)  # TypeError for anything but configs
    rows = _segment_rows(prompts)
    _check_stores(rows, kv_cache, prefix_cache, block_store, recompute)
    kvzip = _check_kvzip(kv_cache, kvzip_repeat, rows is not None or prefix_cache is not None)
    device = model.lm_head.weight.device
    if rows is None:
        idx, input_pos = pad_prompts(prompts, device)  # type: ignore[arg-type]
        lengths, longest = input_pos[:, -1] + 1, idx.shape[1]
    else:
        sizes = [sum(int(s.ids.numel()) for s in row) for row in rows]
        lengths, longest = torch.tensor(sizes, device=device), max(sizes)
    if max_new_tokens == 0:
        return [torch.empty(0, dtype=torch.long, device=device) for _ in prompts]
    _check_dense_room(kv_cache, longest, max_new_tokens)
    with _one_generate(model), model.kv_caches_attached(kv_cache, len(prompts)):
        if rows is not None:
            store = BlockStore(0) if block_store is None else block_store
            hidden = _prefill_rows(model, rows, kv_cache, store, recompute)
        elif prefix_cache is not None:  # litkv.states.prefix: restore stored prefixes, prefill the rest row by row
            hidden, lengths = prefix_cache.prefill(model, prompts, kv_cache, progress)  # type: ignore[arg-type]
        else:
            plan = ChunkPlan.of(kv_cache)
            hidden = run_chunks(model, idx, input_pos, plan, lm_head=False, last_only=True, progress=progress)
        if kvzip:  # the reconstruction pass, then every layer compressed at once
            kvzip_compress(model, list(prompts), kvzip_repeat, kvzip_repeat.prefix_length)  # type: ignore[arg-type, union-attr]
        elif rows is None or len(rows) == 1:
            model.caches.end_prefill()  # one-shot policies compress the prompt here (segment rows: alone)
        return _decode(model, hidden, lengths, max_new_tokens, sampling, on_tokens, compile)


def _sampling(sampling: Sampling | None) -> Sampling:
    """`sampling`, or greedy decoding without stop tokens (`None`); TypeError for anything else."""
    if sampling is not None and not isinstance(sampling, Sampling):
        raise TypeError(
            f"sampling must be a litkv.Sampling (temperature, top_k, top_p, stop tokens, generator) or None, "
            f"got {type(sampling).__name__} {sampling!r:.80}"
        )
    return Sampling() if sampling is None else sampling


def _check_kvzip(kv_cache: KVCacheSpec, repeat: RepeatPrompt | None, stored: bool) -> bool:
    """Whether `kv_cache` is `kvzip`'s (then `repeat` is needed, and token-id prompts without stores)."""
    configs = kv_cache_configs(kv_cache) or [kv_cache]
    kinds = [issubclass(cfg.policy_class, KVzipKVCache) for cfg in configs]  # type: ignore[union-attr]
    if not any(kinds):
        return False
    if not all(kinds):
        raise ValueError("kvzip compresses every layer at once: give it to every layer, not to some")
    if repeat is None:
        raise ValueError(
            "kvzip needs its reconstruction prompt: generate(..., kvzip_repeat=RepeatPrompt.build(tokenizer, "
            "template)) (litkv.inference.kvzip_reconstruction)"
        )
    if not isinstance(repeat, RepeatPrompt):
        raise TypeError(f"kvzip_repeat must be a RepeatPrompt, got {type(repeat).__name__}")
    if stored:
        raise ValueError(
            "kvzip reconstructs token-id prompts prefilled in one batch: not with segments or prefix_cache"
        )
    return True


def _segment_rows(prompts: Sequence[Prompt]) -> list[list[Segment]] | None:
    """None when every prompt is token ids; else every prompt as segments (token ids: one text segment)."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError(f"prompts must be a non-empty list of prompts (token ids or segments), got {prompts!r:.80}")
    if all(isinstance(p, torch.Tensor) for p in prompts):
        return None
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            rows.append([Segment(p)])
        elif isinstance(p, (list, tuple)) and p and all(isinstance(s, Segment) for s in p):
            rows.append(list(p))
        else:
            raise TypeError(
                f"prompt {i} must be a 1-D tensor of token ids or a non-empty list of litkv.Segment, got {p!r:.80}"
            )
    return rows


def _check_stores(
    rows: list[list[Segment]] | None, kv_cache: KVCacheSpec, prefix_cache: object, block_store: object, recompute: float
) -> None:
    """TypeError/ValueError for a store that is not one, or one given with prompts it does not serve."""
    if rows is not None and len(rows) > 1 and not isinstance(kv_cache, KVCacheConfig):
        raise TypeError(f"kv_cache must be one KVCacheConfig for every layer, got {type(kv_cache).__name__}")
    if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
        raise TypeError(f"prefix_cache must be a litkv.PrefixCache or None, got {type(prefix_cache).__name__}")
    if block_store is not None and not isinstance(block_store, BlockStore):
        raise TypeError(f"block_store must be a litkv.BlockStore or None, got {type(block_store).__name__}")
    check_recompute(recompute)
    if rows is not None and prefix_cache is not None:
        raise ValueError("prefix_cache serves token-id prompts; for prompts of segments give block_store")


def _prefill_rows(
    model: GPT, rows: list[list[Segment]], kv_cache: KVCacheSpec, store: BlockStore, recompute: float
) -> torch.Tensor:
    """Prefill each row's segments alone into the attached caches; `(B, 1, n_embd)` last hidden states.

    One row is prefilled in place; several are each prefilled into caches of one row (compressed there:
    `end_prefill`) and copied into their row of the batch's, whose host counters become the fullest row's
    (an emptier row's slots are masked)."""
    batch = model.caches
    if len(rows) == 1:
        return prefill_segments(model, rows[0], kv_cache, store, recompute)[0][:, None]
    hidden, filled = [], [0] * len(batch.policy_caches)
    try:
        for row, segments in enumerate(rows):
            with model.kv_caches_attached(kv_cache, 1) as alone:
                hidden.append(prefill_segments(model, segments, kv_cache, store, recompute)[0])
                alone.end_prefill()
                batch.copy_row(row, alone, 0)
                filled = [max(f, c.num_filled) for f, c in zip(filled, alone.policy_caches, strict=True)]
    finally:
        model.set_kv_caches(batch)
    for cache, count in zip(batch.policy_caches, filled, strict=True):
        cache.num_filled = count
    return torch.cat(hidden)[:, None]


# Without a streaming callback (which reads every step's tokens anyway), whether all rows have
# stopped is read from the device only every this many steps.
STOP_CHECK_INTERVAL = 8


def _decode(
    model: GPT,
    hidden: torch.Tensor,
    next_pos: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    on_tokens: Callable[[torch.Tensor], None] | None,
    compile: bool = False,
) -> list[torch.Tensor]:
    """`decode_tokens` run to the end: per row, its tokens up to and including its first stop token.
    `hidden`: `(B, T, n_embd)` of the last chunk; `next_pos`: `(B,)`. Without `on_tokens` (which reads
    every step's tokens anyway), whether all rows have stopped is read every `STOP_CHECK_INTERVAL` steps."""
    interval = 1 if on_tokens is not None else STOP_CHECK_INTERVAL
    steps = []
    loop = decode_tokens(model, hidden, next_pos, max_new_tokens, sampling, compile=compile, check_every=interval)
    with closing(loop):  # a callback that raises leaves the loop's trusted_inputs at once
        for tokens in loop:
            steps.append(tokens)
            if on_tokens is not None:
                on_tokens(tokens)
    stops = torch.tensor(list(sampling.stop_tokens), dtype=torch.long, device=hidden.device)
    out = torch.stack(steps, dim=1)
    results = []
    for row in out:
        hits = torch.isin(row, stops).nonzero()
        results.append(row[: int(hits[0]) + 1] if len(hits) else row)
    return results


def decode_tokens(
    model: GPT,
    hidden: torch.Tensor,
    next_pos: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    *,
    compile: bool = False,
    check_every: int = 1,
    feed_last: bool = False,
) -> Iterator[torch.Tensor]:
    """The decode loop (`generate`'s and a chat reply's): yields each step's tokens `(B,)`, after a prefill
    that left `hidden` `(B, T, n_embd)` (its last position's is used) and the rows' next positions `next_pos`
    `(B,)`, through the attached caches; picked by `sampling` (`Sampling.picker`), until every row has
    produced one of its stop tokens or `max_new_tokens` steps.

    `feed_last=False` (`generate`): a step's tokens are yielded before they are fed, and the last step's
    are never fed. `feed_last=True` (a chat reply): every token is fed before it is yielded (it is in the
    caches when the caller sees it; the caller may stop between steps).

    The inputs of every step are valid by construction (picked tokens, the next positions), so the steps
    run under `model.trusted_inputs`: no step reads a tensor on the host, except every `check_every` steps,
    whether all rows have stopped and their logits were finite. With `check_every=1` a token is yielded only
    after its logits were checked finite; else the check of the last ones runs when the loop ends. ValueError
    for NaN/inf logits (after the prefill: the weights; at a decode step: an overflow).
    """
    if max_new_tokens == 0:
        return
    pick, device = sampling.picker(hidden.device), hidden.device
    stops = torch.tensor(list(sampling.stop_tokens), dtype=torch.long, device=device)
    logits = model.logits(hidden[:, -1])
    if not bool(torch.isfinite(logits).all()):  # the one host sync of this check, after the prefill
        raise ValueError(
            "the model produced NaN/inf logits after the prefill; check the checkpoint's weights "
            "(or use a wider precision)"
        )
    last_position = int(next_pos.max()) + max_new_tokens
    table = model.rope_table_bytes(last_position + 1)
    what = f"the RoPE table of positions up to {last_position}"
    check_memory(table, device, "max_new_tokens", what, "lower max_new_tokens")
    # whether the logits picked from so far were finite; read on the host only where `done` is
    finite = torch.ones((), dtype=torch.bool, device=device)
    with model.trusted_inputs(last_position, no_pads=True), _decode_steps(model, compile) as step:
        tokens = pick(logits)
        done = torch.isin(tokens, stops)
        if feed_last:
            logits, next_pos = step(tokens[:, None], next_pos[:, None]), next_pos + 1
        yield tokens
        for n in range(2, max_new_tokens + 1):  # n: the number of the token picked in this step
            if len(stops) and (n - 2) % check_every == 0:
                _check_finite(finite, n - 1)
                if bool(done.all()):
                    return
            if not feed_last:
                logits, next_pos = step(tokens[:, None], next_pos[:, None]), next_pos + 1
            finite = finite & torch.isfinite(logits).all()
            tokens = pick(logits)
            done = done | torch.isin(tokens, stops)
            if check_every == 1:
                _check_finite(finite, n)
            if feed_last:
                logits, next_pos = step(tokens[:, None], next_pos[:, None]), next_pos + 1
            yield tokens
    _check_finite(finite, max_new_tokens)


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
    return _decode(model, hidden, next_pos, max_new_tokens, Sampling(stop_tokens=stop_tokens), None)
