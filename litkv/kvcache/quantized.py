"""Quantised slot storage: int8 or int4 codes with a 16-bit scale and offset per group.

Each key (and value) vector of `head_size` numbers is cut into groups of `group_size` consecutive
numbers along the head dimension (`group_size` larger than the head size means one group per vector).
A group is quantised asymmetrically: `x ~ offset + scale * q` with `q` in `[0, 2^bits - 1]`,
`offset` the group minimum rounded down and `scale` the range over `2^bits - 1` rounded up to 16
bits, so the round-trip error of every number is at most `scale / 2` (up to float32 rounding).
int4 codes are packed two per byte (element `2i` in the low nibble, `2i + 1` in the high nibble).
Scales and offsets are bfloat16 for bfloat16 models, float16 otherwise (values beyond float16's
range, about 65,504, need a bfloat16 model).

Slots are dequantised to the model dtype when read. Quantisation is not differentiable: gradients do
not flow into tokens once they are stored (they do through the new tokens of a call, which attend in
full precision).
"""

from __future__ import annotations

import torch

from litkv.kvcache.storage import CacheShape, KVStorage, scatter_slots

__all__ = ["QuantizedStorage", "QuantizedTensor", "quantize", "dequantize"]

QuantizedTensor = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scales, offsets


def _round_toward(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """`x` (float32) cast to the 16-bit `dtype`, rounded up or down instead of to nearest."""
    rounded = x.to(dtype)
    wrong = rounded.float() < x if up else rounded.float() > x
    target = torch.full_like(rounded, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(rounded, target), rounded)


def quantize(x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype) -> QuantizedTensor:
    """Asymmetric per-group quantisation along the last dimension.

    Args:
        x: `(..., D)` with `D` a multiple of `group_size` (and even for 4 bits).
        bits: 8 or 4.
        group_size: numbers per group.
        scale_dtype: float16 or bfloat16.

    Returns:
        codes `(..., D)` uint8 for 8 bits or `(..., D // 2)` uint8 for 4 bits (two per byte), scales
        and offsets `(..., D // group_size)` in `scale_dtype`.
    """
    levels = (1 << bits) - 1
    groups = x.detach().float().unflatten(-1, (-1, group_size))
    offset = _round_toward(groups.amin(dim=-1), scale_dtype, up=False)
    low = offset.float()
    scale = _round_toward((groups.amax(dim=-1) - low) / levels, scale_dtype, up=True)
    high = scale.float()
    inverse = torch.where(high > 0, 1.0 / high, torch.zeros_like(high))
    codes = torch.round((groups - low[..., None]) * inverse[..., None]).clamp_(0, levels)
    codes = codes.flatten(-2).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scale, offset


def dequantize(q: QuantizedTensor, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize`: `(..., D)` in `dtype`."""
    codes, scale, offset = q
    if bits == 4:
        codes = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)
    groups = codes.float().unflatten(-1, (-1, group_size))
    x = groups * scale.float()[..., None] + offset.float()[..., None]
    return x.flatten(-2).to(dtype)


class QuantizedStorage(KVStorage):
    """Keys and values as int8 or int4 codes plus 16-bit per-group scales and offsets (lossy)."""

    lossless = False

    def __init__(
        self, shape: CacheShape, device: torch.device | None, dtype: torch.dtype, bits: int, group_size: int
    ) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        self.bits = bits
        self.dtype = dtype
        self.scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
        self.key_group = self._group_for(shape.key_size, group_size, "key_size")
        self.value_group = self._group_for(shape.value_size, group_size, "value_size")
        self.keys = self._empty(shape, shape.key_size, self.key_group, device)
        self.values = self._empty(shape, shape.value_size, self.value_group, device)

    def _group_for(self, size: int, group_size: int, name: str) -> int:
        group = min(group_size, size)
        if size % group != 0:
            raise ValueError(
                f"quant_group_size must divide the head size: {name}={size} is not a multiple of {group_size}"
            )
        if self.bits == 4 and size % 2 != 0:
            raise ValueError(f"int4 storage packs two numbers per byte and needs an even {name}, got {size}")
        return group

    def _empty(self, shape: CacheShape, size: int, group: int, device: torch.device | None) -> QuantizedTensor:
        lead = (shape.batch_size, shape.n_query_groups, shape.cache_length)
        codes = torch.zeros(*lead, size * self.bits // 8, dtype=torch.uint8, device=device)
        scale = torch.zeros(*lead, size // group, dtype=self.scale_dtype, device=device)
        return codes, scale, torch.zeros_like(scale)

    # -- KVStorage ------------------------------------------------------------------------------

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dequantize(self.keys, self.key_group), self._dequantize(self.values, self.value_group)

    def read_prefix(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = tuple(t[:, :, :end] for t in self.keys)
        values = tuple(t[:, :, :end] for t in self.values)
        return self._dequantize(keys, self.key_group), self._dequantize(values, self.value_group)

    def write_range(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        end = start + keys.shape[2]
        pairs = ((self.keys, keys, self.key_group), (self.values, values, self.value_group))
        for buffers, x, group in pairs:
            for buffer, part in zip(buffers, self._quantize(x, group), strict=True):
                buffer[:, :, start:end] = part

    def write(self, dest: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        self.keys = self._scatter(self.keys, dest, self._quantize(keys, self.key_group), valid)
        self.values = self._scatter(self.values, dest, self._quantize(values, self.value_group), valid)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.keys, *self.values))

    # -- quantisation error ---------------------------------------------------------------------

    def token_errors(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Round-trip error of tokens before they are stored.

        Args:
            keys: `(B, G, T, key_size)`; values: `(B, G, T, value_size)`.

        Returns:
            `(B, G, T)` float32: mean squared round-trip error of the key plus that of the value.
        """
        errors = []
        for x, group in ((keys, self.key_group), (values, self.value_group)):
            x = x.detach()
            restored = dequantize(self._quantize(x, group), self.bits, group, torch.float32)
            errors.append((restored - x.float()).square().mean(dim=-1))
        return errors[0] + errors[1]

    # -- internals ------------------------------------------------------------------------------

    def _quantize(self, x: torch.Tensor, group: int) -> QuantizedTensor:
        return quantize(x, self.bits, group, self.scale_dtype)

    def _dequantize(self, q: QuantizedTensor, group: int) -> torch.Tensor:
        return dequantize(q, self.bits, group, self.dtype)

    @staticmethod
    def _scatter(
        buffers: QuantizedTensor, dest: torch.Tensor, new: QuantizedTensor, valid: torch.Tensor
    ) -> QuantizedTensor:
        codes, scale, offset = (scatter_slots(b, dest, n, valid) for b, n in zip(buffers, new, strict=True))
        return codes, scale, offset
