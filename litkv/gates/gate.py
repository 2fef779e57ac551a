"""Trainable eviction gates: one retention logit per token, layer and KV head.

The gate of layer `l` and KV head `g` is linear in its input `x`: `logit = (x . w[l, g]) / sqrt(len(x)) +
b[l, g]`, where the input (`EvictionGates.input`) is either the token's key *before RoPE* (`"key"`, `D`
wide: what training through the cache fits; the key is rotated back to position 0, `unrotate_keys`, so
that the same content gives the same logit at every position) or the layer's attention input, the normed
hidden state the keys are made from (`"hidden"`, `n_embd` wide: KVzap's input, fitted in closed form by
`litkv.finetune.kvzap_fit`). A key is a linear map of that hidden state, so the key gate is DMS's
"RMSNorm + Linear(hidden -> n_kv_heads)" restricted to the key's subspace.

Gates are plain tensors, not modules of the model: the model's own weights and files stay as they
are, and the gates are saved in their own safetensors file next to them (`GATES_FILE`).

**A gates file proves its tensors.** Its metadata records `sha256`, the digest of its tensors and
metadata (`gates_digest`), and `mac`, an HMAC-SHA256 of that digest under the user's secret
(`litkv.core.secret`). `EvictionGates.load` refuses a file whose tensors or metadata do not give its
recorded digest, and one that is neither shipped with litkv (its digest listed in
`litkv/assets/gates/manifest.json`) nor signed by this user's litkv: an edited tensor, a relabelled
fingerprint or a file written by someone else, whatever digest they record (docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from litkv.core.rope import apply_rope
from litkv.core.secret import mac, macs_equal, user_secret

__all__ = [
    "GATES_FILE", "GATE_INPUTS", "ONE_SCALE_TARGETS", "EvictionGates", "gates_digest", "shipped_digests",
    "unrotate_keys",
]  # fmt: skip

#: The gates' file in a checkpoint directory, next to `model.safetensors`.
GATES_FILE = "eviction_gates.safetensors"

_FORMAT = "litkv-eviction-gates"
#: The manifest of the gates files shipped in the package: their `gates_digest`s.
MANIFEST = Path(__file__).resolve().parents[1] / "assets" / "gates" / "manifest.json"
_MAC_PURPOSE = "eviction-gates"
_UNSIGNED = ("sha256", "mac")  # metadata keys the digest does not cover


def gates_digest(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """sha256 of a gates file's metadata (but `sha256` and `mac`) and tensors (as float32, little-endian)."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k not in _UNSIGNED}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shipped_digests() -> set[str]:
    """The digests of the gates files litkv ships (`MANIFEST`), and of those it shipped before (`superseded`:
    still trusted; `litkv.checkpoints.known.add_shipped_gates` replaces them in a known model's directory)."""
    try:
        data = json.loads(MANIFEST.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    if not isinstance(data, dict):
        return set()
    old = [entry["gates_digest"] for entries in data.get("superseded", {}).values() for entry in entries]
    return set(data.get("digests", {}).values()) | set(old)


def _authenticity_problem(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str | None:
    """Why a gates file cannot be trusted (one phrase), or `None` (shipped, or signed by this user)."""
    digest = gates_digest(tensors, meta)
    if "sha256" in meta and meta["sha256"] != digest:
        return "its tensors or metadata do not give its recorded sha256 (edited)"
    if digest in shipped_digests():
        return None
    if "mac" not in meta:
        return "it is neither shipped with litkv nor signed by your litkv (no 'mac')"
    if not macs_equal(meta["mac"], mac(user_secret(), _MAC_PURPOSE, digest)):
        return "its 'mac' was not made by your litkv (edited, or another user's file)"
    return None


#: Regression targets whose logits mean the same in every layer and KV head (`EvictionGates.one_scale`):
#: `"kvzip"`, the log KVzip+ score (KVzap's target, `litkv.finetune.kvzip_target`).
ONE_SCALE_TARGETS = ("kvzip",)

#: What a gate reads (`EvictionGates.input`): the pre-RoPE key, or the layer's attention input (hidden state).
GATE_INPUTS = ("key", "hidden")


def unrotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_elem: int) -> torch.Tensor:
    """Keys rotated back to position 0.

    Args:
        keys: `(B, G, T, D)` keys as the attention computed them (RoPE applied to the first `n_elem`
            dims, half-split layout).
        cos: `(B or 1, T, n_elem)` cosines of the keys' positions; `sin` likewise.
        n_elem: how many leading dims RoPE rotates.

    Returns:
        `(B, G, T, D)` in the dtype of `keys` (the rotation by minus the angle).
    """
    rotated = apply_rope(keys[..., :n_elem], cos, -sin)
    return torch.cat((rotated, keys[..., n_elem:]), dim=-1)


@dataclass
class EvictionGates:
    """The gates of every layer.

    Attributes:
        weight: `(n_layer, G, D)` float32 (`(n_layer, G, n_embd)` for `input="hidden"`).
        bias: `(n_layer, G)` float32.
        window: the recent window the gates were trained with (tokens younger than this are never
            evicted in training; the `learned` policy's default `recent`).
        sinks: the first positions that were never evicted in training (the policy's default `sinks`).
        weights: the fingerprint of the model weights the gates were trained for
            (`litkv.modeling.fingerprint.model_fingerprint(model)["weights"]` as the checkpoint stores them), or
            `None` (unknown). `load_model` refuses gates whose fingerprint differs or is `None`.
        target: what the logits were fitted to (`"kvzip"`: log KVzip+, one scale across layers), or `None`
            (trained per head: no common scale). Written to the file's metadata.
        input: what the gates read (`GATE_INPUTS`): `"key"`, the pre-RoPE key, or `"hidden"`, the layer's
            attention input `(B, T, n_embd)`. Written to the file's metadata when `"hidden"`.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    window: int
    sinks: int
    weights: str | None = None
    target: str | None = None
    input: str = "key"

    def __post_init__(self) -> None:
        if self.weight.dim() != 3 or self.bias.shape != self.weight.shape[:2]:
            raise ValueError(
                f"gate weight must be (n_layer, G, D) and bias (n_layer, G), "
                f"got {tuple(self.weight.shape)} and {tuple(self.bias.shape)}"
            )
        for name in ("window", "sinks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"gate {name} must be an int >= 0, got {value!r}")
        if self.weights is not None and not isinstance(self.weights, str):
            raise ValueError(f"gate weights fingerprint must be a str or None, got {self.weights!r}")
        if self.target is not None and not isinstance(self.target, str):
            raise ValueError(f"gate target must be a str or None, got {self.target!r}")
        if self.input not in GATE_INPUTS:
            raise ValueError(f"gate input must be one of {list(GATE_INPUTS)}, got {self.input!r}")

    @property
    def one_scale(self) -> bool:
        """Whether the logits mean the same in every layer and KV head (`ONE_SCALE_TARGETS`): a top-k over
        all layers at once is meaningful (`learned` ranks across layers by default with such gates)."""
        return self.target in ONE_SCALE_TARGETS

    @classmethod
    def create(
        cls, n_layer: int, n_kv_heads: int, head_size: int, window: int, sinks: int, bias: float = 3.0
    ) -> EvictionGates:
        """Fresh gates: zero weights and a bias of `bias` (every token kept with probability sigmoid(bias))."""
        weight = torch.zeros(n_layer, n_kv_heads, head_size)
        return cls(weight, torch.full((n_layer, n_kv_heads), float(bias)), window, sinks)

    @property
    def n_layer(self) -> int:
        return self.weight.shape[0]

    def parameters(self) -> list[torch.Tensor]:
        """The trainable tensors (`weight`, `bias`)."""
        return [self.weight, self.bias]

    def to(self, device: torch.device | str) -> EvictionGates:
        """These gates on `device` (float32 always: logits are compared, not multiplied into activations)."""
        return EvictionGates(
            self.weight.to(device, torch.float32),
            self.bias.to(device, torch.float32),
            self.window,
            self.sinks,
            self.weights,
            self.target,
            self.input,
        )

    def logits(self, layer: int, keys_pre: torch.Tensor) -> torch.Tensor:
        """`(B, G, T)` retention logits (higher: keep) of pre-RoPE keys `(B, G, T, D)`, float32 (float64 for
        float64 keys). Key-input gates only (what training through the cache fits): ValueError for
        `input="hidden"`."""
        if self.input != "key":
            raise ValueError(
                f"these eviction gates read the layer's hidden state (input={self.input!r}, a KVzap fit), not the "
                "key: they are fitted in closed form (scripts/fit_kvzap.py), not trained through the cache"
            )
        dtype = torch.promote_types(keys_pre.dtype, torch.float32)
        weight = self.weight[layer].to(keys_pre.device, dtype)
        if keys_pre.shape[1] != weight.shape[0] or keys_pre.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"layer {layer} gates expect keys (B, {weight.shape[0]}, T, {weight.shape[1]}), "
                f"got {tuple(keys_pre.shape)}"
            )
        dots = torch.einsum("bgtd,gd->bgt", keys_pre.to(dtype), weight)
        return dots / math.sqrt(weight.shape[1]) + self.bias[layer].to(keys_pre.device, dtype)[None, :, None]

    def check_model(self, n_layer: int, n_kv_heads: int, head_size: int, n_embd: int | None, source: str) -> None:
        """ValueError naming both shapes unless these gates fit a model of this shape (`n_embd`: the width of
        hidden-input gates; `None`: not checked here)."""
        width = head_size if self.input == "key" else n_embd
        what = "head_size" if self.input == "key" else "n_embd"
        shape = tuple(self.weight.shape)
        if shape[:2] != (n_layer, n_kv_heads) or (width is not None and shape[2] != width):
            raise ValueError(
                f"{source}: the gates are for (n_layer, n_query_groups, {what}) = {shape}, the model has "
                f"{(n_layer, n_kv_heads, width)}"
            )

    def file_contents(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The tensors and the metadata of the gates' safetensors file (what `load` reads back; written by
        `litkv.checkpoints.checkpoint.save_gates`)."""
        tensors = {"weight": self.weight.detach().float().cpu().contiguous(), "bias": self.bias.detach().float().cpu()}
        meta = {"format": _FORMAT, "window": str(self.window), "sinks": str(self.sinks)}
        if self.weights is not None:
            meta["weights"] = self.weights
        if self.target is not None:
            meta["target"] = self.target
        if self.input != "key":  # key-input files (every file written before hidden inputs) keep their digest
            meta["input"] = self.input
        meta["sha256"] = gates_digest(tensors, meta)
        meta["mac"] = mac(user_secret(), _MAC_PURPOSE, meta["sha256"])
        return tensors, meta

    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> EvictionGates:
        """Read gates written by `litkv.checkpoints.checkpoint.save_gates` (safetensors only; ValueError naming the file
        on anything else). `verify`: refuse a file that does not prove its tensors (module docstring); only
        for a file the caller vouches for (a test's crafted file) is it `False`."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                keys = set(f.keys())
                if meta.get("format") != _FORMAT or keys != {"weight", "bias"}:
                    raise ValueError(
                        f"{str(path)!r} is not an eviction-gates file: expected format {_FORMAT!r} with tensors "
                        f"['bias', 'weight'], got format {meta.get('format')!r} with {sorted(keys)}"
                    )
                weight, bias = f.get_tensor("weight"), f.get_tensor("bias")
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{str(path)!r} is not a readable safetensors file: {err}") from err
        try:
            window, sinks = int(meta["window"]), int(meta["sinks"])
        except (KeyError, ValueError) as err:
            raise ValueError(
                f"{str(path)!r}: metadata needs integer 'window' and 'sinks', got {json.dumps(meta)}"
            ) from err
        if not (weight.is_floating_point() and bias.is_floating_point()):
            raise ValueError(
                f"{str(path)!r}: the gates must be floating-point tensors, got weight {weight.dtype} "
                f"and bias {bias.dtype}"
            )
        weight, bias = weight.float(), bias.float()
        if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):
            raise ValueError(f"{str(path)!r}: the gates hold NaN or inf")
        problem = _authenticity_problem({"weight": weight, "bias": bias}, meta) if verify else None
        if problem:
            raise ValueError(
                f"{str(path)!r}: these eviction gates are refused: {problem}; train them again "
                "(litkv finetune --learn_eviction true) or use the gates litkv ships"
            )
        gate_input = meta.get("input", "key")
        if gate_input not in GATE_INPUTS:
            raise ValueError(f"{str(path)!r}: metadata 'input' must be one of {list(GATE_INPUTS)}, got {gate_input!r}")
        return cls(weight, bias, window, sinks, meta.get("weights"), meta.get("target"), gate_input)
