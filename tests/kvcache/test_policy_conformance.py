"""What every KV cache policy must do, checked on every registered policy and on the docs examples.

The policies are discovered, not listed: `known_policies()` at collection time (built-ins and anything
registered by then), plus the example modules of docs/custom_policy.md by their `"module:Class"` path.
A new policy gets these checks by registering itself. Each policy runs on float and int4 storage:

- a left-padded batch of ragged prompts gives each row the logits and greedy tokens it gets alone;
- with room for every token, the policy is dense attention, whatever the chunking;
- an evicting run keeps exactly `cache_length` distinct, already seen tokens per (row, KV head), and
  the sinks when the policy has a `sinks` option;
- the gradient engine (`chunked_loss_backward`) gives plain autograd's gradients through the policy.

Policies with a token limit (`max_tokens`, i.e. ones that do not evict) get a cache long enough for the
sequence. A policy that stores something else than the storage asked for (qh2o: int4 when asked for
float) runs on what it stores.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    evicts_alone,
    forward_depth,
    max_diff,
    random_tokens,
    rounding_bound,
)

from litkv import GPT, KVCacheConfig, chunked_loss_backward, forward_chunked, generate
from litkv.inference.generate import pad_prompts
from litkv.kvcache import CacheShape, KVCache, get_kv_cache_class, known_policies
from litkv.kvcache.config import ChunkPlan
from litkv.kvcache.machine import SlotMachine

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "docs" / "examples"
if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))
EXAMPLE_POLICIES = ("value_norm_policy:ValueNormKVCache", "decayed_h2o_policy:DecayedH2OKVCache")


def _discover() -> list[str]:
    """Registered names (minus the path-given ones, should they be registered already), then the docs
    examples' paths and those in `LITKV_CONFORMANCE_POLICIES` (comma-separated `"module:Class"`)."""
    extra = [path.strip() for path in os.environ.get("LITKV_CONFORMANCE_POLICIES", "").split(",") if path.strip()]
    paths = list(EXAMPLE_POLICIES) + [path for path in extra if path not in EXAMPLE_POLICIES]
    by_path = {get_kv_cache_class(path) for path in paths}
    return [name for name in known_policies() if get_kv_cache_class(name) not in by_path] + paths


POLICIES = _discover()
EVICTING = [policy for policy in POLICIES if evicts_alone(policy)]  # kvzip is one-shot only
STORAGES = ("float", "int4")
GROUP = 8  # quant_group_size: two groups per head of 16
# Largest logit difference relative to the largest logit for int4 storage (tests/kvcache/test_input_errors_cache.py).
INT4_BOUND = 2e-3
GRAD_TOLERANCE = 1e-4  # tests/gradient/test_chunked_backward.py
LENGTHS = (5, 17, 40)
NEW_TOKENS = 6


# -- policies and configs -------------------------------------------------------------------------


def _options(policy: str) -> dict[str, object]:
    """`sinks=2` for policies whose Options have a `sinks` field, nothing otherwise."""
    fields = {f.name for f in dataclasses.fields(get_kv_cache_class(policy).Options)}
    return {"sinks": 2} if "sinks" in fields else {}


def _config(policy: str, storage: str, cache_length: int, chunk: int, needed: int) -> KVCacheConfig:
    """Config for `policy`; a cache with a token limit below `needed` gets `needed` slots instead."""
    kwargs = dict(chunk_size=chunk, prefill_length=chunk, storage=storage, quant_group_size=GROUP)
    cfg = KVCacheConfig(policy, cache_length=cache_length, options=_options(policy), **kwargs)
    limit = get_kv_cache_class(policy).max_tokens(cfg)
    if limit is not None and limit < needed:
        cfg = KVCacheConfig(policy, cache_length=needed, options=_options(policy), **kwargs)
    return cfg


def _stored(policy: str, storage: str) -> str:
    """The storage a cache of `policy` actually uses when asked for `storage` (built once to see)."""
    cfg = KVCacheConfig(policy, cache_length=16, storage=storage, quant_group_size=GROUP, options=_options(policy))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a policy may warn that it replaces the storage: that is what we look at
        cache = SlotMachine(get_kv_cache_class(policy), cfg, CacheShape(1, 1, 16, 16, 16), None, torch.float32)
    return cache.config.storage


def _storage_or_skip(policy: str, storage: str) -> None:
    stored = _stored(policy, storage)
    if stored != storage:
        pytest.skip(f"{policy} stores {stored!r} when asked for {storage!r}: the {stored!r} case covers it")


def _logit_bound(policy: str, storage: str, reference: torch.Tensor, depth: int) -> float:
    """float: rounding of a float64 model (float32 where attention weights are computed, in float32);
    int4: `INT4_BOUND` of the largest logit."""
    if storage != "float":
        return INT4_BOUND * reference.abs().max().item()
    dtype = torch.float32 if get_kv_cache_class(policy).needs_attn_weights else torch.float64
    return rounding_bound(reference, depth, dtype)


@pytest.fixture(scope="module")
def model32(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(21, gates=True)


@pytest.fixture(scope="module")
def model64(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(21, torch.float64, gates=True)


def _tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return random_tokens(batch, length, seed)


def test_discovery_finds_the_registry_and_the_examples() -> None:
    def qualified(cls: type) -> str:  # not the class object: a test may have re-imported an example module
        return f"{cls.__module__}.{cls.__qualname__}"

    registered = {qualified(get_kv_cache_class(name)) for name in known_policies()}
    tested = {qualified(get_kv_cache_class(policy)) for policy in POLICIES}
    assert registered <= tested  # every registered class is under test (the examples by their path)
    assert len(POLICIES) == len(tested) >= 3 + len(EXAMPLE_POLICIES)


# -- batch == alone -------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("policy", EVICTING)
@torch.inference_mode()
def test_ragged_batch_equals_each_prompt_alone(model64: GPT, policy: str, storage: str) -> None:
    """Lengths 5, 17, 40, left-padded, 16 slots, token by token (so that chunk boundaries, which left
    padding shifts, play no role): each row's logits and greedy tokens are those of its prompt alone."""
    _storage_or_skip(policy, storage)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in LENGTHS]
    cfg = _config(policy, storage, cache_length=16, chunk=1, needed=max(LENGTHS) + NEW_TOKENS)
    idx, input_pos = pad_prompts(prompts, torch.device("cpu"))
    batched = forward_chunked(model64, idx, cfg, input_pos=input_pos)
    depth = forward_depth(model64.config, max(LENGTHS) + cfg.cache_length)
    for row, prompt in enumerate(prompts):
        alone = forward_chunked(model64, prompt[None], cfg)[0]
        diff, bound = max_diff(batched[row, -len(prompt) :], alone), _logit_bound(policy, storage, alone, depth)
        assert diff <= bound, f"row {row} (length {len(prompt)}): max diff {diff:.3g} > bound {bound:.3g}"
    tokens = generate(model64, prompts, max_new_tokens=NEW_TOKENS, kv_cache=cfg)
    for row, prompt in enumerate(prompts):
        alone = generate(model64, [prompt], max_new_tokens=NEW_TOKENS, kv_cache=cfg)[0]
        assert tokens[row].tolist() == alone.tolist(), f"row {row} (length {len(prompt)})"


# -- room for every token: dense ------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 40])
@pytest.mark.parametrize("policy", POLICIES)
@torch.inference_mode()
def test_with_room_for_every_token_equals_dense(model64: GPT, policy: str, chunk: int) -> None:
    """cache_length 48 >= 40 tokens: the logits of dense attention (on the storage the policy uses)."""
    storage = _stored(policy, "float")
    idx = _tokens(2, 40, seed=5)
    logits = forward_chunked(model64, idx, _config(policy, storage, cache_length=48, chunk=chunk, needed=40))
    dense = forward_chunked(model64, idx, KVCacheConfig("dense", 48, chunk, chunk, storage, GROUP))
    depth = forward_depth(model64.config, 48 + chunk)
    diff = max_diff(logits, dense)
    bound = rounding_bound(
        dense, depth, torch.float32 if get_kv_cache_class(policy).needs_attn_weights else torch.float64
    )
    assert diff <= bound, f"max diff {diff:.3g} > bound {bound:.3g}"
    if storage == "float":  # and dense is the model without a cache
        assert max_diff(dense, model64(idx)) <= rounding_bound(dense, depth, torch.float64)


# -- an evicting run ------------------------------------------------------------------------------


def _check_slots(cache: KVCache, seen: int, sinks: int, layer: int) -> None:
    """After `seen` tokens (positions `0..seen-1` in every row): `min(seen, L)` distinct seen positions
    per (row, KV head), the sinks among them, and one layout for all heads if the class says so."""
    positions = cache.positions
    where = f"layer {layer} after {seen} tokens"
    held = positions >= 0
    counts = held.sum(dim=2)
    expected = min(seen, cache.cache_length)
    assert bool((counts == expected).all()), f"{where}: tokens held per (row, head) {counts.tolist()} != {expected}"
    assert int(positions.max()) <= seen - 1, f"{where}: holds position {int(positions.max())} not seen yet"
    ordered = torch.sort(positions, dim=2).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    assert not bool(repeated.any()), f"{where}: a position is held twice: {positions.tolist()}"
    for sink in range(min(sinks, seen)):
        kept = (positions == sink).any(dim=2)
        assert bool(kept.all()), f"{where}: sink {sink} evicted in (row, head) {(~kept).nonzero().tolist()}"
    if cache.heads_share_positions:
        assert torch.equal(positions, positions[:, :1].expand_as(positions)), f"{where}: heads differ"


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("policy", EVICTING)
@torch.inference_mode()
def test_evicting_run_keeps_cache_length_distinct_tokens(model32: GPT, policy: str, storage: str) -> None:
    """16 slots, 48 tokens in chunks of 4 (policies that cannot evict: as many slots as tokens)."""
    _storage_or_skip(policy, storage)
    cfg = _config(policy, storage, cache_length=16, chunk=4, needed=48)
    idx = _tokens(2, 48, seed=7)
    input_pos = torch.arange(48).expand(2, 48)
    sinks = cfg.options.get("sinks", 0)
    model32.set_kv_caches(model32.build_kv_caches(cfg, 2))
    try:
        for start, end in ChunkPlan.of(cfg).bounds(48):
            logits = model32(idx[:, start:end], input_pos[:, start:end])
            assert bool(torch.isfinite(logits).all()), f"non-finite logits in tokens {start}..{end}"
            for layer, cache in enumerate(model32.kv_caches):
                _check_slots(cache, end, sinks, layer)
    finally:
        model32.set_kv_caches(None)


def _assert_runs_bitwise_equal(together: tuple, alone: tuple) -> None:
    """The logits of every call and every layer's final state of two runs (`_decode_run`, `_fill_run`) are equal."""
    for step, (a, b) in enumerate(zip(together[0], alone[0], strict=True)):
        assert torch.equal(a, b), f"call {step}: logits differ by {max_diff(a, b)}"
    for layer, (a, b) in enumerate(zip(together[1], alone[1], strict=True)):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"layer {layer}: {name} differs"


def _decode_run(model: GPT, cfg: KVCacheConfig, idx: torch.Tensor, pos: torch.Tensor, together: bool) -> tuple:
    """Prefill `idx[:, :16]` in chunks, then one token per call; returns the logits of every call, the
    final state of every layer, and how many layers were waiting for their eviction at a block's start."""
    waiting = []

    def hook(i: int, x: torch.Tensor) -> None:
        waiting.append(sum(cache.waiting_call is not None for cache in model.kv_caches))

    model.set_kv_caches(model.build_kv_caches(cfg, idx.shape[0]))
    try:
        model.caches.evict_layers_together = together
        logits = [model(idx[:, :8], pos[:, :8]), model(idx[:, 8:16], pos[:, 8:16])]
        logits += [model(idx[:, i : i + 1], pos[:, i : i + 1], block_hook=hook) for i in range(16, idx.shape[1])]
        states = [{k: v.clone() for k, v in c.state_tensors().items()} for c in model.kv_caches]
        return logits, states, max(waiting)
    finally:
        model.set_kv_caches(None)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("policy", EVICTING)
@torch.inference_mode()
def test_decode_steps_evicting_all_layers_together_equal_each_layer_alone(
    model32: GPT, policy: str, storage: str
) -> None:
    """Decode steps evict every layer at once after the block loop (`KVCaches.evict_waiting`); the logits
    and every layer's final state are bitwise those of evicting each layer in its own call
    (`evict_layers_together = False`). Ragged rows, 12 slots, 24 evicting steps."""
    _storage_or_skip(policy, storage)
    cfg = _config(policy, storage, cache_length=12, chunk=8, needed=40)
    idx = _tokens(2, 40, seed=11)
    pos = torch.arange(40).expand(2, 40).clone()
    pos[1, :5] = -1  # row 1 is left-padded
    together, alone = _decode_run(model32, cfg, idx, pos, True), _decode_run(model32, cfg, idx, pos, False)
    assert alone[2] == 0
    if get_kv_cache_class(policy).max_tokens(cfg) is None:  # it evicts: its decode steps are staged
        assert together[2] > 0, "the decode steps of the first run did not wait for evict_waiting"
    _assert_runs_bitwise_equal(together, alone)


def _fill_run(model: GPT, cfg: KVCacheConfig, idx: torch.Tensor, pos: torch.Tensor, together: bool) -> tuple:
    """Prefill `idx[:, :16]`, compress a one-shot cache, then one token per call into empty slots; the logits of
    every call and the final state of every layer."""
    model.set_kv_caches(model.build_kv_caches(cfg, idx.shape[0]))
    try:
        model.caches.evict_layers_together = together
        logits = [model(idx[:, :8], pos[:, :8]), model(idx[:, 8:16], pos[:, 8:16])]
        model.caches.end_prefill()
        logits += [model(idx[:, i : i + 1], pos[:, i : i + 1]) for i in range(16, idx.shape[1])]
        states = [{k: v.clone() for k, v in c.state_tensors().items()} for c in model.kv_caches]
        return logits, states
    finally:
        model.set_kv_caches(None)


@pytest.mark.parametrize("mode", ["continuous", "one-shot"])
@pytest.mark.parametrize("policy", EVICTING)
@torch.inference_mode()
def test_decode_steps_into_empty_slots_together_equal_each_layer_alone(
    model32: GPT, policy: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps that fill empty slots (a cache that is not full yet; a one-shot cache after its compression)
    are written after the block loop, the policy class's `prepare_layers` first (`learned`: every layer's gate
    logits in one product, counted); logits and states bitwise those of each layer in its own call."""
    options = _options(policy)
    if mode == "one-shot":
        fields = {f.name for f in dataclasses.fields(get_kv_cache_class(policy).Options)}
        if "budget" not in fields:
            pytest.skip(f"{policy} has no one-shot mode")
        options = {**options, "mode": "one-shot", "budget": 8, **({"window": 4} if "window" in fields else {})}
    cfg = KVCacheConfig(policy, cache_length=40, chunk_size=8, prefill_length=8, options=options)
    if get_kv_cache_class(policy).max_tokens(cfg) is not None:
        pytest.skip(f"{policy} does not evict")
    idx = _tokens(2, 36, seed=12)
    pos = torch.arange(36).expand(2, 36).clone()
    pos[1, :3] = -1  # row 1 is left-padded
    import litkv.kvcache.learned as learned_module

    gate_calls = []
    gate = learned_module._gate_new_keys
    monkeypatch.setattr(learned_module, "_gate_new_keys", lambda *a: gate_calls.append(1) or gate(*a))
    together = _fill_run(model32, cfg, idx, pos, True)
    calls_together = len(gate_calls)
    alone = _fill_run(model32, cfg, idx, pos, False)
    if policy == "learned":  # two prefill chunks of every layer, then one product per decode step
        n_layers = model32.config.n_layer
        assert calls_together == 2 * n_layers + 20, calls_together
        assert len(gate_calls) - calls_together == 22 * n_layers
    _assert_runs_bitwise_equal(together, alone)


# -- gradients through the policy -----------------------------------------------------------------


def _grads(model: GPT) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Largest `max|actual - expected| / max|expected|` over the parameters (as
    tests/gradient/test_chunked_backward.py)."""
    assert actual.keys() == expected.keys()
    return max(float((actual[n] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)) for n, ref in expected.items())


# Quantised storage too: the engine's replay recomputes keys/values through other attention kernels
# (last-bit differences); it attends to the values the forward pass stored, so no int8 code flips.
GRAD_CASES = [pytest.param(policy, "float", id=f"{policy}-float") for policy in EVICTING] + [
    pytest.param(policy, "int8", id=f"{policy}-int8") for policy in ("last-recent", "h2o", *EXAMPLE_POLICIES)
]


@pytest.mark.parametrize(("policy", "storage"), GRAD_CASES)
def test_gradient_engine_equals_autograd(model32: GPT, policy: str, storage: str) -> None:
    """`chunked_loss_backward` vs autograd through `forward_chunked`: 40 tokens, 16 slots, chunks of 4."""
    storage = _stored(policy, storage)
    cfg = _config(policy, storage, cache_length=16, chunk=4, needed=40)
    idx, targets = _tokens(2, 40, seed=11), _tokens(2, 40, seed=12)
    targets[0, :6] = -100
    targets[1, 25:31] = -100
    model32.zero_grad(set_to_none=True)
    logits = forward_chunked(model32, idx, cfg)
    ref_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref_loss.backward()
    ref_grads = _grads(model32)
    model32.zero_grad(set_to_none=True)
    loss = chunked_loss_backward(model32, idx, targets, cfg)
    grads = _grads(model32)
    model32.zero_grad(set_to_none=True)
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    assert len(grads) == len(list(model32.parameters()))
    error = _max_rel_error(grads, ref_grads)
    assert error <= GRAD_TOLERANCE, f"largest relative gradient error {error:.3g} > {GRAD_TOLERANCE}"


# -- a quality smoke check: the needle dense finds on the shipped model ----------------------------

NEEDLE_KEY, NEEDLE_VALUE = "ivory-harbor", "7302519"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE_BUDGET = 0.875  # cache_length over the prompt's tokens: generous (an eighth of the prompt evicted)
# A policy may sit at the needle's eviction boundary at one budget, where the CPU's rounding decides (knorm at
# 7/8: the whole needle on an AMD EPYC, its last digit lost on an Intel Xeon, the whole needle at 27/32 and 29/32
# on both): a loss at 7/8 is checked at these two neighbours, and the majority of the three decides.
NEEDLE_NEIGHBOURS = (27 / 32, 29 / 32)


def _needle_answer(model: GPT, tokenizer: object, ids: torch.Tensor, policy: str, cache_length: int) -> str:
    """The greedy answer (10 tokens) of `policy` with `cache_length` slots (the whole sequence for a
    policy that does not evict), prompt chunks of 64."""
    cfg = KVCacheConfig(policy, cache_length=cache_length, chunk_size=64)
    limit = get_kv_cache_class(policy).max_tokens(cfg)
    if limit is not None and limit < len(ids) + 10:
        cfg = KVCacheConfig(policy, cache_length=len(ids) + 10, chunk_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qh2o says it stores int4
        out = generate(model, [ids], 10, cfg)
    return tokenizer.decode(out[0])  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def shipped() -> tuple[GPT, object, torch.Tensor]:
    """The shipped model (SmolLM2-135M-Instruct, float32), its tokenizer and a RULER niah_single_1 prompt
    (one fact in ~450 tokens of noise, 60 % deep) in its chat template with RULER's answer prefix; skips
    without the model, or when dense does not answer with the fact."""
    from litkv.checkpoints.checkpoint import load_model, load_tokenizer
    from litkv.checkpoints.download import cache_dir
    from litkv.inference.chat_template import load_format

    checkpoint = cache_dir("smollm2-135m-instruct")
    if not (checkpoint / "model.safetensors").is_file():
        pytest.skip("the shipped model is not downloaded: `litkv download smollm2-135m-instruct`")
    model, tokenizer = load_model(checkpoint), load_tokenizer(checkpoint)
    text = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz "
        f"you about the numbers afterwards.\n{NOISE * 10}One of the special magic numbers for {NEEDLE_KEY} is: "
        f"{NEEDLE_VALUE}. {NOISE * 7}\nWhat is the special magic number for {NEEDLE_KEY} mentioned in the "
        "provided text?"
    )
    segments = load_format(checkpoint, tokenizer, None).segments([("user", text)], [None], True, True)
    prefix = tokenizer.encode(f"The special magic number for {NEEDLE_KEY} mentioned in the provided text is", bos=False)
    ids = torch.tensor([i for segment in segments for i in segment.ids] + prefix.tolist())
    dense = _needle_answer(model, tokenizer, ids, "dense", len(ids) + 10)
    if NEEDLE_VALUE not in dense:
        pytest.skip(f"dense does not find the needle on this model (it answered {dense!r}): nothing to hold to")
    return model, tokenizer, ids


# Found losing it (a finding, not a bug of the check): TOVA keeps no memory and has no recent window.
KNOWN_NEEDLE_LOSSES = {"tova": "tova (this call's attention only, recent 0) loses this needle even at 7/8"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [pytest.param(p, marks=pytest.mark.xfail(reason=KNOWN_NEEDLE_LOSSES[p])) if p in KNOWN_NEEDLE_LOSSES else p
     for p in EVICTING],
)  # fmt: skip
@torch.inference_mode()
def test_policy_finds_the_needle_dense_finds(shipped: tuple[GPT, object, torch.Tensor], policy: str) -> None:
    """Quality in a minute: at 7/8 of the prompt's tokens (or, where it loses there, at both of 27/32 and
    29/32), the policy answers with the fact dense answers with."""
    model, tokenizer, ids = shipped
    length = int(len(ids) * NEEDLE_BUDGET)
    answer = _needle_answer(model, tokenizer, ids, policy, length)
    if NEEDLE_VALUE in answer:
        return
    lost = {length: answer}
    for fraction in NEEDLE_NEIGHBOURS:
        n = int(len(ids) * fraction)
        lost[n] = _needle_answer(model, tokenizer, ids, policy, n)
    found = [n for n, a in lost.items() if NEEDLE_VALUE in a]
    assert len(found) >= 2, (
        f"{policy} loses the needle dense finds: for a {len(ids)}-token prompt it answered {lost} (cache_length: "
        f"answer), dense {NEEDLE_VALUE!r} (docs/custom_policy.md: the scale of attn_weights, recent)"
    )
