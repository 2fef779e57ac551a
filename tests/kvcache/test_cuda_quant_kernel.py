"""The Triton kernel of a quantised cache's decode step, compiled on CUDA (marked `cuda`; skipped without a GPU;
scripts/gpu_check.sh runs them), against the PyTorch path on the same GPU.

Bounds (the kernel multiplies each scale into a number, the PyTorch path into a sum of products; both in float32):
float32 queries `atol=1e-5, rtol=1e-4` for outputs and weight sums; bfloat16 outputs one bfloat16 rounding
(`rtol=2**-7`); a float32 model's logits over 20 decode steps of qh2o (int4) and dense (int8) within
`1e-4 * (1 + max |logit|)`. The same kernel in Triton's interpreter on the CPU, against a float64 oracle too:
tests/kvcache/test_quant_decode_kernel.py. Capture in a CUDA graph and no host synchronisation:
tests/modeling/test_cuda_graph.py (its qh2o and int8 cases take this kernel).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import max_diff, random_tokens, tiny_gpt

import litkv.kvcache.quant_attention as qa
from litkv import KVCacheConfig
from litkv.kvcache.quantized import quantize
from litkv.modeling.attention import build_mask

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)"),
]
CUDA = torch.device("cuda")


def _inputs(b: int, n_head: int, g: int, s: int, d: int, bits: int, group: int, dtype: torch.dtype) -> tuple:
    """A decode step over `s` quantised slots on the GPU: empty slots, a ragged row, the second row not counted."""
    gen = torch.Generator().manual_seed(bits + s)
    x = torch.randn(b, g, s, 2, d, generator=gen) * 1.5 + torch.randn(b, g, 1, 2, 1, generator=gen)
    scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    codes, scales, offsets = quantize(x.to(CUDA), bits, group, scale_dtype)
    k_pos = torch.arange(s).expand(b, g, s).clone()
    k_pos[:, :, -5:] = -1  # empty slots
    k_pos[-1, :, : s // 2] = -1  # a row whose first half is padding
    mask = build_mask(torch.full((b, 1), s), k_pos).to(CUDA)
    q = torch.randn(b, g, n_head // g, d, generator=gen).to(CUDA, dtype)
    valid = torch.ones(b, 1, dtype=torch.bool, device=CUDA)
    valid[1 % b] = False
    return q, codes, scales, offsets, mask, valid, bits, group, d**-0.5


LLAMA, SMOLLM2 = (1, 32, 8, 4097), (8, 9, 3, 1000)  # (rows, query heads, KV heads, slots)


@pytest.mark.parametrize(
    ("shape", "bits", "dtype"),
    [(LLAMA, 8, torch.float32), (LLAMA, 4, torch.bfloat16), (SMOLLM2, 8, torch.bfloat16), (SMOLLM2, 4, torch.float32)],
)
def test_compiled_kernel_equals_pytorch_path(shape: tuple, bits: int, dtype: torch.dtype) -> None:
    b, n_head, g, s = shape
    from litkv.kvcache.kernels import quant_decode

    args = _inputs(b, n_head, g, s, 64, bits, 32, dtype)
    assert quant_decode.supported(args[0], 1, 64)
    y, w = quant_decode.decode_attend(*args, None, True)
    y_ref, w_ref = qa._quant_attend_torch(*args, None, True)
    assert y.dtype == dtype
    rtol = 1e-4 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(y.float(), y_ref.float(), atol=1e-5, rtol=rtol)
    torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("policy", "storage"), [("qh2o", "int4"), ("dense", "int8")])
def test_decode_logits_with_the_kernel_match_the_pytorch_path(policy: str, storage: str) -> None:
    """A float32 model, a ragged-free batch of 2: prefill, then 20 decode steps fed the same tokens with the kernel
    and with the PyTorch path; the logits agree within the stated bound."""
    model = tiny_gpt(3, overrides={"block_size": 1024}, device=CUDA)
    idx = random_tokens(2, 68, seed=5).to(CUDA)
    cfg = KVCacheConfig(policy, cache_length=32 if policy == "qh2o" else 80, chunk_size=16, storage=storage,
                        quant_group_size=16)  # fmt: skip

    def run(kernel: bool) -> torch.Tensor:
        qa.TRITON_DECODE = kernel
        try:
            out = []
            with torch.inference_mode(), warnings.catch_warnings(), model.kv_caches_attached(cfg, 2) as caches:
                warnings.simplefilter("ignore")
                pos = torch.arange(68, device=CUDA).expand(2, 68)
                for s in range(0, 48, 16):
                    model(idx[:, s : s + 16], pos[:, s : s + 16])
                caches.end_prefill()
                for i in range(48, 68):
                    out.append(model(idx[:, i : i + 1], pos[:, i : i + 1])[:, -1])
            return torch.stack(out)
        finally:
            qa.TRITON_DECODE = True

    got, ref = run(True), run(False)
    assert max_diff(got, ref) <= 1e-4 * (1 + ref.abs().max().item())
