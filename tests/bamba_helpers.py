"""A tiny random Bamba (transformers' pure-PyTorch path) and the same weights in litkv, float64."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import helpers
import torch
from transformers import BambaConfig, BambaForCausalLM
from transformers.models.bamba import modeling_bamba

from litkv import GPT, Config
from litkv.modeling.hf_hybrid import hybrid_config_from_hf, hybrid_state_dict

VOCAB = 96


def tiny_bamba_config(attn_layers: tuple[int, ...] = (1, 3), n_layer: int = 4, chunk: int = 8) -> BambaConfig:
    """Width 32, 4 layers (attention at `attn_layers`), 8 SSM heads of 8 in 2 groups, state 8, conv 4."""
    return BambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=list(attn_layers),
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=chunk,
        mamba_conv_bias=True,
        max_position_embeddings=512,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def random_hf_bamba(config: BambaConfig, seed: int = 0) -> BambaForCausalLM:
    """`BambaForCausalLM` in float64 with every parameter random (A_log, dt_bias, D, norms included)."""
    torch.manual_seed(seed)
    return randomize_hybrid(BambaForCausalLM(config).double().eval())


def randomize_hybrid(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter of a transformers hybrid model random (A_log, dt_bias, D, norms included), in place
    (draws from torch's global generator); its RoPE tables, if any, in float32 as LitGPT's."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith(("dt_bias", "D")) or "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
        rotary = model.model.rotary_emb
        if rotary is not None:
            rotary.inv_freq = rotary.inv_freq.float()
    return model


def bamba_config(attn_layers: tuple[int, ...] = (1, 3), n_layer: int = 4, chunk: int = 8) -> Config:
    """`tiny_bamba_config` as a litkv `Config` (for the test model factory: `helpers.tiny_gpt(seed,
    torch.float64, config=bamba_config(...))`)."""
    return hybrid_config_from_hf(tiny_bamba_config(attn_layers, n_layer, chunk).to_dict(), "tiny-bamba")


def litkv_from_hf(hf_model: BambaForCausalLM) -> GPT:
    """The same weights in a litkv `GPT` (float64, RMSNorms in float64), made by the test model factory."""
    config = hybrid_config_from_hf(hf_model.config.to_dict(), "tiny-bamba")
    return helpers.tiny_gpt(0, torch.float64, config=config, weights=hybrid_state_dict(hf_model.state_dict(), config))


@contextmanager
def hf_in_float64() -> Iterator[None]:
    """transformers' Bamba computing in float64 throughout: its scan casts with `.float()` and its norms with
    `.to(torch.float32)`; here those keep float64 (RoPE tables stay float32 on both sides, as in LitGPT).
    A test-only patch, undone on exit."""
    original = torch.Tensor.float

    def keep64(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    def gated(self: torch.nn.Module, hidden: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if gate is not None:
            hidden = hidden * torch.nn.functional.silu(gate)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden

    def plain(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden

    saved = (modeling_bamba.BambaRMSNormGated.forward, modeling_bamba.BambaRMSNorm.forward)
    torch.Tensor.float = keep64  # type: ignore[method-assign]
    modeling_bamba.BambaRMSNormGated.forward = gated  # type: ignore[method-assign]
    modeling_bamba.BambaRMSNorm.forward = plain  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.float = original  # type: ignore[method-assign]
        modeling_bamba.BambaRMSNormGated.forward, modeling_bamba.BambaRMSNorm.forward = saved
