"""Checks that need a CUDA GPU (marked `cuda`; skipped without one; scripts/gpu_check.sh runs them):
SDPA's kernels, `torch.compile`, int8/int4 storage, bf16/fp16 against float64, and the memory a cache
takes on the GPU against `KVCaches.nbytes`."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from half import LOGIT_EPS, half_bound, half_pair
from helpers import max_diff, random_tokens

from litkv import KVCacheConfig, forward_chunked, generate
from litkv.kvcache.storage_kinds import known_storages
from litkv.modeling.attention import attend, build_mask

QUANTISED = [s for s in known_storages() if s != "float"]  # every packed format, built-ins included

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)"),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"])
def test_sdpa_kernels_match_float64(backend: str, dtype: torch.dtype) -> None:
    """Each SDPA backend, a causal multi-token call with a shared mask (the grouped-query kernel) and the
    flash-incompatible boolean mask (the backend refuses: skipped), against float64 on the CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    b, h, g, t, s, hs = 2, 8, 2, 64, 64, 64
    q = torch.randn(b, h, t, hs, generator=gen, dtype=torch.float64)
    k = torch.randn(b, g, s, hs, generator=gen, dtype=torch.float64)
    v = torch.randn(b, g, s, hs, generator=gen, dtype=torch.float64)
    mask = build_mask(torch.arange(t).expand(b, t), torch.arange(s).expand(b, g, s))[:, :1]
    ref, _ = attend(q, k, v, mask, hs**-0.5)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        try:
            y, _ = attend(*(x.to(CUDA, dtype) for x in (q, k, v)), mask.to(CUDA), hs**-0.5)
        except RuntimeError as err:
            pytest.skip(f"{backend} does not take this call on this GPU: {str(err).splitlines()[0]}")
    assert max_diff(y.cpu(), ref) <= 8 * torch.finfo(dtype).eps * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy", ["dense", "h2o", "last-recent"])
def test_16bit_model_on_gpu_matches_its_float64_twin(policy: str, dtype: torch.dtype) -> None:
    model, model64 = half_pair(dtype)
    idx = random_tokens(2, 48, seed=3)
    cfg = KVCacheConfig(policy, cache_length=48 if policy == "dense" else 32, chunk_size=8)
    with torch.inference_mode():
        ref = forward_chunked(model64, idx, cfg)
        got = forward_chunked(model.to(CUDA), idx.to(CUDA), cfg).cpu()
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    if policy != "h2o":  # h2o's kept set may differ where scores tie up to rounding (tests/modeling/test_cuda.py)
        assert max_diff(got, ref) <= half_bound(ref, dtype, LOGIT_EPS)


@pytest.mark.parametrize("storage", QUANTISED)
def test_quantised_storage_on_gpu_equals_cpu(storage: str) -> None:
    """float32 model: the GPU's int8/int4 caches give the CPU's logits within float32 rounding of the
    codes' attention (a code may flip at a rounding boundary: at most one quantum, 1e-3 of the logits)."""
    model, _ = half_pair(torch.float32)
    idx = random_tokens(2, 48, seed=4)
    cfg = KVCacheConfig("h2o", cache_length=32, chunk_size=8, storage=storage, quant_group_size=8)
    with torch.inference_mode():
        ref = forward_chunked(model, idx, cfg)
        got = forward_chunked(copy.deepcopy(model).to(CUDA), idx.to(CUDA), cfg).cpu()
    assert max_diff(got, ref) <= 1e-3 * ref.abs().max().item()


def test_compiled_decode_on_gpu_gives_eager_tokens() -> None:
    """float32: inductor's fused norms and MLP round bf16 differently from eager, which may flip a near tie."""
    model, _ = half_pair(torch.float32)
    model = model.to(CUDA)
    prompts = list(random_tokens(2, 24, seed=5).to(CUDA))
    cfg = KVCacheConfig("h2o", cache_length=16, chunk_size=8)
    with torch.inference_mode():
        eager = generate(model, prompts, max_new_tokens=12, kv_cache=cfg)
        compiled = generate(model, prompts, max_new_tokens=12, kv_cache=cfg, compile=True)
    assert [t.tolist() for t in compiled] == [t.tolist() for t in eager]


@pytest.mark.parametrize("storage", known_storages())
def test_gpu_memory_of_the_caches_is_their_nbytes(storage: str) -> None:
    """Building the caches of a 4,096-slot, batch-4 run allocates their `nbytes` (`KVCaches.nbytes` sums
    them; the staging room of one slot per row and head, positions and per-slot state come on top: within
    5% + 1 MiB)."""
    model, _ = half_pair(torch.bfloat16)
    model = model.to(CUDA)
    cfg = KVCacheConfig("h2o", cache_length=4096, storage=storage, quant_group_size=8)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # h2o on int8/int4: no warning expected, but qh2o-like ones may
        caches = model.build_kv_caches(cfg, 4)
        torch.cuda.synchronize()
        allocated = torch.cuda.max_memory_allocated() - before
        nbytes = sum(cache.nbytes() for cache in caches)
    assert nbytes > 0
    assert nbytes <= allocated <= 1.05 * nbytes + 2**20 + _state_bytes(cfg, model.config.n_layer), (allocated, nbytes)


def _state_bytes(cfg: KVCacheConfig, n_layer: int) -> int:
    """Positions (int64) and h2o's two float32 per-slot states for 4 rows x 2 KV heads per layer."""
    return n_layer * 4 * 2 * (cfg.cache_length + 1) * (8 + 4 + 4)


def test_float16_overflow_on_gpu_gives_finite_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=gen) * 100
    k = torch.randn(1, 2, 12, 16, generator=gen) * 100
    v = torch.randn(1, 2, 12, 16, generator=gen)
    mask = build_mask(torch.arange(7, 12).expand(1, 5), torch.arange(12).expand(1, 2, 12)).to(CUDA)
    for need_weights in (False, True):
        y, _ = attend(q.to(CUDA).half(), k.to(CUDA).half(), v.to(CUDA).half(), mask, 0.25, need_weights=need_weights)
        assert bool(torch.isfinite(y).all()), need_weights
