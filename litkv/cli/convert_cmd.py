"""`litkv convert`: a Hugging Face model directory or a GGUF file -> a litkv/LitGPT checkpoint directory."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from litkv.cli.common import PRECISIONS

__all__ = ["DTYPES", "convert"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert(
    source: Path,
    out_dir: Path,
    model_name: str | None = None,
    precision: str | None = None,
    dtype: Literal["float32", "bfloat16", "float16"] | None = None,
) -> None:
    """Convert a Hugging Face model directory or a GGUF file into a checkpoint directory for litkv (and LitGPT).

    Args:
        source: A Hugging Face model directory (config.json, *.safetensors or *.bin weights, tokenizer
            files), or a `.gguf` file (llama, qwen2, qwen3; every tensor type the `gguf` package dequantizes).
        out_dir: Where to write model_config.yaml, model.safetensors and the tokenizer files. For a GGUF
            file it must not exist or be empty, and it appears whole or not at all.
        model_name: A litgpt preset name (e.g. "Qwen2.5-0.5B"), Hugging Face directories only. Default:
            the directory name if it is a preset, else a config built from config.json (Llama, Mistral,
            Qwen2, Qwen3).
        precision: Convert the weights to "32-true", "bf16-true", "16-true" or "64-true"; Hugging Face
            directories only; default: keep.
        dtype: The weights' dtype: "float32", "bfloat16" or "float16". Default: float32 for a GGUF
            file (its weights are dequantized), the stored dtype for a Hugging Face directory.
    """
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if precision is not None and dtype is not None:
        raise ValueError(f"give --dtype or --precision, not both (got {dtype!r} and {precision!r})")
    if Path(source).suffix.lower() == ".gguf":
        if model_name is not None or precision is not None:
            raise ValueError("--model_name and --precision apply to Hugging Face directories; use --dtype for GGUF")
        from litkv.gguf_convert import convert_gguf

        out = convert_gguf(source, out_dir, dtype=DTYPES[dtype or "float32"])
    else:
        from litkv.convert import convert_hf_checkpoint

        torch_dtype = PRECISIONS[precision] if precision is not None else DTYPES.get(dtype or "")
        out = convert_hf_checkpoint(source, out_dir, model_name=model_name, dtype=torch_dtype)
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
