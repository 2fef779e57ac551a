"""Parity with Hugging Face `transformers` in bfloat16 and float16, on the families of
tests/modeling/test_hf_parity.py (same tiny random models, same LitGPT conversion).

The reference is HF's model in float64 holding the 16-bit weights (rounded once). litkv in 16 bits, one
shot and chunked through a dense cache, must be as close to it as HF's own 16-bit model is: within
`max(HF_FACTOR * HF's error, FLOOR_EPS * eps(dtype) * max|logit|)`.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from half import HALF_DTYPES, dtype_id
from helpers import max_diff, random_tokens, randomize_, tiny_config

from litkv import GPT, KVCacheConfig, forward_chunked, generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_hf_parity import COMMON_HF, FAMILIES, VOCAB, _convert  # noqa: E402

transformers = pytest.importorskip("transformers")

HF_FACTOR = 2.0
FLOOR_EPS = 2.0


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@torch.inference_mode()
def test_16bit_logits_are_as_close_to_float64_as_hf_16bit(family: str, dtype: torch.dtype) -> None:
    fam = FAMILIES[family]
    hf_config = getattr(transformers, fam.hf_class)(**{**COMMON_HF, **fam.hf_kwargs})
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    randomize_(hf, seed=1)
    hf = hf.to(dtype).eval()
    hf64 = copy.deepcopy(hf).double()
    config = tiny_config(fam.preset, **fam.overrides)
    model = GPT(config).eval()
    model.load_state_dict(_convert(fam, config, hf.state_dict()), strict=True)
    model = model.to(dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    idx = random_tokens(2, 40, 0, low=3, high=VOCAB)
    ref = hf64(input_ids=idx).logits
    hf_error = max_diff(hf(input_ids=idx).logits, ref)
    bound = max(HF_FACTOR * hf_error, FLOOR_EPS * torch.finfo(dtype).eps * ref.abs().max().item())
    ours = model(idx)
    assert ours.dtype == dtype
    assert max_diff(ours, ref) <= bound, f"one shot: {max_diff(ours, ref):.3g} > {bound:.3g} (HF {hf_error:.3g})"
    for prefill, chunk in ((4, 4), (20, 1)):
        cfg = KVCacheConfig(policy="dense", cache_length=64, chunk_size=chunk, prefill_length=prefill)
        diff = max_diff(forward_chunked(model, idx, cfg), ref)
        assert diff <= bound, f"chunks of {chunk}: {diff:.3g} > {bound:.3g} (HF {hf_error:.3g})"
    tokens = generate(model, list(idx[:, :20]), max_new_tokens=4, kv_cache=cfg)
    assert all(t.shape == (4,) and bool(((t >= 0) & (t < VOCAB)).all()) for t in tokens)
