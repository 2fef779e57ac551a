"""`litkv convert` on a Hugging Face `GraniteMoeHybridForCausalLM` directory (dense-MLP form): its four
multipliers folded into the weights give transformers' logits and greedy tokens in float64, with RoPE or
without ("nope"), tied or untied embeddings; the mixture-of-experts form is refused in one line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import helpers
import pytest
import torch
from bamba_helpers import VOCAB, randomize_hybrid
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite

from litkv import KVCacheConfig, generate
from litkv.checkpoints.checkpoint import load_model
from litkv.checkpoints.convert import convert_hf_checkpoint

MULTIPLIERS = {
    "embedding_multiplier": 3.0,
    "logits_scaling": 4.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.3,
}


def tiny_granite(position: str, tied: bool, seed: int) -> GraniteMoeHybridForCausalLM:
    """Width 32, 3 layers (attention at 1), dense MLP of 48, every parameter random, float64."""
    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, shared_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
        num_local_experts=0, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=8, position_embedding_type=position, tie_word_embeddings=tied, pad_token_id=0,
        max_position_embeddings=512, **MULTIPLIERS,
    )  # fmt: skip
    torch.manual_seed(seed)
    return randomize_hybrid(GraniteMoeHybridForCausalLM(config).double().eval())


@contextmanager
def granite_in_float64() -> Iterator[None]:
    """transformers' Granite hybrid computing in float64 throughout (its `.float()` casts and float32 norms
    kept in float64). A test-only patch, undone on exit."""
    original = torch.Tensor.float

    def keep64(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    def gated(self: torch.nn.Module, hidden: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if gate is not None:
            hidden = hidden * torch.nn.functional.silu(gate)
        return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    def plain(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    saved = (granite.GraniteMoeHybridRMSNormGated.forward, granite.GraniteMoeHybridRMSNorm.forward)
    torch.Tensor.float = keep64  # type: ignore[method-assign]
    granite.GraniteMoeHybridRMSNormGated.forward = gated  # type: ignore[method-assign]
    granite.GraniteMoeHybridRMSNorm.forward = plain  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.float = original  # type: ignore[method-assign]
        granite.GraniteMoeHybridRMSNormGated.forward, granite.GraniteMoeHybridRMSNorm.forward = saved


@pytest.mark.parametrize(("position", "tied"), [("rope", False), ("nope", True)])
def test_convert_granite_gives_transformers_logits_and_tokens(tmp_path: Path, position: str, tied: bool) -> None:
    hf = tiny_granite(position, tied, seed=11)
    hf.save_pretrained(tmp_path / "granite", safe_serialization=True)
    model = helpers.float64_model(load_model(convert_hf_checkpoint(tmp_path / "granite", tmp_path / "ckpt")))
    assert model.config.rope_n_elem == (model.config.head_size if position == "rope" else 0)
    idx = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), granite_in_float64():
        expected = hf(idx).logits
    with torch.no_grad():
        got = model(idx)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    prompt = idx[0, :9]
    with torch.no_grad(), granite_in_float64():
        hf_tokens = hf.generate(prompt[None], max_new_tokens=6, do_sample=False)[0, 9:]
    ours = generate(model, [prompt], 6, KVCacheConfig("dense", cache_length=32, chunk_size=4))[0]
    assert ours.tolist() == hf_tokens.tolist()


def test_granite_moe_refused_in_one_line(tmp_path: Path) -> None:
    tiny_granite("rope", False, seed=0).save_pretrained(tmp_path / "g", safe_serialization=True)
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    (tmp_path / "g" / "config.json").write_text(json.dumps({**config, "num_local_experts": 4}))
    with pytest.raises(ValueError, match=r"mixture-of-experts MLPs \(num_local_experts=4\)") as err:
        convert_hf_checkpoint(tmp_path / "g", tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
