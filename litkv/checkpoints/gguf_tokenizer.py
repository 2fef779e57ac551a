"""A GGUF file's tokenizer metadata (`tokenizer.ggml.*`) -> Hugging Face tokenizer files.

Writes what a Hugging Face model directory holds: `tokenizer.json` (a byte-level BPE `tokenizers`
model: vocabulary, merges, the pre-tokenizer that `tokenizer.ggml.pre` names, control and
user-defined tokens as added tokens), `tokenizer_config.json` (special tokens, `add_bos_token`, the
chat template copied verbatim from `tokenizer.chat_template`) and `generation_config.json`
(`eos_token_id`), so that litkv and LitGPT load them with `litgpt.Tokenizer`.

Only GPT-2 style byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported. The
pre-tokenizers are those of the models' own `tokenizer.json` files; llama.cpp's `llama-vocab.cpp`
names them by the same `pre` strings and splits text by equivalent regular expressions.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from litkv.core.atomic import write_text_atomic

__all__ = ["PRE_TOKENIZERS", "TOKENIZER_FILES", "check_tokenizer_metadata", "tokenizer_files", "write_tokenizer_files"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_CONTROL, _USER_DEFINED = 3, 4

# GPT-2's split (the `ByteLevel` pre-tokenizer's own regex with `use_regex=True`).
_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTES_ONLY = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def _sequence(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": list(steps)}


_GPT2_PRE = _sequence(_GPT2)
_SMOLLM_PRE = _sequence({"type": "Digits", "individual_digits": True}, _GPT2)
_LLAMA3_PRE = _sequence(_split(_LLAMA3_REGEX), _BYTES_ONLY)
_QWEN2_PRE = _sequence(_split(_QWEN2_REGEX), _BYTES_ONLY)

#: `tokenizer.ggml.pre` -> (pre-tokenizer, normalizer, BPE `ignore_merges`), as in the models' tokenizer.json.
PRE_TOKENIZERS: dict[str, tuple[dict[str, Any], dict[str, Any] | None, bool]] = {
    "gpt2": (_GPT2_PRE, None, False),
    "gpt-2": (_GPT2_PRE, None, False),
    "smollm": (_SMOLLM_PRE, None, False),
    "starcoder": (_SMOLLM_PRE, None, False),
    "llama-bpe": (_LLAMA3_PRE, None, True),
    "llama3": (_LLAMA3_PRE, None, True),
    "llama-v3": (_LLAMA3_PRE, None, True),
    "qwen2": (_QWEN2_PRE, {"type": "NFC"}, False),
    "deepseek-r1-qwen": (_QWEN2_PRE, {"type": "NFC"}, False),
}


def _field(meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...], source: str) -> Any:
    """`meta[key]` checked to be of `kind` (None when absent)."""
    value = meta.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is int):
        raise ValueError(f"{source}: {key} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _pre_tokenizer(meta: Mapping[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
    pre = _field(meta, "tokenizer.ggml.pre", str, source)
    if pre is None or pre == "default":
        warnings.warn(f"{source}: no tokenizer.ggml.pre; splitting text as GPT-2 does", stacklevel=3)
        return PRE_TOKENIZERS["gpt2"]
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{source}: unsupported tokenizer.ggml.pre {pre!r}; supported: {sorted(PRE_TOKENIZERS)}")
    return PRE_TOKENIZERS[pre]


def check_tokenizer_metadata(meta: Mapping[str, Any], vocab_rows: int, source: str) -> None:
    """ValueError naming `source` unless `meta` holds a byte-level BPE tokenizer that fits an embedding
    of `vocab_rows` rows (tokens, token types, merges, special token ids in range, a known pre-tokenizer)."""
    model = _field(meta, "tokenizer.ggml.model", str, source)
    if model is None:
        raise ValueError(f"{source}: no tokenizer data (tokenizer.ggml.model is missing)")
    if model != "gpt2":
        raise ValueError(f"{source}: unsupported tokenizer.ggml.model {model!r}; supported: 'gpt2' (byte-level BPE)")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        values = _field(meta, key, list, source)
        if not values:
            raise ValueError(f"{source}: no tokenizer data ({key} is missing or empty)")
        if not all(isinstance(v, str) for v in values):
            raise ValueError(f"{source}: {key} must be a list of strings")
    tokens = meta["tokenizer.ggml.tokens"]
    if len(tokens) > vocab_rows:
        raise ValueError(f"{source}: {len(tokens)} tokens but the token embedding has {vocab_rows} rows")
    types = _field(meta, "tokenizer.ggml.token_type", list, source)
    if types is not None and len(types) != len(tokens):
        raise ValueError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries, expected {len(tokens)}")
    bad = [m for m in meta["tokenizer.ggml.merges"] if len(m.split(" ")) != 2]
    if bad:
        raise ValueError(f"{source}: tokenizer.ggml.merges entry {bad[0]!r} is not two tokens separated by a space")
    for name in ("bos", "eos", "unknown", "padding", "eot"):
        key = f"tokenizer.ggml.{name}_token_id"
        token_id = _field(meta, key, int, source)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(f"{source}: {key} = {token_id} is not a token id (0..{len(tokens) - 1})")
    pre = _field(meta, "tokenizer.ggml.pre", str, source)
    if pre not in (None, "default", *PRE_TOKENIZERS):
        raise ValueError(f"{source}: unsupported tokenizer.ggml.pre {pre!r}; supported: {sorted(PRE_TOKENIZERS)}")


def _added_tokens(tokens: Sequence[str], types: Sequence[int] | None) -> list[dict[str, Any]]:
    """Control tokens (special) and user-defined tokens (not special), matched before the BPE model."""
    if types is None:
        return []
    return [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind == _CONTROL,
        }  # fmt: skip
        for i, kind in enumerate(types)
        if kind in (_CONTROL, _USER_DEFINED)
    ]


def _special(meta: Mapping[str, Any], name: str) -> tuple[int | None, str | None]:
    """The id and text of special token `name` (`bos`, `eos`, `unknown`, `padding`), or (None, None)."""
    token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
    if token_id is None:
        return None, None
    return token_id, meta["tokenizer.ggml.tokens"][token_id]


def _post_processor(bos: tuple[int, str] | None, eos: tuple[int, str] | None) -> dict[str, Any]:
    """`bos` and `eos` ((id, text), or None where the file does not add them) added around each
    sequence; byte-level offsets only when neither is added."""
    if bos is None and eos is None:
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    head = [{"SpecialToken": {"id": bos[1], "type_id": 0}}] if bos is not None else []
    tail = [{"SpecialToken": {"id": eos[1], "type_id": 0}}] if eos is not None else []
    special = {text: {"id": text, "ids": [i], "tokens": [text]} for i, text in (t for t in (bos, eos) if t is not None)}
    return {
        "type": "TemplateProcessing",
        "single": [*head, {"Sequence": {"id": "A", "type_id": 0}}, *tail],
        "pair": [
            *head,
            {"Sequence": {"id": "A", "type_id": 0}},
            *tail,
            *head,
            {"Sequence": {"id": "B", "type_id": 1}},
            *tail,
        ],  # fmt: skip
        "special_tokens": special,
    }


def _added_special(meta: Mapping[str, Any], name: str) -> tuple[int, str] | None:
    """(id, text) of the BOS (`name="bos"`) or EOS token when the file asks to add it to each sequence."""
    token_id, text = _special(meta, name)
    if token_id is None or not meta.get(f"tokenizer.ggml.add_{name}_token"):
        return None
    return token_id, text


def _tokenizer_json(meta: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The `tokenizers` JSON of the file's byte-level BPE tokenizer."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    pre, normalizer, ignore_merges = _pre_tokenizer(meta, source)
    post = _post_processor(_added_special(meta, "bos"), _added_special(meta, "eos"))
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, meta.get("tokenizer.ggml.token_type")),
        "normalizer": normalizer,
        "pre_tokenizer": pre,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": list(meta["tokenizer.ggml.merges"]),
        },
    }


def _tokenizer_config(meta: Mapping[str, Any], max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens, add-BOS/EOS, the chat template (verbatim)."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        _, text = _special(meta, name)
        if text is not None:
            config[key] = text
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    config["clean_up_tokenization_spaces"] = False
    config["model_max_length"] = max_length
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


def _generation_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        token_id, _ = _special(meta, name)
        if token_id is not None:
            config[key] = token_id
    return config


def tokenizer_files(meta: Mapping[str, Any], max_length: int, source: str) -> dict[str, str]:
    """The text of each file in `TOKENIZER_FILES` for the tokenizer in `meta` (checked first:
    `check_tokenizer_metadata`); `max_length` is the model's context length."""
    return {
        "tokenizer.json": json.dumps(_tokenizer_json(meta, source), ensure_ascii=False),
        "tokenizer_config.json": json.dumps(_tokenizer_config(meta, max_length), ensure_ascii=False, indent=2),
        "generation_config.json": json.dumps(_generation_config(meta), indent=2),
    }


def write_tokenizer_files(files: Mapping[str, str], out_dir: Path) -> None:
    """Write `files` (name -> text, from `tokenizer_files`) into `out_dir`, each atomically."""
    for name, text in files.items():
        write_text_atomic(out_dir / name, text)
