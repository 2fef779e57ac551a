"""`litkv convert`: tiny random transformers models -> litkv checkpoints; greedy tokens match HF generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import forward_depth, max_diff, rounding_bound
from tiny_checkpoint import train_tiny_tokenizer
from tokenizers import Tokenizer

from litkv.checkpoints.checkpoint import load_config, load_model
from litkv.checkpoints.convert import config_from_hf, convert_hf_checkpoint
from litkv.cli.convert_cmd import convert
from litkv.cli.generate_cmd import generate
from litkv.kvcache.config import KVCacheConfig

transformers = pytest.importorskip("transformers")

PROMPT = "The quick brown fox jumps over the lazy dog. The passkey is"
SIZES = dict(
    vocab_size=384,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=0,
    initializer_range=0.2,
)


def _save_hf(model: torch.nn.Module, hf_dir: Path) -> None:
    model.save_pretrained(hf_dir, safe_serialization=True)
    train_tiny_tokenizer(hf_dir)


def _llama(hf_dir: Path) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        **SIZES,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    _save_hf(model, hf_dir)
    return model


def _qwen2(hf_dir: Path) -> torch.nn.Module:
    config = transformers.Qwen2Config(**SIZES, tie_word_embeddings=True)
    torch.manual_seed(4)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random attention biases, so that a lost bias would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    _save_hf(model, hf_dir)
    return model


def _hf_greedy(model: torch.nn.Module, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        idx = torch.tensor([ids])
        out = model.generate(
            idx,
            attention_mask=torch.ones_like(idx),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=0,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("build", [_llama, _qwen2], ids=["llama", "qwen2"])
def test_converted_model_generates_hf_greedy_tokens(tmp_path: Path, build) -> None:
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "lit"
    hf_model = build(hf_dir)
    convert(hf_dir, out_dir)
    assert {"model_config.yaml", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out_dir.iterdir()
    }
    ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(PROMPT).ids
    expected = _hf_greedy(hf_model, ids, 24)
    assert len(set(expected)) > 3  # not a degenerate repetition
    config = load_config(out_dir)
    with torch.no_grad():  # no near-tie along HF's greedy path: rounding cannot flip an argmax on any CPU
        path = hf_model(torch.tensor([ids + expected])).logits[0, len(ids) - 1 : -1]
    top2 = path.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 2 * rounding_bound(path, forward_depth(config, 128 + 16))
    for policy in ("dense", "h2o"):  # a cache that never fills is exactly dense attention
        kv = KVCacheConfig(policy=policy, cache_length=128, chunk_size=16)
        out = generate(out_dir, prompt=[PROMPT], max_new_tokens=24, kv_cache=kv, temperature=0.0, device="cpu")
        assert out[0].tolist() == expected, policy

    # logits, not only argmaxes, match
    model = load_model(out_dir)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits
        assert max_diff(model(torch.tensor([ids])), ref) <= rounding_bound(ref, forward_depth(config, len(ids)))


def test_llama_config_fields(tmp_path: Path) -> None:
    _llama(tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "lit")
    config = load_config(tmp_path / "lit")
    assert (config.n_layer, config.n_head, config.n_query_groups, config.head_size) == (2, 4, 2, 8)
    assert config.rope_base == 50000.0
    assert config.rope_adjustments == {
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_seq_len": 32,
    }


def test_unsupported_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2'.*--model_name"):
        config_from_hf({"model_type": "gpt2"}, "x")


def test_missing_hf_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_hf_checkpoint(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "hf").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
