"""Every field of a config litkv reads, checked by meaning before anything is built.

A Hugging Face `config.json` (dense: llama, mistral, qwen2, qwen3; hybrid: Bamba, GraniteMoeHybrid,
Qwen3.5, Qwen3-Next), litkv's own `model_config.yaml` and a GGUF file's metadata each declare numbers a
model is built from. A field is checked for its type (an int is not a bool, a float is a real number), for
being finite, for its range (a positive count under its ceiling in `litkv.checkpoints.bounds.CEILINGS`, an
epsilon in (0, 1), a fraction in (0, 1]) and, where the model needs it, for being present. Each refusal is
one line naming the file and the field, so an edited or corrupt config never reaches a NaN logit, a
ZeroDivisionError or a KeyError.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from litkv.checkpoints.bounds import CEILINGS

__all__ = ["Field", "GGUF_FLOATS", "LITGPT_FIELDS", "check_fields", "check_hf_config", "hf_spec"]


@dataclass(frozen=True)
class Field:
    """What one field must be.

    Attributes:
        kind: ``"int"``, ``"float"``, ``"bool"``, ``"str"``, ``"map"`` (a mapping), ``"strs"`` (a list of
            strings), ``"layers"`` (a list of layer indices in ``[0, layers)``) or ``"pair"`` (two numbers,
            the second may be infinite: Bamba's `time_step_limit`).
        required: the model cannot be built without it (``null`` is then refused too).
        low, high: the closed range of an int or float (``low_open``: `low` itself excluded).
        also: values accepted besides the kind (e.g. ``"auto"``).
    """

    kind: str
    required: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    also: tuple[object, ...] = ()


def _count(ceiling: str, required: bool = False, low: int = 1) -> Field:
    return Field("int", required, low, CEILINGS[ceiling])


_EPS = Field("float", low=0.0, high=1.0, low_open=True)
_THETA = Field("float", low=0.0, high=1e12, low_open=True)
_FRACTION = Field("float", low=0.0, high=1.0, low_open=True)
_FACTOR = Field("float", low=0.0, high=1e6, low_open=True)
_EXPERTS = Field("int", low=0, high=1 << 16)  # mixture-of-experts sizes (litkv converts the dense form: 0)

#: `rope_parameters` / `rope_scaling`: the fields of the mapping.
ROPE_FIELDS: dict[str, Field] = {
    "rope_type": Field("str"), "type": Field("str"), "rope_theta": _THETA, "partial_rotary_factor": _FRACTION,
    "factor": _FACTOR, "low_freq_factor": _FACTOR, "high_freq_factor": _FACTOR,
    "original_max_position_embeddings": _count("block_size"),
}  # fmt: skip

_ATTENTION: dict[str, Field] = {
    "model_type": Field("str", True), "num_hidden_layers": _count("n_layer", True),
    "hidden_size": _count("n_embd", True), "num_attention_heads": _count("n_head", True),
    "num_key_value_heads": _count("n_query_groups"), "head_dim": _count("head_size"),
    "vocab_size": _count("vocab_size", True), "max_position_embeddings": _count("block_size"),
    "intermediate_size": _count("intermediate_size"), "rms_norm_eps": _EPS, "rope_theta": _THETA,
    "partial_rotary_factor": _FRACTION, "rope_parameters": Field("map"), "rope_scaling": Field("map"),
    "attention_bias": Field("bool"), "mlp_bias": Field("bool"), "tie_word_embeddings": Field("bool"),
    "hidden_act": Field("str"), "layer_types": Field("strs"),
}  # fmt: skip

_DENSE = {
    **_ATTENTION,
    "max_position_embeddings": _count("block_size", True),
    "intermediate_size": _count("intermediate_size", True),
    "sliding_window": _count("block_size", low=0),
    "use_sliding_window": Field("bool"),
}
_MAMBA = {
    **_ATTENTION,
    "mamba_n_heads": _count("mamba_n_heads", True), "mamba_expand": Field("int", True, 1, 64),
    "mamba_d_state": _count("mamba_d_state", True), "mamba_d_head": Field("int", False, 1, 4096, also=("auto",)),
    "mamba_n_groups": _count("mamba_n_groups"), "mamba_d_conv": _count("mamba_d_conv"),
    "mamba_chunk_size": _count("mamba_chunk_size"), "time_step_limit": Field("pair"),
    "mamba_conv_bias": Field("bool"), "mamba_proj_bias": Field("bool"), "num_local_experts": _EXPERTS,
    "num_experts": _EXPERTS, "attn_layer_indices": Field("layers"),
}  # fmt: skip
_BAMBA = {**_MAMBA, "intermediate_size": _count("intermediate_size", True)}
_GRANITE = {
    **_MAMBA,
    "shared_intermediate_size": _count("intermediate_size", True), "position_embedding_type": Field("str"),
    "embedding_multiplier": _FACTOR, "logits_scaling": _FACTOR, "residual_multiplier": _FACTOR,
    "attention_multiplier": _FACTOR, "layers_block_type": Field("strs"),
}  # fmt: skip
_QWEN35 = {
    **_ATTENTION,
    "intermediate_size": _count("intermediate_size", True),
    "linear_num_key_heads": _count("n_head", True), "linear_num_value_heads": _count("n_head", True),
    "linear_key_head_dim": _count("head_size", True), "linear_value_head_dim": _count("head_size", True),
    "linear_conv_kernel_dim": _count("mamba_d_conv"), "full_attention_interval": _count("n_layer"),
    "num_experts": _EXPERTS, "mlp_only_layers": Field("layers"), "decoder_sparse_step": _count("n_layer"),
}  # fmt: skip

#: model_type -> its fields
HF_SPECS: dict[str, dict[str, Field]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3"), _DENSE),
    "bamba": _BAMBA,
    "granitemoehybrid": _GRANITE,
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_next"), _QWEN35),
}

#: litkv's `model_config.yaml`: the fields its integer checks (`checkpoint._check_config_fields`) leave.
LITGPT_FIELDS: dict[str, Field] = {
    "norm_eps": _EPS, "rope_base": _THETA, "rotary_percentage": Field("float", low=0.0, high=1.0),
    "rope_condense_ratio": _count("block_size"), "sliding_window_size": _count("block_size"),
    "mamba_n_heads": _count("mamba_n_heads"), "mamba_head_dim": _count("mamba_head_dim"),
    "mamba_n_groups": _count("mamba_n_groups"), "mamba_d_state": _count("mamba_d_state"),
    "mamba_d_conv": _count("mamba_d_conv"), "mamba_chunk_size": _count("mamba_chunk_size"),
    "mamba_dt_min": Field("float", low=0.0, high=1e6), "gdn_n_k_heads": _count("n_head"),
    "gdn_n_v_heads": _count("n_head"), "gdn_k_head_dim": _count("head_size"), "gdn_v_head_dim": _count("head_size"),
    "gdn_d_conv": _count("mamba_d_conv"), "gdn_chunk_size": _count("mamba_chunk_size"),
    "layer_kinds": Field("strs"), "mamba_conv_bias": Field("bool"), "mamba_proj_bias": Field("bool"),
    "attn_output_gate": Field("bool"), "norm_unit_offset": Field("bool"), "norm_qk": Field("bool"),
    "bias": Field("bool"), "parallel_residual": Field("bool"),
}  # fmt: skip

#: GGUF metadata floats (after ``"{arch}."``).
GGUF_FLOATS: dict[str, Field] = {"rope.freq_base": _THETA, "attention.layer_norm_rms_epsilon": _EPS}


def hf_spec(model_type: object) -> dict[str, Field] | None:
    """The fields of a `config.json` of `model_type`, or None for a type litkv does not convert (refused later)."""
    return HF_SPECS.get(model_type) if isinstance(model_type, str) else None


def check_hf_config(hf: Mapping[str, Any], source: str) -> None:
    """Every field of a Hugging Face `config.json` mapping that litkv reads, by meaning (`HF_SPECS`); a
    multimodal Qwen3.5's `text_config` is checked as the language model's config. ValueError
    naming `source` and the field. A model type litkv does not convert is left to the converter's refusal."""
    spec = hf_spec(hf.get("model_type"))
    if spec is None:
        return
    text = hf.get("text_config") if hf.get("model_type") == "qwen3_5" else None
    if text is not None:
        if not isinstance(text, Mapping):
            raise ValueError(f"{source}: text_config must be a mapping, got {type(text).__name__} {text!r:.80}")
        check_fields({"model_type": "qwen3_5_text", **text}, spec, f"{source} text_config")
        return
    check_fields(hf, spec, source)


def check_fields(raw: Mapping[str, Any], spec: Mapping[str, Field], source: str) -> None:
    """Each field of `spec` in `raw`: present if required, else of its kind, finite, in range; the
    `rope_parameters` / `rope_scaling` mappings field by field too. One-line ValueError."""
    layers = raw.get("num_hidden_layers", raw.get("n_layer"))
    for name, field in spec.items():
        value = raw.get(name)
        if value is None:
            if field.required:
                raise ValueError(f"{source} has no {name!r}, which the model needs")
            continue
        _check_value(f"{source}: {name}", value, field, layers)
        if field.kind == "map":
            check_fields(value, ROPE_FIELDS, f"{source}: {name}")


def _check_value(where: str, value: object, field: Field, layers: object) -> None:
    if value in field.also and not isinstance(value, bool):
        return
    kind = field.kind
    if kind in ("int", "float"):
        _check_number(where, value, field)
    elif kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {type(value).__name__} {value!r:.80}")
    elif kind == "str" and not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {type(value).__name__} {value!r:.80}")
    elif kind == "map" and not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(value).__name__} {value!r:.80}")
    elif kind == "strs" and (not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value)):
        raise ValueError(f"{where} must be a list of strings (one per layer), got {value!r:.80}")
    elif kind == "layers":
        _check_layers(where, value, layers)
    elif kind == "pair":
        _check_pair(where, value)


def _check_number(where: str, value: object, field: Field) -> None:
    """An int (`kind` int) or a real number (`kind` float; ints accepted), finite and in the field's range."""
    if field.kind == "float" and isinstance(value, dict) and set(value) == {"__float__"}:  # transformers' infinity
        value = value["__float__"]
    if field.kind == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < (field.low or 0)):
        what = "a positive integer" if field.low == 1 else f"an integer >= {field.low or 0:g}"
        raise ValueError(f"{where} must be {what}, got {value!r:.80}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where} must be a number, got {type(value).__name__} {value!r:.80}")
    if not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value!r}")
    low_bad = field.low is not None and (value <= field.low if field.low_open else value < field.low)
    if field.kind == "int" and not low_bad and field.high is not None and value > field.high:
        raise ValueError(
            f"{where} = {value} is beyond any model litkv builds (at most {field.high:g}); "
            "the file is corrupt or was edited"
        )
    if low_bad or (field.high is not None and value > field.high):
        left = "(" if field.low_open else "["
        raise ValueError(f"{where} must be in {left}{field.low:g}, {field.high:g}], got {value!r}")


def _check_layers(where: str, value: object, layers: object) -> None:
    """A list of distinct layer indices in `[0, layers)` (`layers`: the declared layer count, if an int)."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ValueError(f"{where} must be a list of layer indices, got {type(value).__name__} {value!r:.80}")
    top = layers if isinstance(layers, int) and not isinstance(layers, bool) else CEILINGS["n_layer"]
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < top:
            raise ValueError(f"{where} must hold layer indices in [0, {top}), got {i!r:.40} in {value!r:.80}")
    if len(set(value)) != len(value):
        raise ValueError(f"{where} lists a layer twice: {value!r:.80}")


def _check_pair(where: str, value: object) -> None:
    """Two numbers `[low, high]`, `0 <= low <= high` (`high` may be infinite), not NaN."""
    if isinstance(value, str) or not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"{where} must be two numbers [low, high], got {value!r:.80}")
    numbers = []
    for v in value:
        v = v["__float__"] if isinstance(v, dict) and set(v) == {"__float__"} else v
        if isinstance(v, str) and v in ("Infinity", "inf"):
            v = math.inf
        if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
            raise ValueError(f"{where} must be two numbers [low, high], got {value!r:.80}")
        numbers.append(v)
    if not 0 <= numbers[0] <= numbers[1]:
        raise ValueError(f"{where} must be [low, high] with 0 <= low <= high, got {value!r:.80}")
