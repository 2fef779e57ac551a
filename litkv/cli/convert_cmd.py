"""`litkv convert`: a Hugging Face model directory or a GGUF file -> a litkv/LitGPT checkpoint directory;
with `--quantize`, a checkpoint whose linear weights are stored as int8 / int4 codes (also from a litkv
checkpoint directory or a known model's name)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

import torch

from litkv.checkpoints.runtime import precision_dtype
from litkv.core.atomic import OUTPUT_MARKER, check_output_dir
from litkv.modeling.quant_weights import WeightQuant, parse_quantize

__all__ = ["DTYPES", "convert"]

#: This command, read by litkv/__main__.py from the source (never imported for it): `CommandSpec`.
COMMAND = {"name": "convert", "function": "convert"}

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert(
    source: Path,
    out_dir: Path,
    model_name: str | None = None,
    precision: str | None = None,
    dtype: Literal["float32", "bfloat16", "float16"] | None = None,
    quantize: str = "none",
    overwrite: bool = False,
) -> None:
    """Convert a Hugging Face model directory or a GGUF file into a checkpoint directory for litkv (and LitGPT).

    Eviction gates (`--kv-cache learned`): a GGUF file whose weights are a known model's (the same
    fingerprint) gets the gates litkv ships for it, as `litkv download` does; with `--quantize`, the float
    source's gates are kept, recorded for the quantised weights (as `--quantize` at load uses them).

    Args:
        source: A Hugging Face model directory (config.json, *.safetensors or *.bin weights, tokenizer
            files), or a `.gguf` file (llama, qwen2, qwen3; every tensor type the `gguf` package dequantizes).
        out_dir: Where to write model_config.yaml, model.safetensors and the tokenizer files. It must not
            exist or be empty (or, with --overwrite, be the output of an earlier `litkv convert`); never the
            source, a directory inside or above it, the current or home directory. It appears whole or
            not at all.
        model_name: A litgpt preset name (e.g. "Qwen2.5-0.5B"), Hugging Face directories only. Default:
            the directory name if it is a preset, else a config built from config.json (Llama, Mistral,
            Qwen2, Qwen3).
        precision: Convert the weights to "32-true", "bf16-true", "16-true" or "64-true"; Hugging Face
            directories only; default: keep.
        dtype: The weights' dtype: "float32", "bfloat16" or "float16". Default: float32 for a GGUF
            file (its weights are dequantized), the stored dtype for a Hugging Face directory. With
            --quantize: the dtype of the tensors left in float (embedding, norms).
        quantize: Store the linear weights quantised: "int8" (per output channel), "int4" (groups of 32
            input columns; the LM head int8) or "int4-gN" (groups of N). The source may then also be a
            litkv checkpoint directory or a known model's name (`smollm2-135m-instruct`). The result loads
            into the quantised layers without a float copy of their weights (CPU only); default: "none".
        overwrite: Replace an `out_dir` that an earlier `litkv convert` wrote (its marker file
            `.litkv-output.json`); any other non-empty directory is refused whatever this says.
    """
    if precision is not None:
        precision_dtype(precision)  # a bad value is refused before any file is read
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if precision is not None and dtype is not None:
        raise ValueError(f"give --dtype or --precision, not both (got {dtype!r} and {precision!r})")
    quant = parse_quantize(quantize)  # a bad value is refused before any file is read
    from litkv.checkpoints.download import known_checkpoint_dir

    source = known_checkpoint_dir(source) or Path(source)
    check_output_dir(out_dir, "convert", [source], overwrite, replace=True)  # before any file is read
    if quant.mode != "none":
        _convert_quantized(source, Path(out_dir), quant, model_name, precision, dtype, overwrite)
        return
    out = _convert_float(source, Path(out_dir), model_name, precision, dtype, overwrite)
    print(f"wrote {out}: " + _listing(out))


def _listing(out: Path) -> str:
    """The files written in `out` (its marker file left out)."""
    return ", ".join(sorted(p.name for p in out.iterdir() if p.name != OUTPUT_MARKER))


def _convert_float(
    source: Path,
    out_dir: Path,
    model_name: str | None,
    precision: str | None,
    dtype: str | None,
    overwrite: bool = False,
) -> Path:
    """A GGUF file or a Hugging Face directory -> a float checkpoint directory `out_dir`."""
    if source.suffix.lower() == ".gguf":
        if model_name is not None or precision is not None:
            raise ValueError("--model_name and --precision apply to Hugging Face directories; use --dtype for GGUF")
        from litkv.checkpoints.gguf_convert import convert_gguf

        out = convert_gguf(source, out_dir, dtype=DTYPES[dtype or "float32"], overwrite=overwrite)
        _attach_shipped_gates(out)
        return out
    from litkv.checkpoints.convert import convert_hf_checkpoint

    torch_dtype = precision_dtype(precision) if precision is not None else DTYPES.get(dtype or "")
    return convert_hf_checkpoint(source, out_dir, model_name=model_name, dtype=torch_dtype, overwrite=overwrite)


def _convert_quantized(
    source: Path,
    out_dir: Path,
    quant: WeightQuant,
    model_name: str | None,
    precision: str | None,
    dtype: str | None,
    overwrite: bool,
) -> None:
    """`convert` with `--quantize`: a litkv checkpoint directory (or known name) is quantised directly; a
    GGUF file or Hugging Face directory is converted to float in a temporary directory first."""
    from litkv.checkpoints.checkpoint import CONFIG_FILE
    from litkv.checkpoints.convert import quantize_checkpoint

    float_dtype = DTYPES.get(dtype or "")
    if (source / CONFIG_FILE).is_file():
        if model_name is not None or precision is not None:
            raise ValueError("--model_name and --precision apply to Hugging Face directories; use --dtype here")
        out = quantize_checkpoint(source, out_dir, quant, float_dtype, overwrite)
        _carry_gates(source, out)
    else:
        with tempfile.TemporaryDirectory(prefix="litkv-convert-") as tmp:
            _convert_float(source, Path(tmp) / "float", model_name, precision, dtype)
            out = quantize_checkpoint(Path(tmp) / "float", out_dir, quant, overwrite=overwrite)
            _carry_gates(Path(tmp) / "float", out)
    print(f"wrote {out} ({quant.name} weights): " + _listing(out))


def _attach_shipped_gates(ckpt: Path) -> None:
    """Add the eviction gates litkv ships for a known model to the converted `ckpt` when they were trained
    for exactly its weights (the shapes first, then the weights' fingerprint), as `litkv download` does."""
    from litkv.checkpoints.checkpoint import GATES_FILE, load_config, load_model
    from litkv.checkpoints.known import MODELS, add_shipped_gates, shipped_gates_file
    from litkv.gates.gate import EvictionGates
    from litkv.modeling.fingerprint import model_fingerprint

    config = load_config(ckpt)
    for name in MODELS:
        path = shipped_gates_file(name)
        if not path.is_file() or (ckpt / GATES_FILE).exists():
            continue
        gates = EvictionGates.load(path)
        try:
            gates.check_model(config.n_layer, config.n_query_groups, config.head_size, config.n_embd, str(path))
        except ValueError:
            continue  # another model's shape: no need to read the weights
        if gates.weights == model_fingerprint(load_model(ckpt))["weights"] and add_shipped_gates(name, ckpt):
            print(f"the weights are {name}'s: added its eviction gates (--kv-cache learned)")


def _carry_gates(float_dir: Path, out: Path) -> None:
    """The eviction gates of the float checkpoint `float_dir` (checked against its weights by `load_model`),
    written to the quantised `out` and recorded for its weights: the same gates that `--quantize` at load
    uses with the float checkpoint."""
    import dataclasses

    from litkv.checkpoints.checkpoint import GATES_FILE, load_model, save_gates
    from litkv.modeling.fingerprint import model_fingerprint

    if not (Path(float_dir) / GATES_FILE).is_file():
        return
    gates = load_model(float_dir).eviction_gates
    if gates is None:
        return
    stamped = dataclasses.replace(gates, weights=model_fingerprint(load_model(out))["weights"])
    save_gates(stamped, out / GATES_FILE)
