"""`litkv convert`: a Hugging Face model directory -> a litkv/LitGPT checkpoint directory."""

from __future__ import annotations

from pathlib import Path

from litkv.convert import convert_hf_checkpoint
from litkv.runtime import precision_dtype

__all__ = ["convert"]


def convert(hf_dir: Path, out_dir: Path, model_name: str | None = None, precision: str | None = None) -> None:
    """Convert a Hugging Face model directory into a checkpoint directory for litkv (and LitGPT).

    Args:
        hf_dir: Directory with config.json, *.safetensors (or *.bin) weights and tokenizer files.
        out_dir: Where to write model_config.yaml, model.safetensors and the tokenizer files.
        model_name: A litgpt preset name (e.g. "Qwen2.5-0.5B"). Default: the directory name if it is a
            preset, else a config built from config.json (Llama, Mistral, Qwen2, Qwen3).
        precision: Convert the weights to "32-true", "bf16-true", "16-true" or "64-true"; default: keep.
    """
    dtype = None if precision is None else precision_dtype(precision)
    out = convert_hf_checkpoint(hf_dir, out_dir, model_name=model_name, dtype=dtype)
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
