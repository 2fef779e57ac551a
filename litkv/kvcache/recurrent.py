"""`RecurrentCache`: the state of one recurrent (Mamba-2 or Gated DeltaNet) layer, a layer cache of `KVCaches`
beside the attention caches.

An attention layer's cache grows with the tokens it keeps; a recurrent layer's state does not: per row,
the last `d_conv - 1` inputs of the depthwise convolution (`conv`, `(B, conv_dim, d_conv - 1)`) and the
SSM state (`ssm`, `(B, n_heads, head_dim, d_state)`; a Gated DeltaNet layer's delta-rule state is
`(B, value heads, key head width, value head width)` under the same names). The mixer
(`litkv.modeling.mamba2.Mamba2Mixer`, `litkv.modeling.gated_deltanet.GatedDeltaNet`) reads both
and hands back their values after the call (`update`), which rebinds them (so autograd sees the chain of
states through the chunks of the gradient engine); a row's state is touched only by its real tokens.

What every layer cache of `KVCaches` offers (`LayerStateCache`): its `kind`, its rows, its bytes, and its
state as named tensors (`state_tensors` / `load_state_tensors`), the one way snapshots, state files and the
undo log see it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["RECURRENT_STATE_KINDS", "LayerStateCache", "RecurrentCache", "RecurrentShape", "check_recurrent_entries"]

#: the kinds of recurrent layer whose state a `RecurrentCache` holds
RECURRENT_STATE_KINDS = ("mamba2", "gated_deltanet")


@runtime_checkable
class LayerStateCache(Protocol):
    """What `KVCaches` and the state code need of a layer cache of any kind."""

    kind: str

    def nbytes(self) -> int: ...

    def state_tensors(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class RecurrentShape:
    """Sizes of a recurrent layer's state: `conv` `(batch_size, conv_dim, conv_width)` and `ssm`
    `(batch_size, n_heads, head_dim, d_state)` (`conv_width` is `d_conv - 1`)."""

    batch_size: int
    conv_dim: int
    conv_width: int
    n_heads: int
    head_dim: int
    d_state: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "conv_width" else 1):
                raise ValueError(f"RecurrentShape.{name} must be a positive int, got {value!r}")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the state tensors."""
        b = self.batch_size
        return {"conv": (b, self.conv_dim, self.conv_width), "ssm": (b, self.n_heads, self.head_dim, self.d_state)}


class RecurrentCache:
    """The convolution window and SSM state of one recurrent layer, per row (zeros: nothing seen).

    Attributes:
        kind: the layer's kind, one of `RECURRENT_STATE_KINDS` (`"mamba2"` unless given).
        shape: the `RecurrentShape`.
        dtype: the state's float dtype.
        conv: `(B, conv_dim, d_conv - 1)` the last inputs of the convolution, oldest first.
        ssm: `(B, n_heads, head_dim, d_state)` the SSM state.
    """

    kind = "mamba2"  # the default; an instance's own `kind` when given
    config = None  # no policy: the state keeps everything it needs, whatever the length

    def __init__(
        self, shape: RecurrentShape, device: torch.device | str | None, dtype: torch.dtype, kind: str = "mamba2"
    ) -> None:
        if kind not in RECURRENT_STATE_KINDS:
            raise ValueError(
                f"recurrent layer kind {kind!r} is not one litkv implements; expected {RECURRENT_STATE_KINDS}"
            )
        self.kind = kind
        if not isinstance(shape, RecurrentShape):
            raise TypeError(f"shape must be a RecurrentShape, got {type(shape).__name__}")
        if not dtype.is_floating_point:
            raise ValueError(f"a recurrent state needs a float dtype, got {dtype}")
        self.shape = shape
        self.dtype = dtype
        sizes = shape.tensor_shapes()
        self.conv = torch.zeros(sizes["conv"], device=device, dtype=dtype)
        self.ssm = torch.zeros(sizes["ssm"], device=device, dtype=dtype)
        # compiled decode steps (`KVCaches.static_shapes`): `update` writes in place, the addresses stay fixed
        self.in_place = False

    @property
    def batch_size(self) -> int:
        return self.shape.batch_size

    @staticmethod
    def max_tokens(config: object) -> int | None:
        """Tokens the layer can take: no limit (`None`), as `KVCache.max_tokens` says of a policy."""
        return None

    @property
    def device(self) -> torch.device:
        return self.ssm.device

    def update(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Take the state after a call (the mixer computed it; rows without a real token kept theirs)."""
        if conv.shape != self.conv.shape or ssm.shape != self.ssm.shape:
            raise ValueError(
                f"recurrent state shapes {tuple(self.conv.shape)}, {tuple(self.ssm.shape)} expected, "
                f"got {tuple(conv.shape)}, {tuple(ssm.shape)}"
            )
        if self.in_place and conv.dtype == self.conv.dtype and ssm.dtype == self.ssm.dtype:
            self.conv.copy_(conv)
            self.ssm.copy_(ssm)
        else:
            self.conv, self.ssm = conv, ssm

    def nbytes(self) -> int:
        """Bytes of the state (constant in the sequence length)."""
        return self.conv.nbytes + self.ssm.nbytes

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The state by name (the live tensors, not copies)."""
        return {"conv": self.conv, "ssm": self.ssm}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the state to copies of `tensors` (the names and shapes of `state_tensors`), bitwise."""
        expected = self.shape.tensor_shapes()
        if set(tensors) != set(expected):
            raise ValueError(f"a recurrent state holds {sorted(expected)}, got {sorted(tensors)}")
        for name, shape in expected.items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != self.dtype:
                raise ValueError(
                    f"recurrent state {name!r} must be {shape} {self.dtype}, got {tuple(t.shape)} {t.dtype}"
                )
        self.conv = tensors["conv"].to(self.device, copy=True)
        self.ssm = tensors["ssm"].to(self.device, copy=True)

    def reset(self) -> None:
        """Forget everything (zeros)."""
        self.conv = torch.zeros_like(self.conv)
        self.ssm = torch.zeros_like(self.ssm)


def check_recurrent_entries(configs: Sequence[object], recurrent: Sequence[bool]) -> None:
    """Refuse a per-layer cache config list that sets a policy for a recurrent layer (one line).

    A recurrent layer takes no policy: its entry in a per-layer list is a placeholder and must be a config
    that some attention layer also uses (as in a list made by repeating one config); an entry found only
    at recurrent layers names one of them and is a ValueError naming the layer and the attention layers.

    Args:
        configs: one cache config per layer (`KVCacheConfig`, compared with `==`).
        recurrent: per layer, whether it is a recurrent (Mamba-2, Gated DeltaNet) layer.
    """
    attention = [i for i, rec in enumerate(recurrent) if not rec]
    used = [configs[i] for i in attention]
    for i, (cfg, rec) in enumerate(zip(configs, recurrent, strict=True)):
        if rec and cfg not in used:
            policy = getattr(cfg, "policy", cfg)
            raise ValueError(
                f"kv_cache[{i}] sets policy {policy!r} for layer {i}, a recurrent (Mamba-2 / Gated DeltaNet) layer "
                f"that keeps a constant-size state and takes no policy; policies cover the attention layers "
                f"{attention} only (give layer {i} the config of an attention layer)"
            )
