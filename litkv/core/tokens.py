"""Tokenizer helpers shared by inference, evaluation and serving."""

from __future__ import annotations

from typing import Any


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without BOS/EOS or other special tokens (litgpt `Tokenizer`)."""
    if getattr(tokenizer, "backend", None) == "huggingface":
        return list(tokenizer.processor.encode(text, add_special_tokens=False).ids)
    if getattr(tokenizer, "backend", None) == "sentencepiece":
        return list(tokenizer.processor.encode(text))
    return tokenizer.encode(text, bos=False, eos=False).tolist()
