"""Every field of every config litkv reads, checked by meaning before anything is built (issue 61 item 5).

Each family's `config.json` is written by transformers' own config class (the reference for what a valid
file holds: it converts untouched), then each field litkv reads is given bad values one at a time: NaN,
-1, 0, a huge number, a value of the wrong type, and left out. `litkv convert` must refuse each in one line
naming the file and the field, before any weight is read (the directory holds no weights), except where the
value is one the field may take (0 for a count of experts, missing for an optional field), listed here by
hand. The same walk for litkv's `model_config.yaml` floats and a GGUF file's float metadata. Before the fix
a Qwen3.5 config with `rms_norm_eps` NaN converted and gave NaN logits, `full_attention_interval: 0` a
ZeroDivisionError and a missing `linear_num_key_heads` a KeyError.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from litkv.checkpoints.checkpoint import CONFIG_FILE, load_config
from litkv.checkpoints.config_fields import HF_SPECS, LITGPT_FIELDS
from litkv.checkpoints.convert import convert_hf_checkpoint
from litkv.checkpoints.gguf_convert import config_from_gguf

transformers = pytest.importorskip("transformers")

NAN, HUGE = math.nan, 10**30
BAD = {"nan": NAN, "-1": -1, "0": 0, "huge": HUGE, "wrong type": "x", "missing": None}


def _families() -> dict[str, dict]:
    """model_type -> a valid config.json mapping, as transformers writes it (tiny sizes)."""
    t = transformers
    small = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip
    mamba = {"mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2,
             "mamba_chunk_size": 8}  # fmt: skip
    linear = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
              "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}  # fmt: skip
    configs = {
        "llama": t.LlamaConfig(num_hidden_layers=2, **small),
        "qwen3": t.Qwen3Config(num_hidden_layers=2, head_dim=8, **small),
        "bamba": t.BambaConfig(num_hidden_layers=4, attn_layer_indices=[1, 3], **small, **mamba),
        "granitemoehybrid": t.GraniteMoeHybridConfig(
            num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"],
            shared_intermediate_size=48,
            num_local_experts=0,
            **small,
            **mamba,
        ),
        "qwen3_5_text": t.Qwen3_5TextConfig(num_hidden_layers=4, head_dim=8, **small, **linear),
        "qwen3_next": t.Qwen3NextConfig(num_hidden_layers=4, head_dim=8, num_experts=0, **small, **linear),
    }
    return {k: json.loads(json.dumps(c.to_dict())) for k, c in configs.items()}


FAMILIES = _families()
# what a field may take among the bad values (by hand, from what the model means)
ZERO_OK = {"sliding_window", "num_experts", "num_local_experts"}
REQUIRED = {  # what each converter indexes without a default
    "llama": {"num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
              "max_position_embeddings"},
    "bamba": {"num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
              "mamba_n_heads", "mamba_expand", "mamba_d_state"},
    "granitemoehybrid": {"num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
                         "shared_intermediate_size", "mamba_n_heads", "mamba_expand", "mamba_d_state",
                         "layer_types"},  # layer_types: or layers_block_type, which transformers does not write
    "qwen3_5_text": {"num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim"},
}  # fmt: skip
REQUIRED["qwen3"] = REQUIRED["llama"]
REQUIRED["qwen3_next"] = REQUIRED["qwen3_5_text"]
STRINGS = {"hidden_act", "rope_type", "type", "position_embedding_type"}


def _refused(field: str, bad: str, family: str) -> bool:
    if bad == "missing":
        return field in REQUIRED[family]
    if bad == "0":
        return field not in ZERO_OK
    return True


def _cases() -> list[tuple[str, str, str]]:
    out = []
    for family, hf in FAMILIES.items():
        for field in HF_SPECS[family]:
            if field == "model_type":
                continue
            for bad in BAD:
                if (bad == "missing" and field not in hf) or (bad == "wrong type" and field in STRINGS):
                    continue  # nothing to leave out; "x" is a string (its value checked by the converter)
                out.append((family, field, bad))
    return out


def test_every_family_converts_its_own_config_fields() -> None:
    """transformers' configs pass the checks (a check that refused a valid file would fail here)."""
    from litkv.checkpoints.config_fields import check_hf_config

    for family, hf in FAMILIES.items():
        check_hf_config(hf, f"{family}/config.json")


@pytest.mark.parametrize(("family", "field", "bad"), _cases())
def test_each_field_with_each_bad_value(tmp_path: Path, family: str, field: str, bad: str) -> None:
    hf = dict(FAMILIES[family])
    if bad == "missing":
        hf.pop(field)
    else:
        hf[field] = BAD[bad]
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(hf))
    if not _refused(field, bad, family):
        with pytest.raises(FileNotFoundError, match="no .safetensors"):  # got past the config: no weights here
            convert_hf_checkpoint(source, tmp_path / "out")
        return
    with pytest.raises(ValueError) as err:
        convert_hf_checkpoint(source, tmp_path / "out")
    message = str(err.value)
    assert "\n" not in message and str(source / "config.json") in message and repr(field)[1:-1] in message, message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("rope_parameters", [1, 2], "rope_parameters must be a mapping"),  # an AttributeError before
        ("rope_parameters", {"rope_type": "default", "rope_theta": NAN}, "rope_parameters: rope_theta must be finite"),
        ("rope_parameters", {"rope_type": "default", "partial_rotary_factor": 5}, "partial_rotary_factor must be in"),
        ("full_attention_interval", 0, "full_attention_interval must be a positive integer"),
        ("linear_num_key_heads", 10**9, "linear_num_key_heads = 1000000000 is beyond any model"),
        ("rms_norm_eps", -1, "rms_norm_eps must be in (0, 1]"),
    ],
)
def test_qwen35_probe_values(tmp_path: Path, field: str, value: object, words: str) -> None:
    """The probe's Qwen3.5 values, in a multimodal config (the fields under `text_config`)."""
    text = dict(FAMILIES["qwen3_5_text"], **{field: value})
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    with pytest.raises(ValueError, match="text_config") as err:
        convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert words in str(err.value)


def test_bamba_attn_layer_indices_as_a_string_is_named(tmp_path: Path) -> None:
    """`attn_layer_indices: "13"` was reported as missing Mamba keys (issue 61 item 10)."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(FAMILIES["bamba"], attn_layer_indices="13")))
    with pytest.raises(ValueError, match=r"config.json: attn_layer_indices must be a list of layer indices, got str"):
        convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(FAMILIES["bamba"], attn_layer_indices=[1, 13])))
    with pytest.raises(ValueError, match=r"attn_layer_indices must hold layer indices in \[0, 4\), got 13"):
        convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")


LITGPT_FLOATS = ("norm_eps", "rope_base", "rotary_percentage", "mamba_dt_min")


@pytest.mark.parametrize("field", sorted(LITGPT_FIELDS))
@pytest.mark.parametrize("bad", ["nan", "-1", "huge", "wrong type"])
def test_model_config_yaml_fields(tmp_path: Path, field: str, bad: str) -> None:
    """litkv's own `model_config.yaml` (the shipped model's, one field edited): refused at load, naming it."""
    from litkv.checkpoints.checkpoint import default_checkpoint_dir

    raw = yaml.safe_load((default_checkpoint_dir() / CONFIG_FILE).read_text())
    value = BAD[bad]
    raw[field] = [value] if field == "layer_kinds" and bad != "wrong type" else value
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(raw))
    with pytest.raises((ValueError, TypeError)) as err:
        load_config(tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / CONFIG_FILE) in message and field in message, message


@pytest.mark.parametrize("key", ["llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"])
@pytest.mark.parametrize("bad", ["nan", "-1", "0", "huge", "wrong type"])
def test_gguf_float_metadata(key: str, bad: str) -> None:
    meta = {"general.architecture": "llama", "llama.embedding_length": 32, "llama.attention.head_count": 4,
            "llama.context_length": 64, "llama.block_count": 1, "llama.feed_forward_length": 48}  # fmt: skip
    meta[key] = BAD[bad]
    tensors = {"token_embd.weight": (96, 32), "blk.0.attn_q.weight": (32, 32)}
    with pytest.raises(ValueError) as err:
        config_from_gguf(meta, tensors, "tiny", "tiny.gguf")
    assert str(err.value).startswith(f"tiny.gguf: {key}"), str(err.value)
