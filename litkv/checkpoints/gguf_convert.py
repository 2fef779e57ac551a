"""A GGUF file (llama.cpp's format) -> a litkv/LitGPT checkpoint directory.

The model `Config` comes from the file's metadata for the architectures whose GGUF keys map onto
litgpt's (`GGUF_ARCHITECTURES`: llama, which llama.cpp also uses for Mistral models, qwen2, qwen3).
Weights are dequantized with ggml-org's `gguf` package (`gguf.quants.dequantize`: F32, F16, BF16,
Q4_0...Q8_0, the K-quants, the IQ and TQ types), one tensor at a time, into the requested dtype; the
query/key row permutation that llama.cpp's converter applies to llama models is undone; a missing
`output.weight` means tied embeddings (the LM head is the token embedding). The tokenizer files come
from `litkv.checkpoints.gguf_tokenizer`.

Everything that can be checked is checked before the weights are read (magic, a readable file,
architecture, tensor names, types and shapes, tokenizer data); the output directory is written
through `litkv.core.atomic.save_dir_atomic`, so it appears whole or not at all.
"""

from __future__ import annotations

import functools
import stat
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm

from litkv.checkpoints.bounds import MAX_GGUF_ARRAY, MAX_GGUF_STRING, check_ceilings, check_layer_count
from litkv.checkpoints.checkpoint import CONFIG_FILE, SAFETENSORS_FILE, check_state_dict, save_state_dict_atomic
from litkv.checkpoints.config_fields import GGUF_FLOATS, check_fields
from litkv.checkpoints.convert import config_from_hf
from litkv.checkpoints.gguf_tokenizer import check_tokenizer_metadata, tokenizer_files, write_tokenizer_files
from litkv.core.atomic import check_output_dir, save_dir_atomic, write_text_atomic
from litkv.modeling.config import Config
from litkv.modeling.model import GPT

__all__ = ["GGUF_ARCHITECTURES", "GGUF_MAGIC", "config_from_gguf", "convert_gguf", "read_gguf"]

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Architectures whose query/key rows llama.cpp's converter permutes (for its interleaved RoPE).
_PERMUTED = ("llama", "mistral")
GGUF_MAGIC = b"GGUF"

# GGUF tensor name in block i (after "blk.{i}.") -> litgpt key (after "transformer.h.{i}.").
_BLOCK_KEYS = {
    "attn_norm.weight": "norm_1.weight",
    "ffn_norm.weight": "norm_2.weight",
    "attn_output.weight": "attn.proj.weight",
    "ffn_gate.weight": "mlp.fc_1.weight",
    "ffn_up.weight": "mlp.fc_2.weight",
    "ffn_down.weight": "mlp.proj.weight",
    "attn_q_norm.weight": "attn.norm_q.weight",
    "attn_k_norm.weight": "attn.norm_k.weight",
}
_TOP_KEYS = {"token_embd.weight": "transformer.wte.weight", "output_norm.weight": "transformer.ln_f.weight",
             "output.weight": "lm_head.weight"}  # fmt: skip
_QKV = ("attn_q", "attn_k", "attn_v")


def _reader_class() -> type:
    """`gguf.GGUFReader` reading a plain `ndarray` view of its memory map: the same bytes, without
    `np.memmap`'s per-slice bookkeeping, which slows the parsing of a large vocabulary severalfold."""
    from gguf import GGUFReader

    class PlainArrayReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray)

    return PlainArrayReader


def read_gguf(path: Path):  # -> gguf.GGUFReader
    """A `gguf.GGUFReader` of `path`; ValueError naming the file for a wrong magic or a file that
    cannot be parsed (truncated or corrupt), FileNotFoundError when it does not exist."""
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if not path.is_file():  # a directory, FIFO, socket or device: named, never opened (a FIFO would block)
        raise ValueError(f"GGUF file {str(path)!r} is {_file_kind(path)}, not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file: expected magic {GGUF_MAGIC!r}, got {magic!r}")
    try:
        reader = _reader_class()(path)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({type(err).__name__}: {err})") from err
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ValueError(f"{path}: truncated GGUF file: tensor {tensor.name} ends past the end of the file")
    return reader


def _file_kind(path: Path) -> str:
    """What a path that is not a regular file is, in words."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))
    kinds += ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((words for test, words in kinds if test(mode)), "not a regular file")


def _metadata(reader: Any, source: str) -> dict[str, Any]:
    """Every metadata field as a plain Python value (strings, numbers, lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        _check_field_size(key, field, source)
        try:
            meta[key] = field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as err:
            raise ValueError(f"{source}: metadata field {key!r} cannot be read ({err})") from err
    return meta


def _check_field_size(key: str, field: Any, source: str) -> None:
    """ValueError naming the field for an array of more than `MAX_GGUF_ARRAY` elements or a string of more
    than `MAX_GGUF_STRING` bytes (checked on the parsed lengths, before any is decoded)."""
    from gguf import GGUFValueType

    if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > MAX_GGUF_ARRAY:
        raise ValueError(f"{source}: metadata field {key!r} has {len(field.data)} elements, at most {MAX_GGUF_ARRAY}")
    strings = field.data if field.types and field.types[-1] == GGUFValueType.STRING else []
    longest = max((len(field.parts[i]) for i in strings), default=0)
    if longest > MAX_GGUF_STRING:
        raise ValueError(f"{source}: metadata field {key!r} holds a {longest}-byte string, at most {MAX_GGUF_STRING}")


def _int(meta: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ValueError(f"{source}: metadata has no {key!r}, which the model config needs")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, tuple[int, ...]], name: str, source: str) -> Config:
    """The litgpt `Config` of a GGUF file from its metadata `meta` and its tensors' shapes (numpy
    order, `tensors`: name -> shape), for one of `GGUF_ARCHITECTURES`."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{source}: unsupported architecture {arch!r}; supported: {list(GGUF_ARCHITECTURES)}")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensors:
        kind = scaling if scaling != "none" else "rope_freqs.weight factors"
        raise ValueError(f"{source}: unsupported RoPE scaling ({kind}); only plain RoPE is supported")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{source}: missing tensor 'token_embd.weight'")
    _check_counts(meta, tensors, arch, source)
    check_fields(meta, {f"{arch}.{k}": f for k, f in GGUF_FLOATS.items()}, source)
    n_embd = _int(meta, f"{arch}.embedding_length", source)
    n_head = _int(meta, f"{arch}.attention.head_count", source)
    rope_key = f"{arch}.rope.dimension_count"
    head_size = _int(meta, f"{arch}.attention.key_length", source, meta.get(rope_key) or n_embd // n_head)
    rope_dims = meta.get(rope_key) or head_size
    if rope_dims != head_size:
        raise ValueError(f"{source}: RoPE on {rope_dims} of {head_size} head dimensions is not supported")
    hf = {
        "model_type": arch,
        "max_position_embeddings": _int(meta, f"{arch}.context_length", source),
        "vocab_size": tensors["token_embd.weight"][0],
        "num_hidden_layers": _int(meta, f"{arch}.block_count", source),
        "hidden_size": n_embd,
        "num_attention_heads": n_head,
        "num_key_value_heads": _int(meta, f"{arch}.attention.head_count_kv", source, n_head),
        "head_dim": head_size,
        "intermediate_size": _int(meta, f"{arch}.feed_forward_length", source),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    return config_from_hf(hf, name)


# GGUF metadata count (after "{arch}.") -> the `litkv.checkpoints.bounds.CEILINGS` key it is
_GGUF_COUNTS = {
    "block_count": "n_layer", "embedding_length": "n_embd", "attention.head_count": "n_head",
    "attention.head_count_kv": "n_query_groups", "attention.key_length": "head_size",
    "feed_forward_length": "intermediate_size", "context_length": "block_size",
}  # fmt: skip


def _check_counts(meta: dict[str, Any], tensors: dict[str, tuple[int, ...]], arch: str, source: str) -> None:
    """The metadata's counts against their ceilings, the heads against each other and the block count
    against the blocks whose tensors the file holds, before a config or a tensor list is built."""
    counts = {f"{arch}.{k}": meta[f"{arch}.{k}"] for k in _GGUF_COUNTS if f"{arch}.{k}" in meta}
    check_ceilings(counts, source, {f"{arch}.{k}": v for k, v in _GGUF_COUNTS.items()})
    check_ceilings({"token_embd.weight rows": tensors["token_embd.weight"][0]}, source,
                   {"token_embd.weight rows": "vocab_size"})  # fmt: skip
    check_layer_count(meta.get(f"{arch}.block_count"), tensors, source, f"{arch}.block_count", "the file")
    n_head, n_kv = meta.get(f"{arch}.attention.head_count"), meta.get(f"{arch}.attention.head_count_kv")
    if type(n_head) is int and type(n_kv) is int and n_kv > 0 and n_head % n_kv:
        raise ValueError(
            f"{source}: {arch}.attention.head_count_kv ({n_kv}) must divide {arch}.attention.head_count ({n_head})"
        )


def expected_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape (numpy order) of every tensor a file of `config` holds (`output.weight`
    included; it may be absent: tied embeddings)."""
    c, hs, v, inter = config.n_embd, config.head_size, config.padded_vocab_size, config.intermediate_size
    q, kv = config.n_head * hs, config.n_query_groups * hs
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, c), "output_norm.weight": (c,),
                                          "output.weight": (v, c)}  # fmt: skip
    block: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (c,), "ffn_norm.weight": (c,), "attn_q.weight": (q, c), "attn_k.weight": (kv, c),
        "attn_v.weight": (kv, c), "attn_output.weight": (c, q), "ffn_gate.weight": (inter, c),
        "ffn_up.weight": (inter, c), "ffn_down.weight": (c, inter),
    }  # fmt: skip
    if config.attn_bias:
        block.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if config.norm_qk:
        block.update({"attn_q_norm.weight": (hs,), "attn_k_norm.weight": (hs,)})
    for i in range(config.n_layer):
        shapes.update({f"blk.{i}.{key}": shape for key, shape in block.items()})
    return shapes


def _check_tensors(reader: Any, config: Config, source: str) -> None:
    """ValueError naming the tensor for an unexpected or missing tensor, a wrong shape or a type that
    `gguf` cannot dequantize."""
    from gguf import GGMLQuantizationType

    supported = [t for t in GGMLQuantizationType if _dequantizable(t)]
    expected = expected_shapes(config)
    present = set()
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if tensor.name not in expected:
            raise ValueError(f"{source}: unexpected tensor {tensor.name!r} (shape {shape}) for this config")
        if shape != expected[tensor.name]:
            raise ValueError(f"{source}: tensor {tensor.name!r} has shape {shape}, the config expects "
                             f"{expected[tensor.name]}")  # fmt: skip
        if tensor.tensor_type not in supported:
            raise ValueError(f"{source}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}; "
                             f"supported: {sorted(t.name for t in supported)}")  # fmt: skip
        present.add(tensor.name)
    missing = sorted(set(expected) - present - {"output.weight"})
    if missing:
        raise ValueError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing)")


@functools.cache
def _dequantizable(qtype: Any) -> bool:
    """Whether `gguf.quants.dequantize` reads type `qtype` to floats (tried on one block of zeros)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return True
    if qtype not in GGML_QUANT_SIZES:
        return False
    try:
        values = dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return values.dtype == np.float32


def _unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of query/key rows: `weight` (n_head * head_size, ...) with each head's
    rows in interleaved RoPE order -> rotate-half order (as in the Hugging Face model), same shape."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _dequantize(tensor: Any, dtype: torch.dtype) -> torch.Tensor:
    """The tensor's values as a torch tensor of `dtype`, shape in numpy order (rows first)."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    values = values.reshape(shape)
    if not values.flags.writeable or not values.flags.c_contiguous:
        values = np.ascontiguousarray(values).copy()
    return torch.from_numpy(values).to(dtype)


def _litgpt_key(name: str) -> str:
    """litgpt state-dict key of a GGUF tensor name other than the query/key/value ones."""
    if name in _TOP_KEYS:
        return _TOP_KEYS[name]
    _, layer, rest = name.split(".", 2)
    return f"transformer.h.{layer}.{_BLOCK_KEYS[rest]}"


def _state_dict(reader: Any, config: Config, arch: str, dtype: torch.dtype, source: str) -> dict[str, torch.Tensor]:
    """The litgpt state dict of the file's weights, dequantized tensor by tensor (progress bar)."""
    heads = {"attn_q": config.n_head, "attn_k": config.n_query_groups} if arch in _PERMUTED else {}
    state: dict[str, torch.Tensor] = {}
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (layer, "weight"/"bias") -> q, k, v
    for tensor in tqdm(reader.tensors, desc=f"converting {Path(source).name}", unit="tensor"):
        values = _dequantize(tensor, dtype)
        part = tensor.name.split(".")
        if len(part) != 4 or part[2] not in _QKV:
            state[_litgpt_key(tensor.name)] = values
            continue
        group = pending.setdefault((part[1], part[3]), {})
        group[part[2]] = _unpermute(values, heads[part[2]]) if part[2] in heads else values
        if len(group) == 3:
            state[f"transformer.h.{part[1]}.attn.qkv.{part[3]}"] = torch.cat([group[k] for k in _QKV])
            del pending[(part[1], part[3])]
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["transformer.wte.weight"]  # tied embeddings
    with torch.device("meta"):
        reference = GPT(config)
    check_state_dict(reference, state, f"converted weights of {source}")
    return state


def convert_gguf(
    gguf_file: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    command: str = "convert",
) -> Path:
    """Convert a GGUF file into a checkpoint directory that litkv and LitGPT load.

    Args:
        gguf_file: a `.gguf` file of one of `GGUF_ARCHITECTURES` with a byte-level BPE tokenizer.
        out_dir: the directory to create (`model_config.yaml`, `model.safetensors`, tokenizer files);
            it must not exist, be empty, or (with `overwrite`) be an earlier output. It appears whole or not at all.
        dtype: the weights' dtype (float32, bfloat16 or float16).
        overwrite: replace an `out_dir` that an earlier `litkv command` wrote (`check_output_dir`).
        command: the litkv command whose output this is (its marker file; `download` for a download).

    Returns:
        `out_dir`.

    Raises:
        ValueError: one line naming the file and the problem (wrong magic, truncated, unsupported
            architecture or tensor type, a shape that does not match the config, no tokenizer data).
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    path, out = Path(gguf_file), Path(out_dir)
    check_output_dir(out, command, [path], overwrite, replace=True)
    source = str(path)
    reader = read_gguf(path)
    meta = _metadata(reader, source)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}
    config = config_from_gguf(meta, shapes, path.stem, source)
    _check_tensors(reader, config, source)
    check_tokenizer_metadata(meta, config.padded_vocab_size, source)
    files = tokenizer_files(meta, config.block_size, source)
    state = _state_dict(reader, config, meta["general.architecture"], dtype, source)

    def write(tmp: Path) -> None:
        save_state_dict_atomic(tmp / SAFETENSORS_FILE, state)
        write_tokenizer_files(files, tmp)
        write_text_atomic(tmp / CONFIG_FILE, yaml.dump(asdict(config)))

    return save_dir_atomic(out, write, command, [path], overwrite)
