"""The stored form of quantised weights: a `model.safetensors` whose linear layers hold int8 / int4 codes.

Written by `litkv convert SRC OUT --quantize int8|int4|int4-gN` (`litkv.checkpoints.convert.quantize_checkpoint`) and
read by `litkv.checkpoints.checkpoint.load_model` straight into `Int8Linear` / `Int4Linear` layers, so no float copy of
those weights is ever made. Per quantised linear layer `NAME` (every `nn.Linear` of the model; the
int4 modes store the LM head as int8, `litkv.modeling.quant_weights.layer_quant`):

- int8: `NAME.codes` `(out, in)` int8 and `NAME.scales` `(out,)` bfloat16, `w = scales[n] * codes[n, k]`;
- int4: `NAME.codes` `(out, in / 2)` uint8, two codes per byte (`int4_nibbles`: column `2j` in the low
  nibble), and `NAME.scale_zeros` `(in / group, out, 2)` bfloat16, `w = (c - 8) * scale + zero`;
- `NAME.bias` when the layer has one; every other tensor (embedding, norms) as in a float checkpoint.

The file's metadata names the scheme: `litkv_quantize` (`int8`, `int4` or `int4-gN`, the `--quantize`
string) and `litkv_quant_format` (`FORMAT_VERSION`). The int4 codes are stored in their own layout, not
the CPU kernel's packed one (which PyTorch may change), and packed at load.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from litkv.modeling.quant_weights import (
    Int4Linear,
    Int8Linear,
    WeightQuant,
    check_layer_shape,
    int4_codes,
    int4_nibbles,
    int8_codes,
    layer_quant,
    parse_quantize,
)

__all__ = ["FORMAT_VERSION", "QUANT_KEY", "attach_quantized", "quantized_tensors", "stored_quant"]

QUANT_KEY = "litkv_quantize"
FORMAT_KEY = "litkv_quant_format"
FORMAT_VERSION = "1"
_CODE_SUFFIXES = (".codes", ".scales", ".scale_zeros")


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantized_tensors(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], quant: WeightQuant
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a stored `quant` checkpoint of `state_dict` (float weights, checked
    against `model`, which may live on the meta device): each linear layer's weight replaced by its codes
    and scales (module docstring), the other tensors kept. ValueError for a layer shape the scheme cannot take."""
    out = dict(state_dict)
    for name, linear in _linears(model):
        scheme = layer_quant(name, quant)
        weight = out.pop(f"{name}.weight")
        try:
            check_layer_shape(linear.out_features, linear.in_features, scheme)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        if scheme.mode == "int8":
            out[f"{name}.codes"], out[f"{name}.scales"] = int8_codes(weight)
            continue
        codes, out[f"{name}.scale_zeros"] = int4_codes(weight, scheme.group_size)
        out[f"{name}.codes"] = int4_nibbles(codes)
    return out, {QUANT_KEY: quant.name, FORMAT_KEY: FORMAT_VERSION}


def stored_quant(path: Path, keys: list[str]) -> WeightQuant | None:
    """The scheme a safetensors weights file with tensor names `keys` is stored in (its metadata), or
    `None` for a float file. ValueError (naming the file) for codes without metadata, an unknown format
    or scheme, or a file whose header cannot be read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"{str(path)!r} is not a valid safetensors file (truncated or corrupt): {err}") from err
    if QUANT_KEY not in metadata:
        coded = [k for k in keys if k.endswith(_CODE_SUFFIXES)]
        if coded:
            raise ValueError(
                f"{str(path)!r} holds quantised weights ({coded[0]}) but no {QUANT_KEY} metadata naming the scheme;"
                " write it again with `litkv convert SRC OUT --quantize ...`"
            )
        return None
    if metadata.get(FORMAT_KEY) != FORMAT_VERSION:
        raise ValueError(
            f"{str(path)!r}: quantised-weights format {metadata.get(FORMAT_KEY)!r} is not the one this litkv "
            f"reads ({FORMAT_VERSION!r})"
        )
    try:
        quant = parse_quantize(metadata[QUANT_KEY])
    except ValueError as err:
        raise ValueError(f"{str(path)!r}: metadata {QUANT_KEY}: {err}") from None
    if quant.mode == "none":
        raise ValueError(f"{str(path)!r}: metadata {QUANT_KEY} must name int8, int4 or int4-gN, got 'none'")
    return quant


def _expected(linear: nn.Linear, scheme: WeightQuant) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Suffix -> (shape, dtype) of the stored tensors of `linear` under `scheme`."""
    n, k = linear.out_features, linear.in_features
    if scheme.mode == "int8":
        return {".codes": ((n, k), torch.int8), ".scales": ((n,), torch.bfloat16)}
    return {".codes": ((n, k // 2), torch.uint8), ".scale_zeros": ((k // scheme.group_size, n, 2), torch.bfloat16)}


def _take(state_dict: dict[str, torch.Tensor], name: str, linear: nn.Linear, scheme: WeightQuant, source: str) -> list:
    """Pop and check the stored tensors of layer `name` (ValueError naming a missing or misshapen one)."""
    tensors = []
    for suffix, (shape, dtype) in _expected(linear, scheme).items():
        key = name + suffix
        if key not in state_dict:
            raise ValueError(f"{source}: {key} is missing (expected a {scheme.name} layer of shape {shape})")
        tensor = state_dict.pop(key)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"{source}: {key} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape} for "
                f"{scheme.name} codes of a ({linear.out_features}, {linear.in_features}) layer"
            )
        tensors.append(tensor)
    return tensors


def attach_quantized(
    model: nn.Module, state_dict: dict[str, torch.Tensor], quant: WeightQuant, dtype: torch.dtype | None, source: str
) -> dict[str, torch.Tensor]:
    """Replace each `nn.Linear` of `model` (built on the meta device) by the quantised layer of its stored
    tensors in `state_dict` (consumed), and return the state dict that `model` now loads with
    `load_state_dict(assign=True)`: the other tensors cast to `dtype` (`None`: as stored) and the new
    layers' own. ValueError naming `source` and the tensor when one is missing or misshapen."""
    for name, linear in _linears(model):
        scheme = layer_quant(name, quant)
        check_layer_shape(linear.out_features, linear.in_features, scheme)
        first, second = _take(state_dict, name, linear, scheme, source)
        bias = state_dict.pop(f"{name}.bias", None)
        bias = None if bias is None or dtype is None else bias.to(dtype)
        # copies: the kernels read aligned memory, and a tensor of the file may lie at any byte offset
        if scheme.mode == "int8":
            new: nn.Module = Int8Linear(first.clone(), second.clone(), bias)
        else:
            new = Int4Linear.from_codes(first, second.clone(), scheme.group_size, bias, nibbles=True)
        del first, second
        new.weight = torch.empty(0, dtype=dtype or (torch.float32 if bias is None else bias.dtype))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        state_dict.update({f"{name}.{key}": value for key, value in new.state_dict().items()})
    if dtype is not None:
        quantized = {k for k, _ in _quant_params(model)}
        for key, value in state_dict.items():
            if key not in quantized and value.is_floating_point():
                state_dict[key] = value.to(dtype)
    return state_dict


def _quant_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) of every parameter of `model`'s quantised layers (codes, scales; biases too)."""
    return [
        (f"{name}.{key}", p)
        for name, m in model.named_modules()
        if isinstance(m, (Int8Linear, Int4Linear))
        for key, p in m.named_parameters(recurse=False)
        if key != "bias"
    ]
