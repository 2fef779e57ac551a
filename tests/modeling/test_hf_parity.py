"""Parity with Hugging Face `transformers` on tiny random models converted with LitGPT's converter.

For each family a HF config and a shrunk LitGPT preset describe the same architecture; the HF model is
re-initialised with well-spread random weights, converted with `litgpt.scripts.convert_hf_checkpoint`,
and loaded into `litkv.GPT`. Logits (one-shot and chunked through a dense cache) must match HF's
eager implementation, and 32 greedy tokens from `litkv.generate` must equal HF's `generate`.

Both run in float32 (HF's norms and RoPE cast to float32 even in a float64 model): logits are
compared within `rounding_bound`, and the greedy tokens only where no two logits are that close.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch
from helpers import forward_depth, max_diff, random_tokens, randomize_, rounding_bound, tiny_config
from litgpt.scripts import convert_hf_checkpoint as conv

from litkv import GPT, KVCacheConfig, forward_chunked, generate

transformers = pytest.importorskip("transformers")

VOCAB = 128
COMMON_HF = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,  # no early stop: HF generates exactly max_new_tokens
)


@dataclass
class Family:
    """One architecture: its HF config, the matching shrunk LitGPT preset and the weight converter."""

    hf_class: str
    hf_kwargs: dict[str, object]
    preset: str
    overrides: dict[str, object] = field(default_factory=dict)
    converter: str = "llama"


FAMILIES = {
    # GQA, tied embeddings, Llama-3 RoPE scaling (shrunk so that all three frequency bands occur).
    "llama": Family(
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        "Llama-3.2-1B",
        dict(rope_adjustments=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64)),
    ),
    # qkv bias.
    "qwen2": Family(
        "Qwen2Config",
        dict(num_key_value_heads=2, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        "Qwen2.5-0.5B",
        converter="qwen2",
    ),
    # q/k RMSNorm, head_dim != hidden_size / n_head.
    "qwen3": Family(
        "Qwen3Config",
        dict(
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
        "Qwen3-0.6B",
        dict(head_size=32),
        converter="qwen3",
    ),
    # Soft-capping (small thresholds so that they bite), alternating sliding-window layers (window 8),
    # query_pre_attn_scalar != head_dim, scaled embeddings, post norms, (1 + w) RMSNorm, tied embeddings.
    "gemma2": Family(
        "Gemma2Config",
        dict(
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        "gemma-2-2b",
        dict(
            head_size=32,
            norm_eps=1e-6,
            attention_scores_scalar=24,
            sliding_window_size=8,
            attention_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        converter="gemma2",
    ),
    # Parallel residual, partial rotary (25%), LayerNorm with biases, MHA.
    "pythia": Family(
        "GPTNeoXConfig",
        dict(
            intermediate_size=256,
            layer_norm_eps=1e-5,
            use_parallel_residual=True,
            hidden_act="gelu",
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        ),
        "pythia-14m",
        dict(n_query_groups=4, intermediate_size=256),
        converter="gpt_neox",
    ),
}


def _convert(family: Family, config: object, hf_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run LitGPT's HF -> LitGPT weight converter for `family`."""
    state_dict: dict[str, torch.Tensor] = {}
    converters: dict[str, Callable[..., None]] = {
        "llama": partial(conv.copy_weights_hf_llama, config, {}),
        "qwen2": partial(conv.copy_weights_qwen_2_5, config, {}),
        "qwen3": partial(conv.copy_weights_qwen_3, config, {}),
        "gemma2": partial(conv.copy_weights_gemma_2, {}),
        "gpt_neox": partial(conv.copy_weights_gpt_neox, config),
    }
    converters[family.converter](state_dict, hf_weights)
    return state_dict


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, GPT]:
    """(HF model, litkv model) with the same random weights."""
    family = FAMILIES[request.param]
    hf_config = getattr(transformers, family.hf_class)(**{**COMMON_HF, **family.hf_kwargs})
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    randomize_(hf_model, seed=1)
    hf_model.eval()
    config = tiny_config(family.preset, **family.overrides)
    model = GPT(config).eval()
    model.load_state_dict(_convert(family, config, hf_model.state_dict()), strict=True)
    return hf_model, model


def _tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return random_tokens(batch, length, seed, low=3, high=VOCAB)


@torch.inference_mode()
def test_logits_match_hf(pair: tuple[torch.nn.Module, GPT]) -> None:
    hf_model, model = pair
    idx = _tokens(2, 40, seed=0)
    expected = hf_model(input_ids=idx).logits
    assert expected.std() > 0.3  # well-spread logits: the comparison is not trivially small
    bound = rounding_bound(expected, forward_depth(model.config, 64 + 20))
    assert max_diff(model(idx), expected) <= bound
    # Chunked prefill, then decode-style steps of one token, through a dense cache.
    for prefill, chunk in ((4, 4), (20, 1)):
        kv_cache = KVCacheConfig(policy="dense", cache_length=64, chunk_size=chunk, prefill_length=prefill)
        assert max_diff(forward_chunked(model, idx, kv_cache), expected) <= bound


@torch.inference_mode()
def test_greedy_tokens_match_hf(pair: tuple[torch.nn.Module, GPT]) -> None:
    hf_model, model = pair
    prompts = _tokens(2, 20, seed=1)
    kv_cache = KVCacheConfig(policy="dense", cache_length=64, chunk_size=4, prefill_length=4)
    ours = generate(model, list(prompts), max_new_tokens=32, kv_cache=kv_cache)
    hf_out = hf_model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=False,
        max_new_tokens=32,
        pad_token_id=0,
    )[:, prompts.shape[1] :]
    assert hf_out.shape == (2, 32)
    # No near-tie along HF's greedy path: rounding cannot flip an argmax on any CPU.
    logits = hf_model(input_ids=torch.cat((prompts, hf_out), dim=1)).logits[:, prompts.shape[1] - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 2 * rounding_bound(logits, forward_depth(model.config, 64 + 4))
    for row, new_tokens in enumerate(ours):
        assert new_tokens.tolist() == hf_out[row].tolist()
