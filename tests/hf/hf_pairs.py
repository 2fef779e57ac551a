"""Tiny random transformers models of each family litkv.hf serves, and litkv's GPT with the same weights
(converted by litkv's own converter, `litkv.checkpoints.convert`, where it takes the family; LitGPT's weight
copier for Gemma, as tests/modeling/test_hf_parity.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from helpers import randomize_, tiny_config
from tiny_checkpoint import train_tiny_tokenizer

from litkv import GPT
from litkv.checkpoints.checkpoint import load_model
from litkv.checkpoints.convert import convert_hf_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from test_hf_parity import FAMILIES as PARITY_FAMILIES  # noqa: E402
from test_hf_parity import _convert  # noqa: E402

VOCAB = 320
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)

# family -> (transformers config class, its arguments beside COMMON)
ROPE_10K = dict(rope_type="default", rope_theta=10000.0)
ROPE_1M = dict(rope_type="default", rope_theta=1e6)
CONVERTED = {
    "llama": ("LlamaConfig", dict(head_dim=16, tie_word_embeddings=True, rope_parameters=ROPE_10K)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=None, rope_parameters=ROPE_10K)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_parameters=ROPE_1M)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_parameters=ROPE_1M)),
}
FAMILY_NAMES = (*CONVERTED, "gemma2", "gemma3")


def hf_and_litkv(family: str, tmp: Path, seed: int = 1) -> tuple[torch.nn.Module, GPT]:
    """(transformers model, litkv GPT) in float32, eval mode, with the same random weights."""
    import transformers

    if family == "gemma3":
        return _gemma3(seed)
    if family == "gemma2":
        fam = PARITY_FAMILIES["gemma2"]
        kwargs = {**COMMON, **fam.hf_kwargs, "max_position_embeddings": 4096}
        hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, fam.hf_class)(**kwargs))
        randomize_(hf, seed=seed)
        config = tiny_config(fam.preset, **fam.overrides, vocab_size=VOCAB, padded_vocab_size=VOCAB)
        model = GPT(config)
        model.load_state_dict(_convert(fam, config, hf.state_dict()), strict=True)
        return hf.eval(), model.eval()
    cls, kwargs = CONVERTED[family]
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**COMMON, **kwargs}))
    randomize_(hf, seed=seed)
    hf_dir, out_dir = tmp / f"{family}-hf", tmp / f"{family}-litkv"
    hf.save_pretrained(hf_dir, safe_serialization=True)
    train_tiny_tokenizer(hf_dir)
    convert_hf_checkpoint(hf_dir, out_dir)
    return hf.eval(), load_model(out_dir).eval()


def _gemma3(seed: int) -> tuple[torch.nn.Module, GPT]:
    """Gemma-3: a sliding (window 8, local RoPE base) and a global layer, q/k norms, post norms."""
    import transformers
    from litgpt.scripts import convert_hf_checkpoint as conv

    rope = {"sliding_attention": ROPE_10K, "full_attention": ROPE_1M}
    kwargs = dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=8, rope_parameters=rope)
    hf_config = transformers.Gemma3TextConfig(
        **{**COMMON, **kwargs}, layer_types=["sliding_attention", "full_attention"]
    )
    hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    randomize_(hf, seed=seed)
    config = tiny_config(
        "Gemma-3-1b-it",
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        head_size=32,
        n_query_groups=2,
        sliding_window_size=8,
        sliding_window_indices=[1, 0],
        rope_indices=[1, 0],
        attention_scores_scalar=32,
        norm_eps=hf_config.rms_norm_eps,
    )
    model = GPT(config)
    state_dict: dict[str, torch.Tensor] = {}
    conv.copy_weights_gemma_3({}, state_dict, hf.state_dict(), config=config)
    model.load_state_dict(state_dict, strict=True)
    return hf.eval(), model.eval()
