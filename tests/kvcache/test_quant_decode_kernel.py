"""The Triton kernel of a quantised cache's decode step (`litkv.kvcache.kernels.quant_decode`), run by Triton's
interpreter on the CPU (`TRITON_INTERPRET=1`), against the PyTorch path (`quant_attention._quant_attend_torch`)
and a float64 oracle (the codes dequantised in float64, then `attention.attend`).

Bounds: the kernel computes in float32 and multiplies each scale into a number where the PyTorch path multiplies
it into a sum of products, so outputs and weight sums agree within `atol=1e-5, rtol=1e-4` (float32 rounding;
float32 queries) with both; bfloat16 outputs within one bfloat16 rounding (`rtol=2**-7`).
The compiled kernel on CUDA: `tests/kvcache/test_cuda_quant_kernel.py`.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import litkv.kvcache.quant_attention as qa
from litkv.kvcache.kernels import cpu_decode
from litkv.kvcache.quantized import QuantizedSlots, quantize
from litkv.modeling.attention import attend, build_mask

pytest.importorskip("triton")

FLOAT32 = {"atol": 1e-5, "rtol": 1e-4}


@pytest.fixture
def kernel() -> object:
    """The kernel module, its kernels interpreted on the CPU (`tests/_triton_interpret.py`)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off (a CUDA GPU: tests/kvcache/test_cuda_quant_kernel.py)")
    from litkv.kvcache.kernels import quant_decode

    return quant_decode


def _case(
    bits: int, n_head: int, g: int, s: int, d: int, group: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, QuantizedSlots, torch.Tensor, torch.Tensor]:
    """A decode step of two rows: queries `(2, n_head, 1, d)`, `s` quantised slots (empty ones, a KV head with a
    run of hidden slots, a constant vector), the mask from positions and which rows' queries count."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, g, s, 2, d, generator=gen) * 1.5 + torch.randn(2, g, 1, 2, 1, generator=gen)
    x[0, 0, 1] = 0.25  # a constant vector: scale 0
    scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16  # as `QuantizedStorage`
    codes, scales, offsets = quantize(x, bits, min(group, d), scale_dtype)
    slots = QuantizedSlots(codes, scales, offsets, bits, min(group, d), dtype)
    k_pos = torch.randperm(4 * s, generator=gen)[:s].expand(2, g, s).clone()
    k_pos[:, :, :3] = -1  # empty slots
    k_pos[1, -1, s // 3 : s // 2] = -1
    q = torch.randn(2, n_head, 1, d, generator=gen).to(dtype)
    q_pos = torch.full((2, 1), 4 * s)
    return q, slots, build_mask(q_pos, k_pos), torch.tensor([[True], [False]])


def _oracle(q, slots, mask, valid, softcap=None):
    """Dequantised in float64, then the ordinary attention in float64."""
    keys, values = dataclasses.replace(slots, dtype=torch.float64).unpack()
    return attend(q.double(), keys, values, mask, 0.3, softcap, True, valid)


def _run(module, q, slots, mask, valid, need_weights=True, softcap=None, split_slots=None):
    b, n_head, _, d = q.shape
    g = slots.codes.shape[1]
    folded = q.reshape(b, g, n_head // g, d)
    args = (folded, slots.codes, slots.scales, slots.offsets, mask, valid, slots.bits, slots.group_size, 0.3)
    if module is None:
        y, w = qa._quant_attend_torch(*args, softcap, need_weights)
    else:
        y, w = module.decode_attend(*args, softcap, need_weights, split_slots)
    return y.reshape(b, n_head, d)[:, :, None].transpose(1, 2).reshape(b, 1, n_head * d), w


CASES = [  # (bits, query heads, KV heads, slots, head size, group size, slots per split)
    (8, 9, 3, 100, 64, 32, None),  # SmolLM2-135M's heads; 100 slots: one full block and one partial
    (4, 9, 3, 100, 64, 32, None),
    (4, 32, 8, 17, 32, 64, None),  # Llama-3.2-1B's heads; fewer slots than a block; one group per vector
    (8, 4, 2, 150, 16, 8, 64),  # three splits, the last partial (merged by log-sum-exp)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"int{c[0]}-{c[1]}q{c[2]}kv-{c[3]}slots")
def test_kernel_equals_pytorch_path_and_float64(kernel, case: tuple) -> None:
    bits, n_head, g, s, d, group, split = case
    q, slots, mask, valid = _case(bits, n_head, g, s, d, group)
    y, w = _run(kernel, q, slots, mask, valid, split_slots=split)
    y_torch, w_torch = _run(None, q, slots, mask, valid)
    y_ref, w_ref = _oracle(q, slots, mask, valid)
    assert y.dtype == torch.float32 and w.shape == (2, g, s)
    torch.testing.assert_close(y, y_torch, **FLOAT32)
    torch.testing.assert_close(w, w_torch, **FLOAT32)
    torch.testing.assert_close(y.double(), y_ref, **FLOAT32)
    torch.testing.assert_close(w.double(), w_ref.double(), **FLOAT32)
    assert bool((w[~mask[:, :, 0].expand(2, g, s)] == 0).all())  # hidden slots get no weight
    assert bool((w[1] == 0).all())  # the second row's query does not count
    assert torch.allclose(w[0].sum(-1), torch.full((g,), n_head / g))  # each query head's weights sum to one


def test_bfloat16_softcap_and_no_weights(kernel) -> None:
    """bfloat16 queries (output in bfloat16, one rounding from float32), soft-capping, and no weights asked."""
    q, slots, mask, valid = _case(4, 9, 3, 70, 32, 16, torch.bfloat16, seed=1)
    y, w = _run(kernel, q, slots, mask, valid, need_weights=False, softcap=2.0)
    y_torch, _ = _run(None, q, slots, mask, valid, need_weights=False, softcap=2.0)
    y_ref, _ = _oracle(q, slots, mask, valid, softcap=2.0)
    assert y.dtype == torch.bfloat16 and w.numel() == 0
    torch.testing.assert_close(y.float(), y_torch.float(), atol=1e-5, rtol=2**-7)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=2**-7)


def test_attend_dispatches_a_decode_step_to_the_kernel(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `attention.attend` (packed slots, a `None` layout): the kernel gets the call where `supported`
    (CUDA there; forced here), with the folded heads, and its result is the call's."""
    calls = []
    decode_attend = kernel.decode_attend

    def spy(*args):
        calls.append(args[0].shape)
        return decode_attend(*args)

    monkeypatch.setattr(kernel, "supported", lambda q, t, d: t == 1)
    monkeypatch.setattr(kernel, "decode_attend", spy)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q, slots, _, _ = _case(8, 9, 3, 40, 32, 32)
    got = attend(q, slots, slots, None, 0.3, None, True)
    monkeypatch.setattr(qa, "TRITON_DECODE", False)
    monkeypatch.setattr(cpu_decode, "CPU_KERNEL", False)  # the PyTorch path (the CPU kernel rounds its queries)
    want = attend(q, slots, slots, None, 0.3, None, True)
    assert calls == [torch.Size((2, 3, 3, 32))]
    torch.testing.assert_close(got, want, **FLOAT32)


def test_supported_calls() -> None:
    """Only CUDA decode steps in float32 / bfloat16 / float16 with an even head size take the kernel."""
    from litkv.kvcache.kernels.quant_decode import supported

    q = torch.zeros(1, 2, 3, 8)
    assert not supported(q, 1, 8)  # the CPU keeps the PyTorch path


# Compiles both kernels for an H100 (sm_90) to machine code without a GPU: the lowering that the interpreter skips.
_COMPILE_FOR_SM90 = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from litkv.kvcache.kernels import quant_decode as qd

POINTERS = {"Q": "*bf16", "Y": "*bf16", "Codes": "*u8", "Scales": "*bf16", "Offsets": "*bf16", "Mask": "*i1",
            "Valid": "*i1"}
FLOATS = {"sm_scale", "softcap"}

def compile(kernel, **constexprs):
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name[0].isupper():
            sig[name] = POINTERS.get(name, "*fp32")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    out = triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32))
    assert len(out.asm["cubin"]) > 0

blocks = dict(BLOCK_H=16, BLOCK_S=qd.BLOCK_S, BLOCK_D=32)
for bits in (8, 4):
    compile(qd._partial_kernel, BITS=bits, SOFTCAP=True, NEED_WEIGHTS=True, **blocks)
compile(qd._combine_kernel, HAS_VALID=True, NEED_WEIGHTS=True, BLOCK_P=4, **blocks)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_an_h100_without_one() -> None:
    """Both kernels (int8 and int4, soft-capping, weights) lowered to sm_90 machine code by Triton's own compiler and
    ptxas, no GPU needed (about 25 s of CPU: slow)."""
    path = os.pathsep.join(filter(None, (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
