"""QLoRA: LoRA adapters over frozen int8 / int4 weights (`litkv.finetune.lora` over `litkv.modeling.quant_weights`).

The reference is the same model with each quantised weight replaced by its dequantised float64 weight
in a plain `nn.Linear`, the same adapters on top: the adapters' gradients must agree to float64
rounding, and the quantised base must save no weight-sized tensor for the backward (the float
reference does: that is what the check can see).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from litkv import GPT
from litkv.checkpoints.checkpoint import load_model
from litkv.cli.finetune_cmd import finetune
from litkv.finetune.data import DataArgs
from litkv.finetune.loop import EvalArgs, TrainArgs
from litkv.finetune.lora import LoRAArgs, apply_lora, mark_only_lora_as_trainable, merged_state_dict
from litkv.modeling.quant_weights import Int4Linear, Int8Linear, WeightQuant, quantize_model

TARGETS = ["attn.qkv", "attn.proj", "mlp", "lm_head"]


def _pair(tiny_model: Callable[..., GPT], mode: str) -> tuple[GPT, GPT]:
    """(float64 model with `mode` weights, float64 model with their dequantised weights), the same random
    adapters (both factors non-zero) on each."""
    quantised = quantize_model(tiny_model(seed=5, dtype=torch.float64), WeightQuant(mode))
    reference = tiny_model(seed=5, dtype=torch.float64)
    layers = dict(quantised.named_modules())
    with torch.no_grad():
        for name, linear in reference.named_modules():
            if isinstance(linear, nn.Linear):
                linear.weight.copy_(layers[name].dequantized(torch.float64))
    generator = torch.Generator().manual_seed(0)
    for model in (quantised, reference):
        apply_lora(model, LoRAArgs(r=4, alpha=8.0, targets=TARGETS))
        mark_only_lora_as_trainable(model)
        generator.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.1)
    return quantised, reference


def _loss(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _weight_shapes(model: nn.Module) -> set[tuple[int, ...]]:
    layers = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    return {s for m in layers for s in ((m.out_features, m.in_features), (m.in_features, m.out_features))}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_adapter_gradients_over_quantised_weights_are_those_over_the_dequantised_float_weights(
    tiny_model: Callable[..., GPT], mode: str
) -> None:
    quantised, reference = _pair(tiny_model, mode)
    shapes = _weight_shapes(quantised)
    idx = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (quantised, reference):
        saved: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor, saved: list = saved) -> torch.Tensor:
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _loss(model, idx)
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
        weights_saved = shapes & set(saved)
        if model is quantised:
            assert not weights_saved  # nothing of the packed weights kept as float for the backward
        else:
            assert weights_saved  # the float reference does keep its weights: the check can see them
    ours, theirs = grads
    assert set(ours) == set(theirs) and len(ours) == 2 * (5 * 2 + 1)  # (A, B) x (5 linears x 2 layers + head)
    for name, grad in ours.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grad, theirs[name], rtol=1e-9, atol=1e-12, msg=name)


def test_merged_weights_of_a_qlora_model_are_a_float_model_with_its_outputs(tiny_model: Callable[..., GPT]) -> None:
    quantised, _ = _pair(tiny_model, "int4")
    merged = merged_state_dict(quantised)
    plain = tiny_model(seed=9, dtype=torch.float64)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    idx = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(plain(idx), quantised(idx), rtol=1e-9, atol=1e-9)


def test_finetune_quantize_int4_trains_adapters_and_writes_a_float_checkpoint(tiny_ckpt: Path, tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog and the passkey is 12345. " * 40)
    out = tmp_path / "out"
    finetune(tiny_ckpt, data=DataArgs(path=text, seq_length=16, val_fraction=0.2),
             train=TrainArgs(max_steps=2, global_batch_size=2, warmup_steps=1), eval=EvalArgs(interval=2, max_iters=1),
             lora=LoRAArgs(targets=["attn.qkv", "mlp"]), out_dir=out, precision="32-true", quantize="int4")  # fmt: skip
    adapters = load_file(str(out / "final" / "lora.safetensors"))
    assert any(k.endswith("lora_B") and v.abs().max() > 0 for k, v in adapters.items())  # trained from zero
    model = load_model(out / "final")
    assert all(isinstance(m, nn.Linear) for n, m in model.named_modules() if n.endswith(("qkv", "proj", "lm_head")))
    with pytest.raises(ValueError, match="--quantize int4 trains LoRA adapters over frozen weights: needs --mode lora"):
        finetune(tiny_ckpt, mode="full", data=DataArgs(path=text, seq_length=16), out_dir=out, quantize="int4")


@pytest.mark.parametrize(("mode", "n"), [("int8", 1100), ("int4", 2048 + 64)])
def test_a_layer_of_several_blocks_multiplies_and_passes_gradients_as_its_dequantised_weight(mode: str, n: int) -> None:
    torch.manual_seed(n)
    linear = nn.Linear(64, n, bias=True)
    layer = Int8Linear.from_linear(linear) if mode == "int8" else Int4Linear.from_linear(linear, 32)
    weight = layer.dequantized(torch.float64)
    x = torch.randn(3, 20, 64, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    expected = x @ weight.T + layer.bias.double()
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(y)
    (ours,) = torch.autograd.grad(y, x, grad)
    torch.testing.assert_close(ours, grad @ weight, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the prefill path (no gradient) gives the same product
        torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
