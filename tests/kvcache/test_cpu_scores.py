"""`cpu_scores.keydiff_scores`, KeyDiff's cosines in C, against a float64 oracle of the rule, alone and in a batch,
on strided keys; and `keydiff` taking it on the CPU. `cpu_scores.snapkv_weights` against a float64 oracle;
`cpu_scores.keydiff_scores_layers` and `cpu_scores.snapkv_weights_layers` against calls per layer;
`cpu_scores.snapkv_pool` against the PyTorch path's bits, and snapkv's decode through it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from litkv import KVCacheConfig
from litkv.kvcache.base import CacheShape, Candidates
from litkv.kvcache.caches import KVCaches
from litkv.kvcache.kernels import cpu_scores
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.registry import get_kv_cache_class
from litkv.kvcache.snapkv import SnapKVKVCache, SnapKVOptions, _kept_scores
from litkv.modeling.model import GPT

pytestmark = pytest.mark.skipif(cpu_scores.library(64) is None, reason="no C compiler")


def _oracle(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """KeyDiff's rule in float64, key by key: the mean of the real candidates' unit keys, minus each key's cosine."""
    out = torch.empty(positions.shape, dtype=torch.float64)
    for b in range(keys.shape[0]):
        for g in range(keys.shape[1]):
            k = keys[b, g].double()
            real = [i for i in range(k.shape[0]) if positions[b, g, i] >= 0]
            anchor = sum((k[i] / k[i].norm() for i in real), torch.zeros(k.shape[1], dtype=torch.float64))
            anchor = anchor / max(len(real), 1)
            for i in range(k.shape[0]):
                out[b, g, i] = -(k[i] @ anchor) / (k[i].norm() * anchor.norm())
    return out


def _keys(d: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys `(2, 3, n, d)` as views of slots one longer (strided, as a decode step's are) and positions with empty
    slots in one row and head."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randn(2, 3, n + 1, d, generator=gen) * torch.rand(2, 3, n + 1, 1, generator=gen) * 4
    positions = torch.randperm(2 * 3 * n, generator=gen).view(2, 3, n)
    positions[1, 2, : n // 3] = -1
    return slots[:, :, :n], positions


@pytest.mark.parametrize("d", [64, 20, 4])
@pytest.mark.parametrize("n", [1, 17, 513])
def test_keydiff_scores_match_the_oracle(d: int, n: int) -> None:
    keys, positions = _keys(d, n, d + n)
    assert keys.stride(-1) == 1 and not keys.is_contiguous()
    got = cpu_scores.keydiff_scores(keys, positions)
    want = _oracle(keys, positions)
    assert got.dtype == torch.float32 and got.shape == positions.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=4 * d * 2**-24)


def test_a_row_and_head_gets_the_same_bits_alone_and_in_a_batch() -> None:
    keys, positions = _keys(64, 200, 3)
    batch = cpu_scores.keydiff_scores(keys, positions)
    for b in range(2):
        for g in range(3):
            alone = cpu_scores.keydiff_scores(keys[b : b + 1, g : g + 1].clone(), positions[b : b + 1, g : g + 1])
            assert torch.equal(alone[0, 0], batch[b, g])


def test_keydiff_scores_of_every_layer_in_one_call_are_the_calls_per_layer() -> None:
    """`keydiff_scores_layers` (a decode step's layers in one call): each layer's scores the bits of its own call;
    layers whose keys differ in strides are left to calls per layer (None)."""
    cases = [_keys(64, 37, seed) for seed in range(4)]
    keys, positions = [k for k, _ in cases], torch.stack([p for _, p in cases])
    got = cpu_scores.keydiff_scores_layers(keys, positions)
    assert got is not None and got.shape == (4, 2, 3, 37)
    for layer, (k, p) in enumerate(cases):
        assert torch.equal(got[layer], cpu_scores.keydiff_scores(k, p))
    assert cpu_scores.keydiff_scores_layers([*keys[:3], keys[3].contiguous()], positions) is None


def test_keydiff_takes_it_on_the_cpu_and_the_pytorch_path_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 CPU cache's `keydiff` scores are the C pass's; with `CPU_KERNEL` off, the PyTorch path's, within
    float32 rounding of the same oracle."""
    keys, positions = _keys(16, 40, 5)
    scores = {}
    for kernel in (True, False):
        monkeypatch.setattr(cpu_scores, "CPU_KERNEL", kernel)
        config = KVCacheConfig("keydiff", cache_length=40)
        cache = SlotMachine(get_kv_cache_class("keydiff"), config, CacheShape(2, 3, 40, 16, 16), None, torch.float32)
        assert cache.policy.c_scores is kernel
        new = keys[:, :, :0]
        candidates = Candidates(positions, keys, keys, new, new, torch.zeros(2, 0, dtype=torch.long))
        scores[kernel] = cache.policy.score(candidates)
    assert torch.equal(scores[True], cpu_scores.keydiff_scores(keys, positions))
    for got in scores.values():
        torch.testing.assert_close(got.double(), _oracle(keys, positions), rtol=0, atol=4 * 16 * 2**-24)


def _window_oracle(queries: torch.Tensor, keys: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
    """SnapKV's decode-step weights in float64, head by head: each query's softmax of `q . k / sqrt(D)` over the keys
    at positions `0..` its own, summed over the KV head's query heads; 0 for a pad query."""
    b, h, _, d = queries.shape
    g = keys.shape[1]
    out = torch.zeros(key_pos.shape, dtype=torch.float64)
    for r in range(b):
        for kv in range(g):
            seen = (key_pos[r, kv] >= 0) & (key_pos[r, kv] <= query_pos[r, 0])
            if query_pos[r, 0] < 0 or not bool(seen.any()):
                continue
            for head in range(kv * h // g, (kv + 1) * h // g):
                logits = keys[r, kv].double() @ queries[r, head, 0].double() / d**0.5
                out[r, kv] += torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=0)
    return out


@pytest.mark.parametrize("d", [64, 20])
@pytest.mark.parametrize("n", [1, 17, 513])
def test_snapkv_weights_match_the_oracle(d: int, n: int) -> None:
    """Strided keys, empty slots, keys after the query's position (not seen), a pad query (row 1 of three)."""
    keys, positions = _keys(d, n, 2 * d + n)
    queries = torch.randn(3, 6, 1, d, generator=torch.Generator().manual_seed(n)) * 2
    keys, positions = torch.cat((keys, keys[:1])), torch.cat((positions, positions[:1]))
    query_pos = torch.tensor([[int(positions.max())], [-1], [int(positions[2].float().median())]])
    got = cpu_scores.snapkv_weights(queries, keys, query_pos, positions)
    want = _window_oracle(queries, keys, query_pos, positions)
    assert got.dtype == torch.float32 and got.shape == positions.shape and bool((got[1] == 0).all())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    alone = cpu_scores.snapkv_weights(queries[2:, 2:4], keys[2:, 1:2].clone(), query_pos[2:], positions[2:, 1:2])
    assert torch.equal(alone[0, 0], got[2, 1])


def test_snapkv_weights_of_every_layer_in_one_call_are_the_calls_per_layer() -> None:
    """`snapkv_weights_layers` (a decode step's layers in one call): each layer's weights the bits of its own call;
    layers whose keys differ in strides are left to calls per layer (None)."""
    gen = torch.Generator().manual_seed(4)
    slots = torch.randn(5, 3, 2, 41, 64, generator=gen)  # (layers, B, G, slots + 1, D): keys are strided views
    keys = [layer[:, :, :40] for layer in slots]
    queries = [torch.randn(3, 6, 1, 64, generator=gen) for _ in keys]
    positions = torch.stack([torch.randperm(80, generator=gen)[:40].expand(3, 2, 40) - 2 for _ in keys])
    query_pos = torch.tensor([[60], [-1], [30]])
    got = cpu_scores.snapkv_weights_layers(queries, keys, query_pos, positions)
    assert got is not None and got.shape == (5, 3, 2, 40)
    for layer, (q, k, p) in enumerate(zip(queries, keys, positions, strict=True)):
        assert torch.equal(got[layer], cpu_scores.snapkv_weights(q, k, query_pos, p))
    assert cpu_scores.snapkv_weights_layers(queries, [*keys[:4], keys[4].contiguous()], query_pos, positions) is None


def _pool_case(n: int, nb: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights `(2, 3, n)` (one NaN), positions (random, a fifth empty, ties only among the empty) and a running
    maximum of `nb` slots."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(2, 3, n, generator=gen)
    positions = torch.stack([torch.randperm(4 * n, generator=gen)[:n] for _ in range(6)]).view(2, 3, n)
    positions[torch.rand(2, 3, n, generator=gen) < 0.2] = -1
    weights[0, 1, n // 2] = float("nan")
    return weights, positions, torch.rand(2, 3, nb, generator=gen)


@pytest.mark.parametrize("kernel", [1, 7, 101])
@pytest.mark.parametrize("start", ["identity", "random", "reversed"])
@pytest.mark.parametrize("n", [1, 9, 300])
def test_snapkv_pool_gives_the_pytorch_paths_bits(kernel: int, start: str, n: int) -> None:
    """The pooled, masked, running-maximum scores equal `_kept_scores`'s bit for bit (NaN where it has NaN), from
    any starting order (insertion sort, or the merge sort when the order is far off), with and without `best`; the
    order comes back sorted by (position, slot), and a second call from it gives the same bits."""
    weights, positions, best = _pool_case(n, n - 1 if n > 1 else 0, 7 * n + kernel)
    options = SnapKVOptions(kernel=kernel)
    first = {"identity": torch.arange(n), "random": torch.randperm(n), "reversed": torch.arange(n).flip(0)}[start]
    for running in (best, None):
        order = first.to(torch.int32).expand(2, 3, n).contiguous()
        want = _kept_scores(options, weights, positions, running)
        for _ in range(2):
            got = cpu_scores.snapkv_pool(weights, positions, running, kernel, order, 64)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
        for row, slots in zip(positions.view(6, n).tolist(), order.view(6, n).tolist(), strict=True):
            assert slots == sorted(range(n), key=lambda j, row=row: (row[j], j))


def test_snapkv_pool_refuses_an_order_of_another_shape() -> None:
    weights, positions, best = _pool_case(5, 4, 0)
    with pytest.raises(ValueError, match=r"order must be int32 \(2, 3, 5\)"):
        cpu_scores.snapkv_pool(weights, positions, best, 7, torch.zeros(2, 3, 4, dtype=torch.int32), 64)


def _snapkv_decode(model, prompt: torch.Tensor, config: KVCacheConfig, steps: int) -> tuple[list, list]:
    """Greedy decode after a chunked prefill: each step's logits, and the caches' positions and running maxima after
    the last."""
    model.set_kv_caches(KVCaches(model.build_kv_caches(config, batch_size=1)))
    n, logits = prompt.shape[0], []
    with torch.no_grad():
        for start in range(0, n, config.chunk_size):
            end = min(start + config.chunk_size, n)
            out = model(prompt[None, start:end], torch.arange(start, end)[None])
        for i in range(steps):
            out = model(out[:, -1:].argmax(-1), torch.tensor([[n + i]]))
            logits.append(out)
    state = [t.clone() for cache in model.kv_caches for t in (cache.positions, cache.policy.best)]
    model.set_kv_caches(None)
    return logits, state


def test_snapkv_decode_through_the_c_pool_equals_the_pytorch_pool(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Callable[..., GPT]
) -> None:
    """snapkv over 24 slots, a prompt of 57 tokens (evicting from the prefill on) and 16 decode steps, whose scores
    are stacked over the layers: with the C pool, every step's logits and the slots' positions equal those with the
    PyTorch pool, bit for bit, and so do the running maxima."""
    model = tiny_model(3)
    prompt = torch.randint(0, 128, (57,), generator=torch.Generator().manual_seed(1))
    config = KVCacheConfig("snapkv", cache_length=24, chunk_size=8, options=dict(sinks=2, recent=6))
    dims, pool = [], SnapKVKVCache.kept_scores

    def counted(self: SnapKVKVCache, weights: torch.Tensor, pos: torch.Tensor, best: torch.Tensor | None):
        dims.append(weights.dim())
        return pool(self, weights, pos, best)

    monkeypatch.setattr(SnapKVKVCache, "kept_scores", counted)
    c_logits, c_positions = _snapkv_decode(model, prompt, config, 16)
    assert 4 in dims  # the decode steps' layers, stacked, went through the C pool
    monkeypatch.setattr(SnapKVKVCache, "kept_scores", lambda self, w, p, b: _kept_scores(self.options, w, p, b))
    logits, positions = _snapkv_decode(model, prompt, config, 16)
    assert all(torch.equal(a, b) for a, b in zip(c_logits, logits, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(c_positions, positions, strict=True))
