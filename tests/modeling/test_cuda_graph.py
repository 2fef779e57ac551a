"""The compiled decode step on CUDA is one CUDA graph (marked `cuda`; skipped without a GPU;
scripts/gpu_check.sh runs them): inductor skips no graph, a step never synchronises with the host
(`torch.cuda.set_sync_debug_mode("error")`), and the tokens are eager's for every policy and storage.

float32 models: inductor's fused norms and MLP round bf16 otherwise than eager and may flip a near tie.
The CPU side of the same claims (one graph, no recompilation, static addresses) is tests/modeling/test_compile.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
from helpers import random_tokens, tiny_gpt
from torch._dynamo.utils import counters

from litkv import KVCacheConfig, generate
from litkv.inference.generate import _decode_steps
from litkv.kvcache.storage_kinds import known_storages
from litkv.modeling.attention import attend_causal_suffix

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)"),
]
CUDA = torch.device("cuda")
POLICIES = ["dense", "last-recent", "h2o", "tova", "snapkv", "keydiff", "knorm", "expected-attention", "learned"]
POLICIES += ["qh2o"]


def _model() -> torch.nn.Module:
    return tiny_gpt(3, overrides={"block_size": 1024}, gates=True, device=CUDA)


def _config(policy: str, storage: str) -> KVCacheConfig:
    length = 200 if policy == "dense" else 32
    return KVCacheConfig(policy, cache_length=length, chunk_size=16, storage=storage, quant_group_size=16)


# compiling takes 10-30 s per case on a GPU: scripts/gpu_check.sh runs these (`-m "cuda and not slow"`), the
# other policy x storage pairs are marked slow (the CPU checks every pair for one graph and static addresses)
QUICK = {("dense", "float"), ("h2o", "int8"), ("qh2o", "int4")}
CASES = [
    (p, s) if (p, s) in QUICK else pytest.param(p, s, marks=pytest.mark.slow)
    for p in POLICIES
    for s in known_storages()
]


@pytest.mark.parametrize(("policy", "storage"), CASES)
def test_compiled_step_is_a_cuda_graph_with_eager_tokens(policy: str, storage: str) -> None:
    """A ragged batch, 40 tokens: inductor in "reduce-overhead" mode records the step (no cudagraph skip), one
    graph, and the tokens equal eager's."""
    model = _model()
    prompts = [random_tokens(1, 45, seed=1)[0].to(CUDA), random_tokens(1, 70, seed=2)[0].to(CUDA)]
    cfg = _config(policy, storage)
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qh2o on float storage says it stores int4
        eager = generate(model, prompts, 40, cfg)
        compiled = generate(model, prompts, 40, cfg, compile=True)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert [t.tolist() for t in compiled] == [t.tolist() for t in eager]


@pytest.mark.parametrize(
    ("policy", "compile"),
    [("dense", False), ("h2o", False), ("qh2o", False), ("h2o", True)]
    + [pytest.param(p, True, marks=pytest.mark.slow) for p in ("dense", "qh2o")],
)
def test_decode_steps_never_synchronise(policy: str, compile: bool) -> None:
    """After the prefill and two warm-up steps, 20 steps (and greedy picks) under `set_sync_debug_mode("error")`."""
    model = _model()
    cfg = _config(policy, "int4" if policy == "qh2o" else "float")
    idx = random_tokens(2, 48, seed=4).to(CUDA)
    torch._dynamo.reset()
    with torch.inference_mode(), warnings.catch_warnings(), model.kv_caches_attached(cfg, 2) as caches:
        warnings.simplefilter("ignore")
        pos = torch.arange(48, device=CUDA).expand(2, 48)
        for s in range(0, 48, 16):
            logits = model(idx[:, s : s + 16], pos[:, s : s + 16])[:, -1]
        caches.end_prefill()
        tokens, next_pos = logits.argmax(-1), torch.full((2,), 48, device=CUDA)
        with model.trusted_inputs(48 + 30), _decode_steps(model, compile) as step:
            for i in range(22):
                if i == 2:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    tokens = step(tokens[:, None], next_pos[:, None]).argmax(-1)
                except RuntimeError:
                    torch.cuda.set_sync_debug_mode("default")
                    raise
                next_pos = next_pos + 1
            torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (2,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_causal_suffix_on_gpu_matches_float64(dtype: torch.dtype) -> None:
    """The CUDA way of `attend_causal_suffix` (expanded keys, `causal_lower_right`: flash or memory-efficient kernel)
    against float64 on the CPU."""
    gen = torch.Generator().manual_seed(0)
    b, h, g, t, s, hs = 2, 8, 2, 64, 300, 64
    q = torch.randn(b, h, t, hs, generator=gen, dtype=torch.float64)
    k = torch.randn(b, g, s, hs, generator=gen, dtype=torch.float64)
    v = torch.randn(b, g, s, hs, generator=gen, dtype=torch.float64)
    ref = attend_causal_suffix(q, k, v, hs**-0.5)
    got = attend_causal_suffix(*(x.to(CUDA, dtype) for x in (q, k, v)), hs**-0.5).cpu().double()
    assert (got - ref).abs().max().item() <= 8 * torch.finfo(dtype).eps * ref.abs().max().item() + 1e-6


def test_causal_suffix_on_gpu_takes_no_math_kernel() -> None:
    """bf16 prefill chunk: the profile shows the flash (or memory-efficient) kernel, not SDPA's math one."""
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(1, 32, 1024, 64, device=CUDA, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 4096, 64, device=CUDA, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attend_causal_suffix(q, k, k, 0.125)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert any("flash" in n or "efficient" in n for n in names), sorted(names)
    assert not any("_math" in n for n in names), sorted(names)


def test_decode_attention_on_gpu_takes_no_math_kernel() -> None:
    """A bf16 decode step's attention (one query per row over 4,096 slots, some empty: the folded boolean mask
    `(B, G, q_per_kv, S)`) runs SDPA's memory-efficient kernel, not the math one."""
    from torch.profiler import ProfilerActivity, profile

    from litkv.modeling.attention import attend, build_mask

    q = torch.randn(2, 32, 1, 64, device=CUDA, dtype=torch.bfloat16)
    k = torch.randn(2, 8, 4097, 64, device=CUDA, dtype=torch.bfloat16)
    k_pos = torch.arange(4097, device=CUDA).expand(2, 8, 4097).clone()
    k_pos[1, :, :100] = -1  # empty slots in one row
    mask = build_mask(torch.full((2, 1), 5000, device=CUDA), k_pos)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y, _ = attend(q, k, k, mask, 0.125)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert not any("_math" in n for n in names), sorted(names)
    assert y.shape == (2, 1, 32 * 64)
