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
    check_output_dir(out_dir, "convert", [source], overwrite)  # before any file is read
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

        return convert_gguf(source, out_dir, dtype=DTYPES[dtype or "float32"], overwrite=overwrite)
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
    else:
        with tempfile.TemporaryDirectory(prefix="litkv-convert-") as tmp:
            _convert_float(source, Path(tmp) / "float", model_name, precision, dtype)
            out = quantize_checkpoint(Path(tmp) / "float", out_dir, quant, overwrite=overwrite)
    print(f"wrote {out} ({quant.name} weights): " + _listing(out))
