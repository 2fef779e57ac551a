"""Small GGUF files for the tests, written with `gguf.GGUFWriter`: random weights in any tensor type,
a byte-level BPE tokenizer trained here (`tokenizers`), llama.cpp's query/key permutation for llama."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import regex
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 12:45 and I'll pay 3,141.59 dollars!",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 31415926 and x=42; y = 7*6.",
    "naïve café résumé — Ünïcödé 日本語のテキスト 中文 한국어 emoji 🎉🚀 αβγ Привет мир",
    "    indented code:\n\tdef f(x):\n\t\treturn x ** 2  # square\n\n\nTHE END   \r\n",
    "We're they're you've he'd she'll WE'RE DON'T it's ISN'T",
    "def main():\n    print('hello, world')\n    return {\"a\": [1, 2, 3]}\n",
]
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _training_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """How the training text is split for `pre` (so that merges never cross the model's own splits)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "qwen2"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT), "isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level


@functools.cache
def train_bpe(pre: str, vocab_size: int = 420) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens in id order, merges as "a b") of a byte-level BPE trained on a small text; the
    `SPECIALS` are ids 0, 1, 2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _training_pre_tokenizer(pre)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(_TEXT * 20, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tuple(tokens), tuple(merges)


@dataclass
class TinyGGUF:
    """What `write_gguf` writes. `qtypes` are cycled over the 2-D weights in file order."""

    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 256
    n_head: int = 4
    n_kv: int = 2
    intermediate: int = 512
    tied: bool = False
    pre: str = "gpt2"
    qtypes: tuple[str, ...] = ("F32",)
    add_bos: bool = False
    tokenizer: bool = True
    arch_name: str | None = None  # general.architecture, when it must differ from `arch`
    kv_heads_in_metadata: int | None = None  # head_count_kv written, when it must differ from `n_kv`
    extra_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    head_dim: int | None = None  # default n_embd // n_head
    metadata: dict[str, int] = field(default_factory=dict)  # integer fields written over the derived ones

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


def permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `convert_hf_to_gguf.py` permutation of query/key rows (rotate-half -> interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """`values` quantized to `qtype`, or random blocks of `qtype` where `gguf` cannot quantize to it
    (bytes below 0x30, so that every f16/f32 scale in a block is finite and below 1)."""
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = values.shape
        return rng.integers(0, 0x30, size=(rows, cols // block * size), dtype=np.uint8)


def _weights(spec: TinyGGUF, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 weights in Hugging Face layout, by GGUF tensor name."""
    c, hs, inter = spec.n_embd, spec.head_size, spec.intermediate
    w = {"token_embd.weight": rng.normal(0, 1, (vocab, c)), "output_norm.weight": 1 + 0.1 * rng.normal(size=c)}
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = 1 + 0.1 * rng.normal(size=c)
        w[b + "attn_q.weight"] = rng.normal(0, 0.1, (spec.n_head * hs, c))
        w[b + "attn_k.weight"] = rng.normal(0, 0.1, (spec.n_kv * hs, c))
        w[b + "attn_v.weight"] = rng.normal(0, 0.1, (spec.n_kv * hs, c))
        w[b + "attn_output.weight"] = rng.normal(0, 0.1, (c, spec.n_head * hs))
        if spec.arch == "qwen2":
            w[b + "attn_q.bias"] = rng.normal(0, 0.5, spec.n_head * hs)
            w[b + "attn_k.bias"] = rng.normal(0, 0.5, spec.n_kv * hs)
            w[b + "attn_v.bias"] = rng.normal(0, 0.5, spec.n_kv * hs)
        if spec.arch == "qwen3":
            w[b + "attn_q_norm.weight"] = 1 + 0.1 * rng.normal(size=hs)
            w[b + "attn_k_norm.weight"] = 1 + 0.1 * rng.normal(size=hs)
        w[b + "ffn_norm.weight"] = 1 + 0.1 * rng.normal(size=c)
        w[b + "ffn_gate.weight"] = rng.normal(0, 0.1, (inter, c))
        w[b + "ffn_up.weight"] = rng.normal(0, 0.1, (inter, c))
        w[b + "ffn_down.weight"] = rng.normal(0, 0.1, (c, inter))
    if not spec.tied:
        w["output.weight"] = rng.normal(0, 0.1, (vocab, c))
    return {k: v.astype(np.float32) for k, v in w.items()}


def _write_metadata(writer: gguf.GGUFWriter, spec: TinyGGUF, tokens: tuple[str, ...], merges: tuple[str, ...]) -> None:
    writer.add_context_length(512)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.intermediate)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.kv_heads_in_metadata or spec.n_kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    if spec.arch == "llama":
        writer.add_rope_dimension_count(spec.head_size)
    if spec.head_dim is not None:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    for key, value in spec.metadata.items():  # a crafted file: counts that do not match its tensors
        writer.kv_data[0][key] = gguf.GGUFValue(value, gguf.GGUFValueType.UINT64)
    if not spec.tokenizer:
        return
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(list(tokens))
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(list(merges))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(spec.add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(path: Path, spec: TinyGGUF, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Write the GGUF file `spec` to `path`; return its weights (float32, Hugging Face layout: before
    the permutation and the quantization) and each tensor's type name, by GGUF tensor name."""
    rng = np.random.default_rng(seed)
    tokens, merges = train_bpe(spec.pre)
    weights = _weights(spec, len(tokens), rng)
    writer = gguf.GGUFWriter(str(path), spec.arch_name or spec.arch)
    _write_metadata(writer, spec, tokens, merges)
    types: dict[str, str] = {}
    matrices = 0
    for name, values in weights.items():
        stored = values
        if spec.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            stored = permute(values, spec.n_head if "attn_q" in name else spec.n_kv)
        qtype = gguf.GGMLQuantizationType.F32
        if values.ndim == 2:
            qtype = gguf.GGMLQuantizationType[spec.qtypes[matrices % len(spec.qtypes)]]
            matrices += 1
        writer.add_tensor(name, _encode(stored, qtype, rng), raw_dtype=qtype)
        types[name] = qtype.name
    for name, values in spec.extra_tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights, types


def dequantizable_types() -> tuple[str, ...]:
    """Every tensor type that `gguf.quants.dequantize` reads (F32, F16, BF16, Q*, K-quants, IQ*, TQ*, ...)."""
    names = []
    for qtype in gguf.GGMLQuantizationType:
        if qtype not in gguf.GGML_QUANT_SIZES:
            continue
        try:
            gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        except NotImplementedError:
            continue
        names.append(qtype.name)
    return tuple(names)


def llama_cpp_split(text: str, patterns: list[str]) -> list[str]:
    """llama.cpp's `unicode_regex_split`: each regex splits every piece into its matches and the gaps between."""
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            at = 0
            for match in regex.finditer(pattern, piece):
                out += [piece[at : match.start()], match.group()]
                at = match.end()
            out.append(piece[at:])
        pieces = [p for p in out if p]
    return pieces


# llama.cpp's llama-vocab.cpp regexes for each pre-tokenizer type (copied verbatim).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_CPP_REGEXES = {
    "gpt2": [_GPT2_RE],
    "smollm": [r"\p{N}", _GPT2_RE],
    "llama-bpe": [
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],  # fmt: skip
    "qwen2": [
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],  # fmt: skip
}
