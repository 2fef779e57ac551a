"""A tiny random Qwen3.5 (transformers' pure-PyTorch path) and the same weights in litkv, float64."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import helpers
import torch
from bamba_helpers import randomize_hybrid
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5

from litkv import GPT, Config
from litkv.modeling.hf_qwen35 import qwen35_config_from_hf, qwen35_state_dict

VOCAB = 96


def tiny_qwen35_config(n_layer: int = 4, interval: int = 2, k_heads: int = 2, v_heads: int = 4) -> Qwen3_5TextConfig:
    """Width 32, `n_layer` layers (every `interval`-th full attention, with an output gate, q/k norms and a
    quarter of each head rotated), Gated DeltaNet with `k_heads` key heads of 8 and `v_heads` value heads of 6."""
    return Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layer)],
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def random_hf_qwen35(config: Qwen3_5TextConfig, seed: int = 0) -> torch.nn.Module:
    """`Qwen3_5ForCausalLM` in float64 with every parameter random (A_log, dt_bias, norms included)."""
    torch.manual_seed(seed)
    model = modeling_qwen3_5.Qwen3_5ForCausalLM(config).double().eval()
    return randomize_hybrid(model)


def qwen35_config(n_layer: int = 4, interval: int = 2, k_heads: int = 2, v_heads: int = 4) -> Config:
    """`tiny_qwen35_config` as a litkv `Config` (for the test model factory: `helpers.tiny_gpt(seed,
    torch.float64, config=qwen35_config(...))`)."""
    return qwen35_config_from_hf(tiny_qwen35_config(n_layer, interval, k_heads, v_heads).to_dict(), "tiny-qwen3.5")


def litkv_from_hf(hf_model: torch.nn.Module, name: str = "tiny-qwen3.5") -> GPT:
    """The same weights in a litkv `GPT` (float64, RMSNorms in float64), made by the test model factory."""
    config = qwen35_config_from_hf(hf_model.config.to_dict(), name)
    return helpers.tiny_gpt(0, torch.float64, config=config, weights=qwen35_state_dict(hf_model.state_dict(), config))


@contextmanager
def hf_in_float64() -> Iterator[None]:
    """transformers' Qwen3.5 computing in float64 throughout: its norms and delta rule cast with `.float()` and
    `.to(torch.float32)`; here a float64 tensor keeps its dtype (RoPE tables stay float32 on both sides, as in
    LitGPT). A test-only patch, undone on exit."""
    original_float, original_to = torch.Tensor.float, torch.Tensor.to

    def keep_float(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self if self.dtype == torch.float64 else original_float(self, *args, **kwargs)

    def keep_to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        wants32 = (args and args[0] is torch.float32) or kwargs.get("dtype") is torch.float32
        if self.dtype == torch.float64 and wants32 and len(args) <= 1:
            return self
        return original_to(self, *args, **kwargs)

    torch.Tensor.float = keep_float  # type: ignore[method-assign]
    torch.Tensor.to = keep_to  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = original_float, original_to  # type: ignore[method-assign]
