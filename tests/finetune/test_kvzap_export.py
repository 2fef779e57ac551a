"""litkv's eviction gates written as KVzap's linear surrogate (`scripts/parity_kvzap.py`, `export_linear`).

The reference is Hugging Face `transformers` on the same random weights (converted with LitGPT's
converter): the exported `nn.Linear` per layer, applied to the hidden state HF's attention layer receives
(after its input norm), must give litkv's gate logits of the pre-RoPE keys litkv computes, token for token;
with a key bias (Qwen2) and without (Llama with GQA, as SmolLM2). A wrong row layout, a dropped
`1/sqrt(D)` or a dropped key bias fails by far more than float32 rounding.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import random_gates, random_tokens, randomize_, tiny_config
from litgpt.scripts import convert_hf_checkpoint as conv

from litkv import GPT

transformers = pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
FAMILIES = {
    # GQA, no key bias, RoPE as SmolLM2's (no scaling)
    "llama": (
        "LlamaConfig",
        dict(head_dim=16, rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=100000.0)),
        "SmolLM2-135M",
        dict(rope_base=100000),
        conv.copy_weights_hf_llama,
    ),
    # key bias
    "qwen2": (
        "Qwen2Config",
        dict(rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        "Qwen2.5-0.5B",
        {},
        conv.copy_weights_qwen_2_5,
    ),
}


def _parity_kvzap():  # noqa: ANN202
    sys.path.insert(0, str(SCRIPTS))
    try:
        import parity_kvzap
    finally:
        sys.path.remove(str(SCRIPTS))
    return parity_kvzap


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exported_surrogate_gives_the_gate_logits(family: str) -> None:
    hf_class, hf_kwargs, preset, overrides, copy = FAMILIES[family]
    hf_model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, hf_class)(**COMMON, **hf_kwargs), attn_implementation="eager"
    )
    randomize_(hf_model, seed=1)
    hf_model.eval()
    config = tiny_config(preset, **overrides)
    state: dict[str, torch.Tensor] = {}
    partial(copy, config, {})(state, hf_model.state_dict())
    model = GPT(config).eval()
    model.load_state_dict(state, strict=True)
    model.eviction_gates = random_gates(config, seed=3)
    attn = [layer.self_attn for layer in hf_model.model.layers]
    assert (attn[0].k_proj.bias is not None) == (family == "qwen2")

    script = _parity_kvzap()
    keys = [a.k_proj.weight for a in attn]
    weight, bias = script.export_linear(model.eviction_gates, keys, [a.k_proj.bias for a in attn])
    assert weight.shape == (config.n_layer, config.n_query_groups, config.n_embd)
    ids = random_tokens(1, 48, seed=5, low=3, high=128)
    diff, scale, _ = script.logit_difference(model, hf_model, _surrogate(weight, bias), ids)
    assert scale > 1.0
    assert diff < 1e-5 * scale, (diff, scale)  # float32 rounding of two routes to the same sums

    # the reference detects a wrong export: the 1/sqrt(D) dropped, or (Qwen2) the key bias
    assert script.logit_difference(model, hf_model, _surrogate(weight * 4.0, bias), ids)[0] > 1e-2 * scale
    if family == "qwen2":
        w0, b0 = script.export_linear(model.eviction_gates, keys, [None] * len(attn))
        assert torch.equal(w0, weight)
        assert script.logit_difference(model, hf_model, _surrogate(w0, b0), ids)[0] > 1e-2 * scale


def _surrogate(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Module:
    """A module with KVzapModel's `layers`: one `nn.Linear(C, G)` per layer holding `weight[l]`, `bias[l]`."""
    surrogate = torch.nn.Module()
    surrogate.layers = torch.nn.ModuleList()
    for w, b in zip(weight, bias, strict=True):
        linear = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            linear.weight.copy_(w)
            linear.bias.copy_(b)
        surrogate.layers.append(linear)
    return surrogate
