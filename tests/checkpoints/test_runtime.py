"""`litkv.checkpoints.runtime`: device, dtype and threads resolved once, and `load_for_inference` for every command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_checkpoint import make_tiny_checkpoint

from litkv.checkpoints.runtime import PRECISIONS, load_for_inference, precision_dtype, resolve_dtype
from litkv.gates.gate import GATES_FILE
from litkv.modeling.weight_layout import columns_contiguous


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    make_tiny_checkpoint(out, seed=3, gates_seed=1)
    return out


def test_load_for_inference_is_the_saved_model_in_the_asked_dtype_and_threads(ckpt: Path) -> None:
    saved = make_tiny_checkpoint(ckpt.parent / "again", seed=3).double()
    threads = torch.get_num_threads()
    try:
        model, device = load_for_inference(ckpt, "64-true", "cpu", 1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert device == torch.device("cpu") and not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert model.eviction_gates is not None  # the checkpoint's gates come along (`GATES_FILE`)
    assert (ckpt / GATES_FILE).is_file()
    weight = model.transformer.h[0].attn.qkv.weight  # column-major on the CPU (`columns_contiguous`)
    assert weight.stride() == (1, weight.shape[0]) and model.lm_head.weight.t().is_contiguous()
    idx = torch.arange(5, 40)[None]
    with torch.no_grad():  # the same layout on both sides: the same kernels, the same bits on any CPU
        torch.testing.assert_close(model(idx), columns_contiguous(saved.eval())(idx), rtol=0, atol=0)


def test_precisions_are_named_once_and_refused_with_the_allowed_ones() -> None:
    assert resolve_dtype("bf16-true", torch.device("cpu")) is torch.bfloat16
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32
    assert precision_dtype("16-true", ("32-true", "16-true")) is PRECISIONS["16-true"] is torch.float16
    with pytest.raises(ValueError, match=r"precision must be one of \['32-true', '16-true'\], got '64-true' \(why\)"):
        precision_dtype("64-true", ("32-true", "16-true"), " (why)")
    with pytest.raises(ValueError, match="num_threads must be an int >= 1, got 0"):
        load_for_inference(Path("unused"), None, "cpu", 0)
