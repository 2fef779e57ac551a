"""`columns_contiguous`: the linear weights stored column-major keep the model's values, sharing and training,
and the model computes what a row-major copy and a float64 oracle compute (prefill and one-row decode steps)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import forward_depth, max_diff, random_tokens, rounding_bound
from torch import nn

from litkv import GPT, KVCacheConfig, generate
from litkv.checkpoints.checkpoint import load_state_dict, save_state_dict_atomic
from litkv.modeling.quant_weights import parse_quantize, quantize_model
from litkv.modeling.weight_layout import COLUMN_MAJOR_DTYPES, columns_contiguous


def _row_major(model: GPT) -> GPT:
    """`model` with every parameter made contiguous again (the layout `GPT(config)` builds)."""
    for p in model.parameters():
        p.data = p.data.contiguous()
    return model


def _linear_weights(model: nn.Module) -> list[nn.Parameter]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)]


def test_weights_keep_values_identity_and_sharing(tiny_model: Callable[..., GPT]) -> None:
    model = _row_major(tiny_model(0))
    model.lm_head.weight = model.transformer.wte.weight  # tied, as SmolLM2's
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = {n: p for n, p in model.named_parameters()}
    assert columns_contiguous(model) is model
    assert model.lm_head.weight is model.transformer.wte.weight  # still one parameter, moved once
    for name, p in model.named_parameters():
        assert p is params[name] and torch.equal(p, before[name]), name
    for w in _linear_weights(model):
        assert w.stride() == (1, w.shape[0]) and w.t().is_contiguous()
    norms = [p for n, p in model.named_parameters() if p.dim() == 1]
    assert norms and all(p.is_contiguous() for p in norms)  # only the linear layers' weights change layout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_stay_row_major(tiny_model: Callable[..., GPT], dtype: torch.dtype) -> None:
    """PyTorch's 16-bit one-row CPU products ran slower column-major: those weights keep their layout."""
    model = _row_major(tiny_model(9)).to(dtype)
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    columns_contiguous(model)
    assert all(w.is_contiguous() for w in _linear_weights(model))
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages  # nothing moved, nothing copied
    assert torch.float32 in COLUMN_MAJOR_DTYPES and dtype not in COLUMN_MAJOR_DTYPES


def test_no_parameter_is_left_in_the_loaded_file(tiny_model: Callable[..., GPT], tmp_path: Path) -> None:
    """A model loaded from safetensors (tensors in the file's one mapping) keeps none of the loaded storages,
    so the mapping can go once the loader's dict is dropped."""
    path = save_state_dict_atomic(tmp_path / "model.safetensors", tiny_model(8).state_dict())
    model = GPT(tiny_model(8).config)
    loaded = load_state_dict(path)
    model.load_state_dict(loaded, assign=True)
    storages = {t.untyped_storage().data_ptr() for t in loaded.values()}
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= storages  # assign: the file's memory
    columns_contiguous(model)
    assert not {p.untyped_storage().data_ptr() for p in model.parameters()} & storages
    assert all(torch.equal(p, loaded[n]) for n, p in model.named_parameters())


def test_quantised_layers_are_left_alone(tiny_model: Callable[..., GPT]) -> None:
    model = quantize_model(_row_major(tiny_model(1)), parse_quantize("int8"))
    buffers = {n: b.stride() for n, b in model.named_buffers()}
    columns_contiguous(model)
    assert {n: b.stride() for n, b in model.named_buffers()} == buffers
    for w in _linear_weights(model):  # the float layers left (the LM head) move
        assert w.stride() == (1, w.shape[0])


@torch.inference_mode()
def test_logits_and_decode_steps_match_row_major_and_float64(tiny_model: Callable[..., GPT]) -> None:
    """Prefill logits and one-row decode steps (the product whose kernel the layout changes) against the
    row-major model and a float64 oracle of the same weights, within float32 rounding; the same greedy
    tokens in float64 (where rounding cannot reorder the top two)."""
    cm = tiny_model(2)
    rm = _row_major(tiny_model(2))
    oracle = tiny_model(2, torch.float64)
    assert cm.lm_head.weight.stride() == (1, cm.lm_head.weight.shape[0])
    idx = random_tokens(1, 30, seed=3)
    ref = oracle(idx)
    bound = rounding_bound(ref, forward_depth(cm.config, idx.shape[1]))
    for model in (cm, rm):
        assert max_diff(model(idx), ref) <= bound
    for t in range(1, 6):  # a growing prefix, one row: the last position's logits
        prefix = idx[:, :t]
        ref = oracle(prefix)[:, -1]
        assert max_diff(cm(prefix)[:, -1], ref) <= rounding_bound(ref, forward_depth(cm.config, t))
    cfg = KVCacheConfig("dense", cache_length=64, chunk_size=8)
    prompts = [random_tokens(1, 20, seed=4)[0], random_tokens(1, 13, seed=5)[0]]
    tokens = [generate(m, prompts, 12, cfg) for m in (oracle, _row_major(tiny_model(2, torch.float64)))]
    assert all(torch.equal(a, b) for a, b in zip(*tokens, strict=True))


def test_training_and_saving_work_on_the_layout(tiny_model: Callable[..., GPT], tmp_path: Path) -> None:
    """Gradients of a column-major model equal a row-major copy's within rounding (in float64: the naive
    reference), an optimizer step keeps the layout, and the weights save and load as written."""
    cm, rm = tiny_model(6, torch.float64), _row_major(tiny_model(6, torch.float64))
    idx = random_tokens(2, 16, seed=7)
    for model in (cm, rm):
        model.train()
        model(idx).logsumexp(dim=-1).mean().backward()
    for (name, a), b in zip(cm.named_parameters(), rm.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert max_diff(a.grad, b.grad) <= 1e-12 * (1 + b.grad.abs().max().item()), name
    torch.optim.AdamW(cm.parameters(), lr=1e-3).step()
    assert all(w.stride() == (1, w.shape[0]) for w in _linear_weights(cm))
    path = save_state_dict_atomic(tmp_path / "model.safetensors", cm.state_dict())
    loaded = load_state_dict(path)
    assert all(torch.equal(loaded[n], p) for n, p in cm.state_dict().items())
