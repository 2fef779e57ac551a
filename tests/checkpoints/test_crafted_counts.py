"""Crafted counts (issue 47 item 4, issue 50 items 2 and 5): every count a GGUF file or a config declares
is checked against the tensors the file holds and a ceiling before anything is built, in one line naming
the file and the field; before the fix these ran for minutes into a MemoryError or gave an AssertionError
or a KeyError.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from gguf_files import TinyGGUF, write_gguf

import litkv.checkpoints.gguf_convert as gguf_convert
from litkv.checkpoints.checkpoint import CONFIG_FILE, load_model
from litkv.checkpoints.convert import convert_hf_checkpoint, quantize_checkpoint
from litkv.checkpoints.gguf_convert import convert_gguf
from litkv.modeling.quant_weights import WeightQuant

transformers = pytest.importorskip("transformers")


def _one_line(err: pytest.ExceptionInfo, *words: str) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    return message


# -- GGUF ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        ({"llama.block_count": 10**9}, "llama.block_count"),  # 98 s to a MemoryError before
        ({"llama.block_count": 3}, "llama.block_count = 3, but the file holds 1 layers"),
        ({"llama.context_length": 10**12}, "llama.context_length"),
        ({"llama.embedding_length": 10**7}, "llama.embedding_length"),
        ({"llama.feed_forward_length": 10**10}, "llama.feed_forward_length"),
        ({"llama.attention.head_count_kv": 3}, "head_count_kv (3) must divide"),  # an AssertionError before
    ],
)
def test_gguf_counts_are_checked_before_anything_is_built(tmp_path: Path, metadata: dict, field: str) -> None:
    path = tmp_path / "crafted.gguf"
    write_gguf(path, TinyGGUF(n_layer=1, n_head=4, n_kv=2, metadata=metadata))
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        convert_gguf(path, tmp_path / "out")
    assert time.perf_counter() - start < 20
    _one_line(err, str(path), field)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("limit", "field"), [("MAX_GGUF_STRING", "tokenizer.chat_template"),
                                              ("MAX_GGUF_ARRAY", "tokenizer.ggml.tokens")])  # fmt: skip
def test_gguf_strings_and_arrays_have_ceilings(tmp_path: Path, monkeypatch, limit: str, field: str) -> None:  # noqa: ANN001
    """The limits lowered so that the tiny file's own chat template (~170 bytes) and vocabulary (420
    tokens) exceed them: refused naming the field."""
    path = tmp_path / "crafted.gguf"
    write_gguf(path, TinyGGUF(n_layer=1))
    monkeypatch.setattr(gguf_convert, limit, 100)
    with pytest.raises(ValueError) as err:
        convert_gguf(path, tmp_path / "out")
    _one_line(err, str(path), repr(field), "at most 100")


# -- litkv checkpoints -------------------------------------------------------------------------------


def _edit_config(ckpt: Path, tmp_path: Path, **fields: object) -> Path:
    out = tmp_path / "edited"
    out.mkdir()
    for f in ckpt.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = yaml.safe_load((out / CONFIG_FILE).read_text())
    config.update(fields)
    (out / CONFIG_FILE).write_text(yaml.safe_dump(config))
    return out


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"n_layer": 1_000_000}, ("n_layer = 1000000", "at most")),
        ({"n_layer": 3}, ("n_layer = 3, but", "holds 2 layers")),
        ({"n_embd": 10**9}, ("n_embd",)),
        ({"padded_vocab_size": 10**9}, ("padded_vocab_size",)),
        ({"layer_kinds": "attention"}, ("layer_kinds must be a list",)),  # counted as 9 kinds before
    ],
)
@pytest.mark.parametrize("quantised", [False, True])
def test_checkpoint_config_counts(ckpt: Path, tmp_path: Path, fields: dict, words: tuple, quantised: bool) -> None:
    """The 1 KB edit of a (quantised) checkpoint's `model_config.yaml` that cost 4 minutes and 3.6 GB."""
    if quantised:
        ckpt = quantize_checkpoint(ckpt, tmp_path / "q8", WeightQuant("int8"))
    edited = _edit_config(ckpt, tmp_path, **fields)
    start = time.perf_counter()
    with pytest.raises((ValueError, TypeError)) as err:
        load_model(edited)
    assert time.perf_counter() - start < 20
    _one_line(err, str(edited / CONFIG_FILE), *words)


# -- Hugging Face configs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf_llama")
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = transformers.LlamaConfig(vocab_size=128, num_hidden_layers=2, max_position_embeddings=64, **sizes)
    transformers.LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def hf_bamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf_bamba")
    config = transformers.BambaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
                                      mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                                      mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=512)  # fmt: skip
    transformers.BambaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def _edit_hf(hf_dir: Path, tmp_path: Path, drop: str | None = None, **fields: object) -> Path:
    out = tmp_path / hf_dir.name
    out.mkdir()
    for f in hf_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config.update(fields)
    config.pop(drop, None)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("which", "drop", "fields", "words"),
    [
        ("llama", None, {"num_hidden_layers": 1_000_000}, ("num_hidden_layers = 1000000", "at most")),
        ("llama", None, {"num_hidden_layers": 3}, ("num_hidden_layers = 3, but", "holds 2 layers")),
        ("llama", None, {"num_key_value_heads": 3}, ("num_key_value_heads (3) must divide",)),
        ("llama", None, {"vocab_size": 10**9}, ("vocab_size",)),
        ("llama", None, {"num_attention_heads": "4"}, ("num_attention_heads must be a positive integer, got '4'",)),
        ("llama", None, {"hidden_size": 32.0}, ("hidden_size must be a positive integer, got 32.0",)),
        ("llama", None, {"max_position_embeddings": 0}, ("max_position_embeddings must be a positive integer",)),
        ("llama", None, {"num_key_value_heads": 0}, ("num_key_value_heads must be a positive integer, got 0",)),
        ("bamba", None, {"num_hidden_layers": 1_000_000}, ("num_hidden_layers",)),  # still running at 150 s
        ("bamba", None, {"num_hidden_layers": 6}, ("num_hidden_layers = 6, but", "holds 4 layers")),
        ("bamba", None, {"mamba_d_state": 10**6}, ("mamba_d_state",)),
        ("bamba", "mamba_d_state", {}, ("has no 'mamba_d_state'",)),  # a KeyError before
    ],
)
def test_hf_config_counts(request, tmp_path: Path, which: str, drop: str | None, fields: dict, words: tuple) -> None:  # noqa: ANN001
    hf_dir = _edit_hf(request.getfixturevalue(f"hf_{which}"), tmp_path, drop, **fields)
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        convert_hf_checkpoint(hf_dir, tmp_path / "out")
    assert time.perf_counter() - start < 20
    _one_line(err, str(hf_dir / "config.json"), *words)


# -- errors that name what the user gave (issue 47, item 9) -------------------------------------------


def test_convert_says_what_the_source_is(ckpt: Path, tmp_path: Path) -> None:
    """A litkv checkpoint given to convert is said to be one (not "a Hugging Face directory with no
    config.json"); a quantised one given to --quantize is said to be quantised (not 63 key mismatches);
    the library call leaves the gates behind (the command carries them, tests/checkpoints/test_convert_gates.py)."""
    with pytest.raises(ValueError) as err:
        convert_hf_checkpoint(ckpt, tmp_path / "out")
    _one_line(err, str(ckpt), "is a litkv checkpoint already")
    quantised = quantize_checkpoint(ckpt, tmp_path / "q8", WeightQuant("int8"))
    with pytest.raises(ValueError) as err:
        quantize_checkpoint(quantised, tmp_path / "q8again", WeightQuant("int4"))
    _one_line(err, str(quantised), "is quantised already (int8)")
    from tiny_checkpoint import make_tiny_checkpoint

    gated = tmp_path / "gated"
    make_tiny_checkpoint(gated, gates_seed=0)
    quantize_checkpoint(gated, tmp_path / "gated-q8", WeightQuant("int8"))  # gates: `litkv convert` carries them
    assert not (tmp_path / "gated-q8" / "eviction_gates.safetensors").exists()
