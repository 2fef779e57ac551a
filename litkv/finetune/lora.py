"""LoRA adapters for `litkv.GPT`: `LoRALinear`, applying, freezing, merging and saving adapters.

A `LoRALinear` replaces an `nn.Linear` in place and keeps its `weight` and `bias` under the same names,
so the base keys of the model's state dict do not change (`transformer.h.0.attn.qkv.weight` stays
`transformer.h.0.attn.qkv.weight`); the adapter adds `lora_A` `(r, in_features)` and `lora_B`
`(out_features, r)`. `merged_state_dict` folds the adapters into the base weights and returns a plain
litkv/LitGPT state dict, which is what checkpoints hold.

QLoRA: over a quantised base (`Int8Linear` / `Int4Linear`, `litkv finetune --quantize int4`) the
`LoRALinear` holds the frozen quantised layer as `base` (keys `...qkv.base.packed`, ...); its backward
keeps no float copy of the weight (`litkv.modeling.quant_weights`). `merged_state_dict` then returns float
weights: every quantised weight dequantised, the adapters folded in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from litkv.core.validation import is_number, require_int
from litkv.modeling.gated_deltanet import GatedDeltaNet
from litkv.modeling.quant_weights import Int4Linear, Int8Linear

__all__ = [
    "LORA_TARGETS",
    "LoRAArgs",
    "LoRALinear",
    "apply_lora",
    "mark_only_lora_as_trainable",
    "lora_state_dict",
    "load_lora_state_dict",
    "merged_state_dict",
    "merge_lora",
]

#: Where adapters can go: the attention's fused QKV and output projections, every linear layer of
#: the MLP, the LM head, and in a hybrid model the Mamba-2 mixers' input and output projections
#: (`mamba.in_proj`, `mamba.out_proj`; a model without Mamba-2 layers has none to match) and the Gated
#: DeltaNet mixers' (`gdn.in_proj`: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`; `gdn.out_proj`).
LORA_TARGETS = (
    "attn.qkv",
    "attn.proj",
    "mlp",
    "lm_head",
    "mamba.in_proj",
    "mamba.out_proj",
    "gdn.in_proj",
    "gdn.out_proj",
)
_ADAPTER_NAMES = ("lora_A", "lora_B")


@dataclass
class LoRAArgs:
    """LoRA hyperparameters (used with ``mode="lora"``).

    Args:
        r: Rank of the adapters.
        alpha: Scaling numerator: the adapter output is multiplied by ``alpha / r``.
        targets: Which linear layers get adapters, among ``attn.qkv``, ``attn.proj``, ``mlp`` (every
            linear layer of the MLP), ``lm_head``, the Mamba-2 mixers' ``mamba.in_proj`` and
            ``mamba.out_proj``, the Gated DeltaNet mixers' ``gdn.in_proj`` (its four input projections) and
            ``gdn.out_proj`` (hybrid models: the attention targets cover only their attention layers).
    """

    r: int = 8
    alpha: float = 16.0
    targets: list[str] = field(default_factory=lambda: ["attn.qkv", "attn.proj"])

    def __post_init__(self) -> None:
        require_int("lora r", self.r, 1)
        if not is_number(self.alpha) or self.alpha <= 0:
            raise ValueError(f"lora alpha must be a number > 0, got {self.alpha!r}")
        if isinstance(self.targets, str) or not isinstance(self.targets, (list, tuple)) or not self.targets:
            raise TypeError(
                f"lora targets must be a non-empty list of names from {list(LORA_TARGETS)}, got {self.targets!r}"
            )
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"unknown lora targets {unknown}; expected names from {list(LORA_TARGETS)}")


class LoRALinear(nn.Module):
    """`y = x W^T + b + (alpha / r) x A^T B^T` with `W`, `b` frozen in LoRA training.

    There is no adapter dropout: the gradient engine recomputes every chunk, and a recomputation
    would draw a different dropout mask than the forward it replays, making the gradient inexact.

    Shapes: `weight` `(out_features, in_features)`, `bias` `(out_features,)` or `None`, `lora_A`
    `(r, in_features)`, `lora_B` `(out_features, r)`. `lora_B` starts at zero, so a fresh adapter does
    not change the output.
    """

    def __init__(self, base: nn.Linear | Int8Linear | Int4Linear, r: int, alpha: float) -> None:
        super().__init__()
        if not isinstance(base, (nn.Linear, Int8Linear, Int4Linear)):
            raise TypeError(f"LoRALinear wraps an nn.Linear, Int8Linear or Int4Linear, got {type(base).__name__}")
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.base = None if isinstance(base, nn.Linear) else base  # quantised: frozen, called as it is
        if self.base is None:
            self.weight = base.weight
            self.bias = base.bias
        else:  # the model's dtype and device, as the quantised layers keep them (no float weight)
            self.register_buffer("weight", base.weight, persistent=False)
            self.bias = None
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, **factory))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.r = r
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(..., in_features)` -> `(..., out_features)`."""
        out = F.linear(x, self.weight, self.bias) if self.base is None else self.base(x)
        update = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return out + update * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """`W + (alpha / r) B A` `(out_features, in_features)`, computed in float32 (float64 for a float64
        model), in the model's dtype; `W` dequantised for a quantised base."""
        compute = torch.promote_types(self.weight.dtype, torch.float32)
        base = self.weight.to(compute) if self.base is None else self.base.dequantized(compute)
        delta = (self.lora_B.to(compute) @ self.lora_A.to(compute)) * self.scaling
        return (base + delta).to(self.weight.dtype).detach()

    def to_linear(self) -> nn.Linear:
        """A plain `nn.Linear` with the adapter folded into its weight."""
        w = self.weight
        bias = self.bias if self.base is None else self.base.bias
        linear = nn.Linear(self.in_features, self.out_features, bias=bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.merged_weight())
            if bias is not None:
                linear.bias.copy_(bias)
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, scaling={self.scaling}"


def _is_target(name: str, module: nn.Module, targets: list[str], in_gdn: bool) -> bool:
    """`in_gdn`: the layer belongs to a Gated DeltaNet mixer (its `out_proj` is not a Mamba-2 one)."""
    if not isinstance(module, (nn.Linear, Int8Linear, Int4Linear)) or name.endswith(".base"):
        return False  # `.base`: the quantised layer inside a `LoRALinear`
    full, child = "." + name, name.rpartition(".")[2]
    if in_gdn:
        return ("gdn.in_proj" in targets and child.startswith("in_proj_")) or (
            "gdn.out_proj" in targets and child == "out_proj"
        )
    return (
        ("attn.qkv" in targets and full.endswith(".attn.qkv"))
        or ("attn.proj" in targets and full.endswith(".attn.proj"))
        or ("mlp" in targets and ".mlp." in full)
        or ("lm_head" in targets and name == "lm_head")
        or ("mamba.in_proj" in targets and full.endswith(".attn.in_proj"))  # a Mamba-2 mixer sits at `attn`
        or ("mamba.out_proj" in targets and full.endswith(".attn.out_proj"))
    )


def apply_lora(model: nn.Module, args: LoRAArgs) -> list[str]:
    """Replace the targeted `nn.Linear` layers of `model` by `LoRALinear` (in place).

    Returns:
        The names of the replaced modules.

    Raises:
        ValueError: if no module matches the targets.
    """
    if not isinstance(args, LoRAArgs):
        raise TypeError(f"args must be LoRAArgs, got {type(args).__name__}")
    gdn = {n for n, m in model.named_modules() if isinstance(m, GatedDeltaNet)}
    targets = list(args.targets)
    names = [n for n, m in model.named_modules() if _is_target(n, m, targets, n.rpartition(".")[0] in gdn)]
    if not names:
        raise ValueError(f"no linear layer of the model matches lora targets {list(args.targets)}")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), args.r, args.alpha))
    return names


def _lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def mark_only_lora_as_trainable(model: nn.Module) -> None:
    """Freeze every parameter except the adapters' `lora_A` and `lora_B`."""
    if not _lora_modules(model):
        raise ValueError("the model has no LoRA adapters: call apply_lora() first")
    for name, param in model.named_parameters():
        param.requires_grad_(name.rpartition(".")[2] in _ADAPTER_NAMES)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only (`...lora_A`, `...lora_B`), detached."""
    return {k: v.detach() for k, v in model.state_dict().items() if k.rpartition(".")[2] in _ADAPTER_NAMES}


def load_lora_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy adapter tensors into `model`; the keys must be exactly the model's adapter keys."""
    expected = set(lora_state_dict(model))
    got = set(state_dict)
    if expected != got:
        missing, unexpected = sorted(expected - got), sorted(got - expected)
        raise ValueError(
            f"LoRA weights do not match the model's adapters (check lora.r and lora.targets): "
            f"missing {len(missing)} keys {missing[:3]}, unexpected {len(unexpected)} keys {unexpected[:3]}"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in state_dict.items():
            if params[key].shape != value.shape:
                raise ValueError(
                    f"LoRA weight {key} has shape {tuple(value.shape)}, expected {tuple(params[key].shape)}"
                )
            params[key].copy_(value)


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain state dict of `model` with adapters folded in (the model is not changed).

    Keys are those of the model without adapters (identical to `litgpt.GPT`'s for a `litkv.GPT`); a
    quantised layer's codes and scales become its dequantised float `weight` (QLoRA: a float checkpoint).
    """
    merged = {_weight_key(name): m.merged_weight() for name, m in _lora_modules(model)}
    quantised = {n: m for n, m in model.named_modules() if isinstance(m, (Int8Linear, Int4Linear))}
    for name, m in quantised.items():
        if not name.endswith(".base"):
            merged[_weight_key(name)] = m.dequantized(m.weight.dtype)
    out = {}
    for key, value in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if leaf in _ADAPTER_NAMES or (owner in quantised and leaf != "bias"):
            continue
        out[key.replace(".base.bias", ".bias") if owner in quantised else key] = value.detach()
    out.update(merged)
    return out


def _weight_key(module_name: str) -> str:
    return f"{module_name}.weight" if module_name else "weight"


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, replacing each `LoRALinear` by an `nn.Linear` (in place).

    Returns:
        `model`, whose state dict now has the plain keys.
    """
    for name, module in _lora_modules(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, module.to_linear())
    return model
