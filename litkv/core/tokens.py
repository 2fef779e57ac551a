"""Tokenizer helpers shared by inference, evaluation and serving.

`encode_plain` reads the control strings a text contains (``<|im_end|>``) as the special tokens they
name: for text litkv writes itself (a chat template's own text). `encode_text` reads them as text: for
what a user gave (a message's content, a document), so a document cannot close a turn and open another.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

_TEXT_PROCESSORS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without BOS/EOS added; special tokens written in `text` are special tokens."""
    if getattr(tokenizer, "backend", None) == "huggingface":
        return list(tokenizer.processor.encode(text, add_special_tokens=False).ids)
    if getattr(tokenizer, "backend", None) == "sentencepiece":
        return list(tokenizer.processor.encode(text))
    return tokenizer.encode(text, bos=False, eos=False).tolist()


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as text: nothing added, and a special token's string in `text` (``<|im_end|>``)
    tokenized as the characters it is made of, never as the control token (a Hugging Face tokenizer's
    ``encode_special_tokens``; sentencepiece never parses control strings)."""
    if getattr(tokenizer, "backend", None) == "huggingface":
        return list(_text_processor(tokenizer).encode(text, add_special_tokens=False).ids)
    return encode_plain(tokenizer, text)


def _text_processor(tokenizer: Any) -> Any:
    """A copy of `tokenizer.processor` with ``encode_special_tokens`` on (one per tokenizer; the original is
    never switched, so a thread tokenizing a template's text meanwhile is not affected)."""
    try:
        return _TEXT_PROCESSORS[tokenizer]
    except (KeyError, TypeError):
        pass
    from tokenizers import Tokenizer

    clone = Tokenizer.from_str(tokenizer.processor.to_str())
    clone.encode_special_tokens = True
    with contextlib.suppress(TypeError):  # not weakly referable: a copy per call
        _TEXT_PROCESSORS[tokenizer] = clone
    return clone
