"""Hugging Face model directory -> litkv/LitGPT checkpoint directory, with litgpt's weight converters.

The model `Config` is a litgpt preset when one is named (`model_name`) or matches the directory
name; otherwise it is built from `config.json` for the architectures listed in `HF_ARCHITECTURES`
(Llama, Mistral, Qwen2, Qwen3), which also covers small or random models that have no preset.
Hybrid models are mapped by `litkv.modeling.hf_hybrid` (Bamba, Granite-4.0-H) and
`litkv.modeling.hf_qwen35` (Qwen3.5, dense Qwen3-Next).
Weights are read from safetensors files, or from `.bin` files with `torch.load(weights_only=True)`.

`quantize_checkpoint` writes a float checkpoint directory again with its linear weights stored as int8
or int4 codes (`litkv.checkpoints.quant_store`), for `litkv convert SRC OUT --quantize ...`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from litgpt.config import name_to_config
from litgpt.scripts import convert_hf_checkpoint as lit_convert

from litkv.checkpoints.bounds import check_ceilings, check_layer_count
from litkv.checkpoints.checkpoint import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    check_checkpoint_dir,
    check_finite,
    check_state_dict,
    find_weights_file,
    load_config,
    load_state_dict,
    read_json_object,
    save_state_dict_atomic,
)
from litkv.checkpoints.config_fields import check_hf_config
from litkv.checkpoints.quant_store import quantized_tensors, stored_quant
from litkv.core.atomic import check_output_dir, save_dir_atomic, write_atomic, write_text_atomic
from litkv.modeling.config import Config, HybridConfig
from litkv.modeling.hf_hybrid import HYBRID_MODEL_TYPES, UNSUPPORTED_RECURRENT, hybrid_config_from_hf, hybrid_state_dict
from litkv.modeling.hf_qwen35 import QWEN35_MODEL_TYPES, QWEN35_MOE_TYPES, qwen35_config_from_hf, qwen35_state_dict
from litkv.modeling.model import GPT
from litkv.modeling.quant_weights import WeightQuant

__all__ = [
    "HF_ARCHITECTURES",
    "TOKENIZER_FILES",
    "config_from_hf",
    "convert_hf_checkpoint",
    "quantize_checkpoint",
    "weight_copier",
]

HF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
    "chat_template.jinja",  # transformers 5 writes a tokenizer's chat template here (Qwen3.5 ships one)
)


def _read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    if not path.is_file() and (hf_dir / CONFIG_FILE).is_file():
        raise ValueError(
            f"{str(hf_dir)!r} is a litkv checkpoint already ({CONFIG_FILE}): it loads as it is; to store it "
            "quantised give --quantize int8 or int4"
        )
    if not path.is_file():
        raise FileNotFoundError(f"Hugging Face model directory {str(hf_dir)!r} has no config.json")
    return read_json_object(path)


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and litgpt `rope_adjustments` from `rope_parameters` (transformers 5) or `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return base, None
    if kind != "llama3":
        raise NotImplementedError(f"RoPE scaling of type {kind!r} is not supported by the converter")
    adjustments = {
        "factor": float(params["factor"]),
        "low_freq_factor": float(params["low_freq_factor"]),
        "high_freq_factor": float(params["high_freq_factor"]),
        "original_max_seq_len": int(params["original_max_position_embeddings"]),
    }
    return base, adjustments


def _sliding_window(hf: dict[str, Any]) -> tuple[int | None, list[int] | None]:
    """Window size and per-layer flags (1: sliding) from `sliding_window`/`layer_types`/`use_sliding_window`."""
    window = hf.get("sliding_window")
    n_layer = hf["num_hidden_layers"]
    if not window:
        return None, None
    if hf.get("layer_types"):
        flags = [int(kind == "sliding_attention") for kind in hf["layer_types"]]
    elif hf.get("use_sliding_window", hf.get("model_type") == "mistral"):
        flags = [1] * n_layer
    else:
        flags = [0] * n_layer
    return (window, flags) if any(flags) else (None, None)


def config_from_hf(hf: dict[str, Any], name: str) -> Config:
    """A litgpt `Config` from a Hugging Face `config.json` of one of `HF_ARCHITECTURES`."""
    model_type = hf.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(
            f"cannot build a config for model_type {model_type!r}: supported are {list(HF_ARCHITECTURES)}; "
            "for other models pass --model_name with a litgpt preset name"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu' for {model_type}, got {hf['hidden_act']!r}")
    n_head = hf["num_attention_heads"]
    rope_base, rope_adjustments = _rope(hf)
    window, window_layers = _sliding_window(hf)
    return Config(
        name=name,
        block_size=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"],
        padded_vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"],
        n_embd=hf["hidden_size"],
        n_head=n_head,
        n_query_groups=hf.get("num_key_value_heads") or n_head,
        head_size=hf.get("head_dim") or hf["hidden_size"] // n_head,
        intermediate_size=hf["intermediate_size"],
        rotary_percentage=1.0,
        rope_base=rope_base,
        rope_adjustments=rope_adjustments,
        parallel_residual=False,
        bias=False,
        attn_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        norm_class_name="RMSNorm",
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        norm_qk=model_type == "qwen3",
        mlp_class_name="LLaMAMLP",
        sliding_window_size=window,
        sliding_window_indices=window_layers,
    )


def _pick_config(hf_dir: Path, hf: dict[str, Any], model_name: str | None) -> tuple[Config, str]:
    """The Config, and the name that selects litgpt's weight copy function."""
    if model_name is not None:
        if model_name not in name_to_config:
            raise ValueError(f"unknown litgpt model name {model_name!r} (see litgpt.config.name_to_config)")
        return Config.from_name(model_name), model_name
    if hf_dir.name in name_to_config:
        return Config.from_name(hf_dir.name), hf_dir.name
    family = {"qwen2": "qwen2.5", "qwen3": "qwen3"}.get(hf.get("model_type", ""), hf.get("model_type", ""))
    try:
        return config_from_hf(hf, hf_dir.name), family
    except KeyError as err:
        raise ValueError(f"{hf_dir / 'config.json'} has no {err.args[0]!r}, which a {family} model needs") from err


def _copy_fn(config: Config, name: str):
    """litgpt's weight copy function for a model, as `convert_hf_checkpoint` picks it."""
    low = name.lower()
    if "falcon" in low:
        return partial(lit_convert.copy_weights_falcon, config)
    if low.startswith("gemma-2"):
        return partial(lit_convert.copy_weights_gemma_2, {})
    if low.startswith("gemma-3"):
        return partial(lit_convert.copy_weights_gemma_3, {}, config=config)
    if low.startswith("phi"):
        return partial(lit_convert.copy_weights_phi, config, {})
    if low.startswith(("qwen2.5", "qwq")):
        return partial(lit_convert.copy_weights_qwen_2_5, config, {})
    if low.startswith("olmo-2-"):
        return partial(lit_convert.copy_weights_olmo2, config, {})
    if low.startswith("qwen3"):
        return partial(lit_convert.copy_weights_qwen_3, config, {})
    if config.mlp_class_name in ("LLaMAMLP", "GemmaMLP", "LLaMAMoE"):
        return partial(lit_convert.copy_weights_hf_llama, config, {})
    return partial(lit_convert.copy_weights_gpt_neox, config)


# a Hugging Face model_type -> the name that picks its litgpt weight copy function (`_copy_fn`)
_FAMILY_OF_TYPE = {
    "qwen2": "qwen2.5",
    "qwen3": "qwen3",
    "gemma2": "gemma-2",
    "gemma3": "gemma-3",
    "gemma3_text": "gemma-3",
}


def weight_copier(config: Config, model_type: str) -> Callable[..., None]:
    """litgpt's weight copy function for a Hugging Face model of `model_type` into a GPT of `config`, called as
    `copy(state_dict, hf_weights, saver=None, dtype=dtype)` (what `convert_hf_checkpoint` runs on each file)."""
    return _copy_fn(config, _FAMILY_OF_TYPE.get(model_type, model_type))


def _weight_files(hf_dir: Path) -> list[Path]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        files = sorted(f for f in hf_dir.glob("*.bin") if f.name != "training_args.bin")
    if not files:
        raise FileNotFoundError(f"Hugging Face model directory {str(hf_dir)!r} has no .safetensors or .bin weights")
    return files


# Hugging Face config.json count -> the `litkv.checkpoints.bounds.CEILINGS` key it is
_HF_COUNTS = {
    "num_hidden_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head",
    "num_key_value_heads": "n_query_groups", "head_dim": "head_size", "intermediate_size": "intermediate_size",
    "shared_intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
    "max_position_embeddings": "block_size", "mamba_n_heads": "mamba_n_heads", "mamba_d_head": "mamba_head_dim",
    "mamba_n_groups": "mamba_n_groups", "mamba_d_state": "mamba_d_state", "mamba_d_conv": "mamba_d_conv",
    "mamba_chunk_size": "mamba_chunk_size",
}  # fmt: skip


def _check_hf_counts(hf: dict[str, Any], hf_dir: Path) -> None:
    """`config.json`'s counts against their ceilings, its heads against each other and its layer count
    against the layers the safetensors files hold (their headers only), before anything is built."""
    source = str(hf_dir / "config.json")
    for key in _HF_COUNTS:
        value = hf.get(key)
        optional = value is None or (key == "mamba_d_head" and value == "auto")
        if not optional and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{source}: {key} must be a positive integer, got {value!r:.80}")
    check_ceilings({k: hf[k] for k in _HF_COUNTS if k in hf}, source, _HF_COUNTS)
    n_head, groups = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if type(n_head) is int and type(groups) is int and groups > 0 and n_head % groups:
        raise ValueError(f"{source}: num_key_value_heads ({groups}) must divide num_attention_heads ({n_head})")
    files = sorted(hf_dir.glob("*.safetensors"))
    if files and "num_hidden_layers" in hf:
        from safetensors import SafetensorError, safe_open

        names: list[str] = []
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    names += list(f.keys())
            except (SafetensorError, OSError) as err:
                raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
        where = f"the safetensors files of {str(hf_dir)!r}"
        check_layer_count(hf["num_hidden_layers"], names, source, "num_hidden_layers", where)


def _hybrid_config(hf: dict[str, Any], hf_dir: Path, build: Callable[..., Config] | None = None) -> Config:
    """`build` (default `hybrid_config_from_hf`), its errors one line naming `config.json` and the field."""
    source = hf_dir / "config.json"
    try:
        return (build or hybrid_config_from_hf)(hf, hf_dir.name)
    except KeyError as err:
        raise ValueError(f"{source} has no {err.args[0]!r}, which a {hf.get('model_type')} model needs") from None
    except (TypeError, ZeroDivisionError, AssertionError) as err:
        raise ValueError(f"{source}: not a valid {hf.get('model_type')} config ({type(err).__name__}: {err})") from None
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def convert_hf_checkpoint(
    hf_dir: str | Path,
    out_dir: str | Path,
    model_name: str | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a Hugging Face model directory into a checkpoint directory that litkv loads.

    Args:
        hf_dir: directory with `config.json`, weights (`*.safetensors` or `*.bin`) and tokenizer files.
        out_dir: where to write `model_config.yaml`, `model.safetensors` and the tokenizer files.
        model_name: a litgpt preset name (default: the directory name if it is one, else a config
            built from `config.json`).
        dtype: convert the weights to this dtype (default: keep the stored dtype).
        overwrite: replace an `out_dir` that an earlier `litkv convert` wrote (`check_output_dir`: any
            other non-empty directory, and one equal to, inside or above `hf_dir`, is refused).

    Returns:
        `out_dir`, written whole or not at all (`save_dir_atomic`).
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if hf_dir.exists() and not hf_dir.is_dir():
        raise ValueError(
            f"{str(hf_dir)!r} is a file, not a Hugging Face model directory: give a directory holding config.json, "
            "the weights and the tokenizer files, or a .gguf file"
        )
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"Hugging Face model directory {str(hf_dir)!r} does not exist")
    check_output_dir(out_dir, "convert", [hf_dir], overwrite, replace=True)
    hf = _read_hf_config(hf_dir)
    check_hf_config(hf, str(hf_dir / "config.json"))  # every field by meaning, before anything is built
    _check_hf_counts(hf, hf_dir)
    if hf.get("model_type") in QWEN35_MODEL_TYPES or hf.get("model_type") in QWEN35_MOE_TYPES:
        config = _hybrid_config(hf, hf_dir, qwen35_config_from_hf)  # ValueError for what litkv lacks, before any weight
        weights = {k: v for path in _weight_files(hf_dir) for k, v in load_state_dict(path).items()}
        state_dict = qwen35_state_dict(weights, config, dtype)  # type: ignore[arg-type]
    elif hf.get("model_type") in HYBRID_MODEL_TYPES or hf.get("model_type") in UNSUPPORTED_RECURRENT:
        config: Config = _hybrid_config(hf, hf_dir)  # ValueError for what litkv lacks, before any weight
        weights = {k: v for path in _weight_files(hf_dir) for k, v in load_state_dict(path).items()}
        state_dict = hybrid_state_dict(weights, config, dtype, hf)  # type: ignore[arg-type]
    else:
        config, family = _pick_config(hf_dir, hf, model_name)
        copy_fn = _copy_fn(config, family)
        state_dict = {}
        for path in _weight_files(hf_dir):
            copy_fn(state_dict, load_state_dict(path), saver=None, dtype=dtype)
    with torch.device("meta"):
        reference = GPT(config)
    check_state_dict(reference, state_dict, f"converted weights of {str(hf_dir)!r}")
    fields = asdict(config)
    if isinstance(config, HybridConfig):
        fields["layer_kinds"] = list(config.layer_kinds)  # plain YAML (safe_load refuses a Python tuple)

    def write(tmp: Path) -> None:
        save_state_dict_atomic(tmp / SAFETENSORS_FILE, state_dict)
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                write_atomic(tmp / name, partial(shutil.copyfile, hf_dir / name))
        write_text_atomic(tmp / CONFIG_FILE, yaml.dump(fields))

    return save_dir_atomic(out_dir, write, "convert", [hf_dir], overwrite)


def quantize_checkpoint(
    src_dir: str | Path,
    out_dir: str | Path,
    quant: WeightQuant,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the float checkpoint directory `src_dir` again as `out_dir` with its linear weights stored as
    `quant` says (`litkv.checkpoints.quant_store`); the other tensors cast to `dtype` (default: as stored). The config
    and the tokenizer files are copied; eviction gates are not (they were trained for the float weights).
    `out_dir` appears whole or not at all; an existing one is replaced only when an earlier `litkv
    convert` wrote it and `overwrite` is given (`check_output_dir`). ValueError for a source that is
    already quantised, a layer shape the scheme cannot take, or `quant` `none`."""
    src, out = check_checkpoint_dir(src_dir), Path(out_dir)
    if quant.mode == "none":
        raise ValueError("quantize_checkpoint needs int8, int4 or int4-gN, got 'none'")
    check_output_dir(out, "convert", [src], overwrite, replace=True)
    config = load_config(src)
    weights_file = find_weights_file(src)
    state_dict = load_state_dict(weights_file)
    stored = stored_quant(weights_file, list(state_dict)) if weights_file.suffix == ".safetensors" else None
    if stored is not None:
        raise ValueError(
            f"{str(src)!r} is quantised already ({stored.name}); quantise the float checkpoint it was made from"
        )
    check_layer_count(config.n_layer, state_dict, str(src / CONFIG_FILE), "n_layer", repr(str(weights_file)))
    with torch.device("meta"):
        reference = GPT(config)
    check_state_dict(reference, state_dict, f"weights in {str(weights_file)!r}")  # refuses quantised sources
    check_finite(state_dict, f"weights in {str(weights_file)!r}")
    if dtype is not None:
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    tensors, metadata = quantized_tensors(reference, state_dict, quant)
    del state_dict

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file

        contiguous = {k: v.contiguous() for k, v in tensors.items()}
        write_atomic(tmp / SAFETENSORS_FILE, lambda path: save_file(contiguous, str(path), metadata=metadata))
        for name in (*TOKENIZER_FILES, CONFIG_FILE):
            if (src / name).is_file():
                write_atomic(tmp / name, partial(shutil.copyfile, src / name))

    return save_dir_atomic(out, write, "convert", [src], overwrite)
