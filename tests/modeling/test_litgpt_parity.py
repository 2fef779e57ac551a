"""`litkv.GPT` against `litgpt.GPT` on the same state dict, for shrunk LitGPT presets.

The logits are compared in float64 (`float64_model` on both sides) within `rounding_bound`, about
1e-13 of their magnitude: a formula that differs from LitGPT's anywhere shows, whatever the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from helpers import float64_model, forward_depth, max_diff, randomize_, rounding_bound, tiny_config
from litgpt.model import GPT as LitGPT
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from litkv import GPT, KVCacheConfig, forward_chunked

LLAMA3_ROPE = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64)
PRESETS = {
    # parallel residual, partial rotary (25%), LayerNorm, biases
    "pythia-14m": dict(n_query_groups=4, intermediate_size=256),
    # GQA, Llama-3 RoPE scaling
    "Llama-3.2-1B": dict(rope_adjustments=LLAMA3_ROPE),
    # soft-capping, alternating sliding window (8 < T), attention_scores_scalar, post norms
    "gemma-2-2b": dict(
        head_size=32,
        attention_scores_scalar=24,
        sliding_window_size=8,
        attention_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    # q/k norm, MQA, local/global RoPE bases chosen per layer, sliding window
    "gemma-3-1b-it": dict(
        n_layer=3, n_query_groups=1, head_size=32, sliding_window_size=8, sliding_window_indices=[1, 0, 1]
    ),
    # partial rotary (40%), shared attention norm, LM head bias
    "phi-2": dict(n_query_groups=4, intermediate_size=256),
    "SmolLM2-135M": dict(),
    "Qwen2.5-0.5B": dict(),  # qkv bias
    "Qwen3-0.6B": dict(head_size=32),  # q/k norm, head_size != n_embd / n_head
    "falcon-7b": dict(n_query_groups=1, intermediate_size=256),  # MQA, parallel residual
    "OLMo-2-1124-7B": dict(),  # q/k norm over all heads, post norms only
    "Mixtral-8x7B-v0.1": dict(n_expert=4, n_expert_per_token=2),  # MoE MLP
}
# Soft-capping runs litkv's eager attention, whose scores are float32 even in a float64 model
# (litkv/modeling/attention.py): bounded by float32's rounding.
FLOAT32_SCORES = {"gemma-2-2b"}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@torch.inference_mode()
def test_logits_equal_litgpt(preset: str) -> None:
    config = tiny_config(preset, **PRESETS[preset])
    reference = LitGPT(config).eval()
    randomize_(reference, seed=3)
    model = GPT(config).eval()
    assert sorted(model.state_dict()) == sorted(reference.state_dict())
    model.load_state_dict(reference.state_dict(), strict=True)  # a LitGPT checkpoint loads unchanged
    float64_model(reference)
    float64_model(model)
    idx = torch.randint(0, config.padded_vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = reference(idx)
    assert expected.dtype == torch.float64 and expected.std() > 0.3
    kv_cache = KVCacheConfig(policy="dense", cache_length=40, chunk_size=7, prefill_length=7)
    dtype = torch.float32 if preset in FLOAT32_SCORES else torch.float64
    bound = rounding_bound(expected, forward_depth(config, 40 + 7), dtype)
    assert max_diff(model(idx), expected) <= bound
    assert max_diff(forward_chunked(model, idx, kv_cache), expected) <= bound


def test_state_dict_shapes_equal_litgpt() -> None:
    config = tiny_config("gemma-3-1b-it", **PRESETS["gemma-3-1b-it"])
    ours = {k: v.shape for k, v in GPT(config).state_dict().items()}
    theirs = {k: v.shape for k, v in LitGPT(config).state_dict().items()}
    assert ours == theirs


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.numel())
        return out


@pytest.mark.parametrize(
    "preset,overrides",
    [
        ("SmolLM2-135M", {}),  # SDPA path
        ("gemma-2-2b", dict(head_size=16, sliding_window_size=64)),  # masked eager path (window, soft-capping)
    ],
)
@torch.inference_mode()
def test_block_size_131072_needs_no_quadratic_buffer(preset: str, overrides: dict[str, object]) -> None:
    block_size = 131072
    t = 1000
    config = tiny_config(preset, block_size=block_size, n_layer=1, **overrides)
    with LargestTensor() as probe:
        model = GPT(config).eval()
        idx = torch.randint(0, 128, (1, t))
        logits = model(idx)
        kv_cache = KVCacheConfig(policy="dense", cache_length=t, chunk_size=250, prefill_length=250)
        chunked = forward_chunked(model, idx, kv_cache)
    assert logits.shape == (1, t, 128)
    assert max_diff(chunked, logits) <= rounding_bound(logits, forward_depth(config, t + 250))
    # Nothing of size block_size^2 (1.7e10) or even block_size * T: at most a few T x T score blocks.
    assert probe.largest <= 4 * config.n_head * t * t < block_size * t
    for tensor in [*model.parameters(), *model.buffers()]:
        assert tensor.numel() < block_size * 1024
