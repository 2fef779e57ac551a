"""KV blocks spliced into a prompt (litkv.inference.blocks): rotation, positions and masks, exactness at offset 0,
full recomputation, the recomputation proxy.

The independent reference is `helpers.reference_forward` (float64 attention and RoPE written from
scratch) with an explicit mask: a pure splice is exactly a forward in which a block's tokens attend only
to their own block (RoPE is relative, so a block computed alone at 0 and rotated to `p` is the block
at `p` seeing nothing else), and every other token attends to everything before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from helpers import random_tokens, reference_forward

from litkv import GPT, KVCacheConfig, PrefixCache, forward_chunked, generate
from litkv.inference.blocks import Segment, kv_deviation, prefill_segments, rope_delta, rotate_keys
from litkv.kvcache.config import ChunkPlan
from litkv.modeling import attention
from litkv.states.block_store import BlockStore

KV = KVCacheConfig(policy="dense", cache_length=160, chunk_size=8, prefill_length=16)


def _angles(positions: torch.Tensor, n: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 cos, sin `(1, T, n)` of RoPE (half-split) at `positions` `(T,)`."""
    freq = 1.0 / base ** (torch.arange(n // 2, dtype=torch.float64) * 2 / n)
    angle = positions.double()[:, None] * freq
    return torch.cat((angle.cos(), angle.cos()), -1)[None], torch.cat((angle.sin(), angle.sin()), -1)[None]


@pytest.mark.parametrize(("p", "d"), [(0, 5), (3, 0), (7, 100), (123, 4000)])
def test_rotation_by_p_then_d_is_rotation_by_p_plus_d(p: int, d: int) -> None:
    keys = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    at = torch.arange(5)
    cos0, sin0 = _angles(at, 16)
    base = rotate_keys(keys, cos0, sin0, 16)  # keys at positions 0..4
    cp, sp = _angles(torch.tensor([p]), 16)
    cd, sd = _angles(torch.tensor([d]), 16)
    cpd, spd = _angles(torch.tensor([p + d]), 16)
    twice = rotate_keys(rotate_keys(base, cp, sp, 16), cd, sd, 16)
    once = rotate_keys(base, cpd, spd, 16)
    assert (twice - once).abs().max() < 1e-12
    direct = rotate_keys(keys, *_angles(at + p + d, 16), 16)  # the keys computed at positions p+d..
    assert (twice - direct).abs().max() < 1e-12


def test_partial_rotary_dims_past_n_elem_untouched() -> None:
    keys = torch.randn(1, 2, 4, 16, dtype=torch.float64)
    cos, sin = _angles(torch.tensor([9]), 8)
    out = rotate_keys(keys, cos, sin, 8)
    assert torch.equal(out[..., 8:], keys[..., 8:])
    assert not torch.allclose(out[..., :8], keys[..., :8])


@torch.no_grad()
def test_model_keys_rotated_by_delta_are_the_keys_at_the_new_positions(tiny_model: Callable[..., GPT]) -> None:
    """Layer 0's keys depend on token and position only: computed at 0.. and rotated by p, they are those at p.."""
    model = tiny_model(seed=3, dtype=torch.float64)
    ids = random_tokens(1, 12, seed=4)
    attn = model.transformer.h[0].attn
    x = model.transformer.h[0].norm_1(model.transformer.wte(ids))
    for p in (1, 37, 200):
        _, k0, _ = attn._qkv(x, *model.rope(torch.arange(12)[None]))
        _, kp, _ = attn._qkv(x, *model.rope(torch.arange(p, p + 12)[None]))
        cos, sin = rope_delta(model, p, 0)
        moved = rotate_keys(k0, cos.double(), sin.double(), model.config.rope_n_elem)
        assert (moved - kp).abs().max() < 1e-5 * kp.abs().max()  # the model's table is float32


def _block_mask(spans: list[tuple[int, int]]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Causal, except that a query inside a block span sees only keys of its span."""

    def allowed(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        out = k <= q
        for s, e in spans:
            inside = (q >= s) & (q < e)
            out = out & (~inside | ((k >= s) & (k < e)))
        return out

    return allowed


def _segments(lengths: list[tuple[int, bool]], seed: int) -> list[Segment]:
    return [Segment(random_tokens(1, n, seed=seed + i)[0], block) for i, (n, block) in enumerate(lengths)]


@torch.inference_mode()
def _last_logits(model: GPT, segments: list[Segment], kv: KVCacheConfig, **kw: object) -> torch.Tensor:
    with model.kv_caches_attached(kv, 1):
        hidden, _ = prefill_segments(model, segments, kv, **kw)  # type: ignore[arg-type]
        return model.logits(hidden)[0]


def test_pure_splice_is_the_forward_where_blocks_see_only_themselves(tiny_model: Callable[..., GPT]) -> None:
    model = tiny_model(seed=5, dtype=torch.float64)
    segments = _segments([(5, False), (20, True), (13, True), (6, False)], seed=10)
    spans = [(5, 25), (25, 38)]
    ids = torch.cat([s.ids for s in segments])[None]
    got = _last_logits(model, segments, KV)
    ref = reference_forward(model, ids, _block_mask(spans)).logits[0, -1]
    assert (got - ref).abs().max() < 1e-5 * ref.abs().max()
    causal = reference_forward(model, ids).logits[0, -1]
    assert (causal - ref).abs().max() > 1e-3 * ref.abs().max()  # the splice is an approximation elsewhere


@torch.inference_mode()
def test_spliced_positions_and_blocks_never_attend_to_later_segments(tiny_model: Callable[..., GPT]) -> None:
    """The caches hold positions 0..n-1 once each; a block's slots do not change with what follows it."""
    model = tiny_model(seed=6)
    head = _segments([(7, False), (19, True)], seed=20)
    states = []
    for tail_seed in (30, 31):
        segments = head + [Segment(random_tokens(1, 9, seed=tail_seed)[0])]
        with model.kv_caches_attached(KV, 1):
            prefill_segments(model, segments, KV)
            caches = model.kv_caches
            states.append([(c.positions.clone(), c.storage.keys.clone(), c.storage.values.clone()) for c in caches])
            assert int(model.last_pos) == 34
    for (pos_a, k_a, v_a), (pos_b, k_b, v_b) in zip(*states, strict=True):
        for row in pos_a[0]:
            held = sorted(p for p in row.tolist() if p >= 0)
            assert held == list(range(35))
        in_block = (pos_a >= 7) & (pos_a < 26)
        assert torch.equal(pos_a, pos_b)
        assert torch.equal(k_a[:, :, :160][in_block], k_b[:, :, :160][in_block])
        assert torch.equal(v_a[:, :, :160][in_block], v_b[:, :, :160][in_block])


@torch.inference_mode()
@pytest.mark.parametrize("policy", ["dense", "h2o", "tova"])
def test_block_at_position_zero_is_bitwise_a_normal_prefill(
    tiny_model: Callable[..., GPT], policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block that ends on a chunk boundary, then text: the tokens and logits of `generate` and the prefix store.
    A policy that reads attention weights too, where its output comes from SDPA (an accelerator's way, forced
    here; on the CPU the weights pass gives the output, whose rounding depends on the call's shape)."""
    monkeypatch.setattr(attention, "weights_in_one_pass", lambda device: False)
    kv = KVCacheConfig(policy, cache_length=160, chunk_size=8, prefill_length=16)
    model = tiny_model(seed=7)
    block = random_tokens(1, 24, seed=40)[0]  # the first chunk (16) and one of 8
    question = random_tokens(1, 11, seed=41)[0]
    store = BlockStore(1 << 24)
    layout = [Segment(block, True), Segment(question)]
    got = [generate(model, [layout], 12, kv, block_store=store)[0] for _ in range(2)]
    plain = generate(model, [torch.cat((block, question))], 12, kv)[0]
    prefix = PrefixCache(1 << 24)
    stored = [generate(model, [torch.cat((block, question))], 12, kv, prefix_cache=prefix)[0] for _ in range(2)]
    assert store.hits == 2 and store.misses == 2  # the second use restored both pieces
    for tokens in (*got, *stored):
        assert torch.equal(tokens, plain)
    a = _last_logits(model, [Segment(block, True), Segment(question)], kv, store=store)
    with model.kv_caches_attached(kv, 1):
        ids = torch.cat((block, question))
        hidden = None
        for s, e in ChunkPlan.of(kv).bounds(ids.numel()):
            hidden = model(ids[None, s:e], torch.arange(s, e)[None], lm_head=False)[:, -1]
        b = model.logits(hidden)[0]
    assert torch.equal(a, b)


def test_full_recomputation_is_the_full_prefill(tiny_model: Callable[..., GPT]) -> None:
    model = tiny_model(seed=8, dtype=torch.float64)
    segments = _segments([(6, False), (21, True), (14, True), (5, False)], seed=50)
    ids = torch.cat([s.ids for s in segments])[None]
    reference = reference_forward(model, ids).logits[0, -1]
    with torch.inference_mode():
        full = forward_chunked(model, ids, KV)[0, -1]  # the model's own prefill (its RoPE table is float32)
    assert (full - reference).abs().max() < 1e-5 * reference.abs().max()
    got = _last_logits(model, segments, KV, recompute=1.0)
    assert (got - full).abs().max() < 1e-10 * full.abs().max()
    partial = _last_logits(model, segments, KV, recompute=0.5)
    pure = _last_logits(model, segments, KV, recompute=0.0)
    assert (partial - full).abs().max() < (pure - full).abs().max()
    tokens = generate(model, [segments], 8, KV, recompute=1.0)[0]
    assert torch.equal(tokens, generate(model, [ids[0]], 8, KV)[0])


@torch.inference_mode()
def test_recompute_count_and_bad_ratios(tiny_model: Callable[..., GPT]) -> None:
    model = tiny_model(seed=9)
    segments = _segments([(4, False), (20, True), (3, False)], seed=60)
    calls: list[int] = []
    store = BlockStore(1 << 24)
    store.get(model, segments[1].ids, ChunkPlan.of(KV))  # stored: only the recomputed tokens run the model

    def hook(i: int, x: torch.Tensor) -> None:
        if i == 0:
            calls.append(x.shape[1])

    for ratio, expected in ((0.0, 0), (0.05, 1), (0.3, 6), (1.0, 20)):
        calls.clear()
        with model.kv_caches_attached(KV, 1), pytest.MonkeyPatch.context() as patch:
            patch.setattr(model, "forward", lambda *a, **k: GPT.forward(model, *a, **k, block_hook=hook))
            prefill_segments(model, segments, KV, store, recompute=ratio)
        assert sum(calls) == 4 + expected + 3 and math.ceil(ratio * 20) == expected
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="recompute must be a fraction"):
            _last_logits(model, segments, KV, recompute=bad)


@torch.inference_mode()
def test_a_run_of_blocks_recomputes_in_the_calls_of_the_text_after_it(tiny_model: Callable[..., GPT]) -> None:
    """The chosen tokens of consecutive blocks and the text after them: one sequence in calls of chunk_size."""
    model = tiny_model(seed=9)
    segments = _segments([(5, False), (20, True), (19, True), (6, False)], seed=80)
    store = BlockStore(1 << 24)
    for seg in segments[1:3]:
        store.get(model, seg.ids, ChunkPlan.of(KV))
    calls: list[list[int]] = []
    forward = model.forward

    def counted(idx: torch.Tensor, input_pos: torch.Tensor, **kw: object) -> torch.Tensor:
        calls.append(input_pos[0].tolist())
        return forward(idx, input_pos, **kw)  # type: ignore[arg-type]

    with model.kv_caches_attached(KV, 1), pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "forward", counted)
        prefill_segments(model, segments, KV, store, recompute=0.3)
        assert int(model.last_pos[0]) == 49
    chosen = [p for call in calls[1:] for p in call]
    assert calls[0] == list(range(5)) and [len(c) for c in calls[1:]] == [8, 8, 2]  # 6 + 6 chosen + 6 text
    assert chosen == sorted(chosen) and chosen[-6:] == list(range(44, 50))
    assert sum(5 <= p < 25 for p in chosen) == 6 and sum(25 <= p < 44 for p in chosen) == 6


@torch.no_grad()
def test_kv_deviation_is_that_of_the_block_in_its_context(tiny_model: Callable[..., GPT]) -> None:
    """The proxy against layer 1's keys/values from the reference forward of the whole prompt."""
    model = tiny_model(seed=11, dtype=torch.float64)
    context, block_ids = random_tokens(1, 9, seed=70)[0], random_tokens(1, 15, seed=71)[0]
    ids = torch.cat((context, block_ids))[None]
    inputs_ctx = reference_forward(model, ids).block_inputs[1][:, 9:]
    inputs_alone = reference_forward(model, block_ids[None]).block_inputs[1]
    second = model.transformer.h[1]
    _, k_ctx, v_ctx = second.attn._qkv(second.norm_1(inputs_ctx), *model.rope(torch.arange(9, 24)[None]))
    _, k_alone, v_alone = second.attn._qkv(second.norm_1(inputs_alone), *model.rope(torch.arange(9, 24)[None]))

    def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a - b).norm(dim=-1) / b.norm(dim=-1)

    expected = (rel(k_ctx, k_alone) + rel(v_ctx, v_alone)).sum(dim=1)[0]
    with model.kv_caches_attached(KV, 1):
        prefill_segments(model, [Segment(context)], KV)
        block = BlockStore(0).get(model, block_ids, ChunkPlan.of(KV))
        got = kv_deviation(model, block, 9)
    assert got.shape == (15,)
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()


def test_bad_segments_one_line() -> None:
    with pytest.raises(ValueError, match="non-empty 1-D"):
        Segment(torch.empty(0, dtype=torch.long), block=True)
    with pytest.raises(TypeError, match="integer"):
        Segment(torch.zeros(3), block=True)


def test_block_longer_than_a_lossless_cache_one_line(tiny_model: Callable[..., GPT]) -> None:
    model = tiny_model(seed=12)
    small = KVCacheConfig(policy="dense", cache_length=24, chunk_size=8)
    segments = _segments([(10, False), (20, True)], seed=80)
    with model.kv_caches_attached(small, 1), pytest.raises(ValueError, match="DenseKVCache is full"):
        prefill_segments(model, segments, small)
