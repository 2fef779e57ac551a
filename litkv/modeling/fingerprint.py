"""The model's fingerprint: which config, weights and eviction gates a cache state was taken from.

A cache state restores only into the model it was taken from (`litkv.states.state.restore`), and the state
stores key their entries by it (`litkv.states.state_store`). The weights' part covers every element of every
parameter, computed where the parameters live and memoised until one of them changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from litkv.gates.gate import EvictionGates
    from litkv.modeling.model import GPT

__all__ = ["gates_fingerprint", "model_fingerprint", "weights_fingerprint"]

_WEIGHT_HASHES: weakref.WeakKeyDictionary[GPT, tuple[tuple[int, ...], str]] = weakref.WeakKeyDictionary()
_K = 1024  # a parameter's digest works on rows of this many elements
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# odd 64-bit multipliers (golden ratio and another odd constant, as signed int64)
_MUL, _ADD = -7046029254386353131, 7155164730210238489


def _parameter_digest(p: torch.Tensor) -> torch.Tensor:
    """`()` int64: sum over the elements of `bits_i * m_i` mod 2^64, with `m_i` an odd multiplier per position.

    Computed where the parameter lives (no copy to the host; integer arithmetic, so the same value on
    every device and in any reduction order). Any change to any single element changes it: its bit
    pattern changes by `d != 0`, the sum by `d * m_i`, and an odd `m_i` is invertible mod 2^64. The
    multiplier of position `i = r * K + k` is `col[k] * row[r]`, a product of two odd numbers.
    """
    flat = p.detach().contiguous().reshape(-1)
    bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % _K)).view(-1, _K)
    col = _odd(torch.arange(_K, dtype=torch.int64, device=flat.device), 0)
    row = _odd(torch.arange(bits.shape[0], dtype=torch.int64, device=flat.device), 1)
    return ((bits * col).sum(dim=1) * row).sum()


def _odd(index: torch.Tensor, salt: int) -> torch.Tensor:
    """An odd int64 per index (a multiplicative hash of it, wrapping mod 2^64)."""
    return (index * _MUL + (_ADD + salt)).bitwise_or_(1)


def model_fingerprint(model: GPT) -> dict[str, str]:
    """`{"model_config": sha256 of the config, "weights": sha256 of names, shapes, dtypes and each
    parameter's `_parameter_digest` (every element counts)}`, plus `"eviction_gates"` (sha256 of the
    gates' tensors, window and sinks) when the model has gates.

    Memoised until a parameter changes (version counter or storage); a model with inference tensors
    (built under `torch.inference_mode`, no version counter) is hashed at every call.
    """
    cfg = {k: v for k, v in dataclasses.asdict(model.config).items() if k not in ("name", "hf_config")}
    config_hash = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
    params = list(model.named_parameters())
    versions = tuple(-1 if p.is_inference() else p._version for _, p in params) + tuple(p.data_ptr() for _, p in params)
    cached = _WEIGHT_HASHES.get(model)
    if cached is None or cached[0] != versions or -1 in versions:
        cached = (versions, weights_fingerprint(params))
        _WEIGHT_HASHES[model] = cached
    out = {"model_config": config_hash, "weights": cached[1]}
    gates = model.eviction_gates  # the `learned` policy's scores depend on them
    if gates is not None:
        out["eviction_gates"] = gates_fingerprint(gates)
    return out


def weights_fingerprint(params: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> str:
    """sha256 of each `(name, tensor)`'s name, shape, dtype and `_parameter_digest`, in order: the `"weights"` of
    `model_fingerprint` for a model's `named_parameters()`. `dtype`: each tensor cast to it first, one at a time
    (`litkv.hf` digests a transformers model's weights as a checkpoint stores them)."""
    h = hashlib.sha256()
    digests, dtypes = [], []
    with torch.no_grad():
        for _, p in params:
            p = p if dtype is None else p.to(dtype)
            digests.append(_parameter_digest(p).cpu())
            dtypes.append(p.dtype)
    values = torch.stack(digests).tolist() if digests else []
    for (name, p), kind, digest in zip(params, dtypes, values, strict=True):
        h.update(f"{name}:{tuple(p.shape)}:{kind}:{digest};".encode())
    return h.hexdigest()


def gates_fingerprint(gates: EvictionGates) -> str:
    """sha256 of eviction gates' tensors, window, sinks, target and input: the `"eviction_gates"` of
    `model_fingerprint`."""
    h = hashlib.sha256(f"{tuple(gates.weight.shape)}:{gates.window}:{gates.sinks};".encode())
    if getattr(gates, "target", None) is not None:  # one-scale gates rank across layers by default
        h.update(f"target:{gates.target};".encode())
    if getattr(gates, "input", "key") != "key":  # what the gates read (key-input fingerprints unchanged)
        h.update(f"input:{gates.input};".encode())
    for tensor in (gates.weight, gates.bias):
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
