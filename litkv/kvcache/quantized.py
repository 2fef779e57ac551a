"""Quantised slot storage: int8 or int4 codes with a 16-bit scale and offset per group.

Each key (and value) vector of `head_size` numbers is cut into groups of `group_size` consecutive
numbers along the head dimension (`group_size` larger than the head size means one group per vector).
A group is quantised asymmetrically: `x ~ offset + scale * q` with `q` in `[0, 2^bits - 1]`,
`offset` the group minimum rounded down and `scale` the range over `2^bits - 1` rounded up to 16
bits, so the round-trip error of every number is at most `scale / 2` (up to float32 rounding).
int8 codes are stored biased (the byte, viewed as int8, is `q - 128`: what integer matrix products take);
int4 codes are packed two per byte: element `i` in the low nibble, element `i + head_size / 2` in the
high nibble (so that unpacking is two contiguous halves, not an interleave).
Scales and offsets are bfloat16 for bfloat16 models, float16 otherwise (values beyond float16's
range, about 65,504, need a bfloat16 model).

Reads (`read_prefix`, `read_staged`) dequantise to the model dtype (computed in float32, float64 for
float64 models). A decode step does not: `read_packed` hands attention the codes, scales and
offsets as stored (`QuantizedSlots`, views of the buffers), and `litkv.kvcache.quant_attention` attends them
directly (the scales and offsets are applied to the products per group, never to every slot);
`Candidates.keys`/`values` are dequantised from them only when a policy reads them. The new tokens of
a call are attended exactly as they will be read back (`as_stored`, or staged and read from the
codes), so results do not depend on chunk boundaries or padding.
Quantisation is not differentiable: gradients do not flow into tokens once they are stored; through
the new tokens of a call they pass straight through the rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from litkv.core.validation import require_int
from litkv.kvcache.kernels import cpu_decode
from litkv.kvcache.quant_attention import quant_attend
from litkv.kvcache.storage import ROOM, CacheShape, KVStorage, PackedSlots, copy_ranges, scatter_slots
from litkv.kvcache.storage_kinds import register_storage

__all__ = [
    "QuantizedSlots",
    "QuantizedStorage",
    "QuantizedTensor",
    "dequantize",
    "quantize",
    "round_trip_error",
    "unpack_codes",
]

QuantizedTensor = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scales, offsets


def _round_toward(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """`x` (float32) cast to the 16-bit `dtype`, rounded up or down instead of to nearest."""
    rounded = x.to(dtype)
    wrong = rounded.float() < x if up else rounded.float() > x
    target = torch.tensor(float("inf") if up else float("-inf"), dtype=dtype, device=x.device)  # broadcast
    return torch.where(wrong, torch.nextafter(rounded, target), rounded)


def _codes(groups: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> QuantizedTensor:
    """`(..., n, group)` float32 -> codes `(..., n, group)` (float32, integral), scales, offsets `(..., n)`."""
    levels = (1 << bits) - 1
    low, high = torch.aminmax(groups, dim=-1)
    offset = _round_toward(low, scale_dtype, up=False)
    low = offset.float()
    scale = _round_toward((high - low) / levels, scale_dtype, up=True)
    inverse = scale.float().clamp(min=1e-30).reciprocal()  # constant groups: scale 0, any code decodes exactly
    codes = ((groups - low[..., None]) * inverse[..., None]).round_().clamp_(0, levels)
    return codes, scale, offset


def quantize(x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype) -> QuantizedTensor:
    """Asymmetric per-group quantisation along the last dimension.

    One opaque op under `torch.compile` (`litkv::quantize`): compiled code calls this eager kernel, so
    codes are bitwise those of eager mode (a fused kernel may round a product differently and flip a
    code at a rounding boundary, which changes what attention sees by a whole quantum).

    Args:
        x: `(..., D)` with `D` a multiple of `group_size` (and even for 4 bits).
        bits: 8 or 4.
        group_size: numbers per group.
        scale_dtype: float16 or bfloat16.

    Returns:
        codes `(..., D)` uint8 for 8 bits or `(..., D // 2)` uint8 for 4 bits (two per byte), scales
        and offsets `(..., D // group_size)` in `scale_dtype`.
    """
    op = _quantize_op if torch.compiler.is_compiling() else _quantize_eager  # eager: no custom-op dispatch cost
    return op(x.detach(), bits, group_size, scale_dtype)


def _quantize_eager(
    x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if scale_dtype == torch.float16:  # on the CPU, one C call gives the same bits (`cpu_decode.quantize`)
        done = cpu_decode.quantize(x, bits, group_size)
        if done is not None:
            return done
    codes, scale, offset = _codes(x.float().unflatten(-1, (-1, group_size)), bits, scale_dtype)
    if bits == 8:  # stored biased: the byte viewed as int8 is `code - 128` (integer products take int8)
        return codes.flatten(-2).sub_(128).to(torch.int8).view(torch.uint8), scale, offset
    codes = codes.flatten(-2).to(torch.uint8)
    if bits == 4:
        half = codes.shape[-1] // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    return codes, scale, offset


_quantize_op = torch.library.custom_op("litkv::quantize", _quantize_eager, mutates_args=())


@_quantize_op.register_fake
def _quantize_shape(
    x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    codes = x.new_empty(*x.shape[:-1], d * bits // 8, dtype=torch.uint8)
    groups = x.new_empty(*x.shape[:-1], d // group_size, dtype=scale_dtype)
    return codes, groups, torch.empty_like(groups)


def dequantize(q: QuantizedTensor, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize`: `(..., D)` in `dtype` (one opaque op under `torch.compile`, like `quantize`)."""
    codes, scale, offset = q
    op = _dequantize_op if torch.compiler.is_compiling() else _dequantize_eager
    return op(codes, scale, offset, bits, group_size, dtype)


def unpack_codes(codes: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Codes `(..., D * bits / 8)` uint8 as numbers `(..., D)` in `dtype` (int4: both nibbles, in element order;
    int8: the stored byte viewed as int8, plus 128)."""
    if bits == 8:
        return codes.view(torch.int8).to(dtype).add_(128)
    half = codes.shape[-1]  # unpacked straight into the float buffer: no unpacked uint8 copy
    x = torch.empty(*codes.shape[:-1], 2 * half, dtype=dtype, device=codes.device)
    x[..., :half] = codes & 0x0F
    x[..., half:] = codes >> 4
    return x


def _dequantize_eager(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    x = unpack_codes(codes, bits, torch.promote_types(dtype, torch.float32))  # float64 models: exact
    groups = x.unflatten(-1, (-1, group_size))
    groups.mul_(scale.to(x.dtype)[..., None]).add_(offset.to(x.dtype)[..., None])
    return x.to(dtype)


_dequantize_op = torch.library.custom_op("litkv::dequantize", _dequantize_eager, mutates_args=())


@_dequantize_op.register_fake
def _dequantize_shape(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    return codes.new_empty(*codes.shape[:-1], codes.shape[-1] * 8 // bits, dtype=dtype)


def round_trip_error(x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """`(...)` float32 mean squared error of `dequantize(quantize(x))` against `x` `(..., D)` (in float32,
    before any cast to the model dtype), without packing and unpacking the codes."""
    groups = x.detach().float().unflatten(-1, (-1, group_size))
    codes, scale, offset = _codes(groups, bits, scale_dtype)
    restored = codes.mul_(scale.float()[..., None]).add_(offset.float()[..., None])
    return (groups - restored).square().flatten(-2).mean(dim=-1)


@dataclass(frozen=True)
class QuantizedSlots(PackedSlots):
    """Quantised slots as stored, attended from their codes (`attend`: `litkv.kvcache.quant_attention`).

    Attributes:
        codes: `(B, G, S, 2, D * bits / 8)` uint8 (index 0 of the fourth axis: key, 1: value).
        scales, offsets: `(B, G, S, 2, D / group_size)` float16 or bfloat16.
        bits: 8 or 4; group_size: numbers per group; dtype: the model dtype (of `unpack()`).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    group_size: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """`(B, G, S, D)`, the shape of the keys (and of the values)."""
        return torch.Size((*self.codes.shape[:3], self.codes.shape[-1] * 8 // self.bits))

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised keys and values, each `(B, G, S, D)` in `dtype`."""
        both = dequantize((self.codes, self.scales, self.offsets), self.bits, self.group_size, self.dtype)
        return both[:, :, :, 0], both[:, :, :, 1]

    def attend(
        self,
        q: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None,
        need_weights: bool,
        query_valid: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention over the codes, never dequantised (`quant_attend`; shapes as `PackedSlots.attend`)."""
        return quant_attend(q, self, mask, scale, softcap, need_weights, query_valid)


class QuantizedStorage(KVStorage):
    """Keys and values as int8 or int4 codes plus 16-bit per-group scales and offsets (lossy).

    A slot's key and value are quantised together: codes `(B, G, L, 2, head_size * bits / 8)`, scales
    and offsets `(B, G, L, 2, head_size / group)` (index 0 of the fourth axis: key, 1: value).
    """

    lossless = False
    reads_packed = True

    def __init__(
        self, shape: CacheShape, device: torch.device | None, dtype: torch.dtype, bits: int, group_size: int
    ) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        require_int("group_size", group_size, 1)
        size = shape.key_size
        if shape.value_size != size:
            raise ValueError(
                f"quantised storage needs keys and values of one size, got key_size={size} and "
                f"value_size={shape.value_size}"
            )
        self.group = min(group_size, size)
        if size % self.group != 0:
            raise ValueError(f"quant_group_size must divide the head size: {size} is not a multiple of {group_size}")
        if bits == 4 and size % 2 != 0:
            raise ValueError(f"int4 storage packs two numbers per byte and needs an even head size, got {size}")
        self.bits = bits
        self.dtype = dtype
        self.scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
        self.cache_length = shape.cache_length
        lead = (shape.batch_size, shape.n_query_groups, shape.cache_length + ROOM, 2)
        self.codes = torch.zeros(*lead, size * bits // 8, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(*lead, size // self.group, dtype=self.scale_dtype, device=device)
        self.offsets = torch.zeros_like(self.scales)

    # -- KVStorage ------------------------------------------------------------------------------

    def read_prefix(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        both = self._dequantize((self.codes[:, :, :end], self.scales[:, :, :end], self.offsets[:, :, :end]))
        return both[:, :, :, 0], both[:, :, :, 1]

    def read_packed(self, end: int) -> QuantizedSlots:
        """Slots `[0, end)` as stored (views, no copy): `(B, G, end, 2, *)`."""
        parts = (buffer[:, :, :end] for buffer in self._buffers())
        return QuantizedSlots(*parts, bits=self.bits, group_size=self.group, dtype=self.dtype)

    def write_range(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if cpu_decode.quantize_token(keys, values, *self._buffers(), start, self.bits, self.group):
            return  # a decode step's token: one C call from the key and value into the slot (the same bits)
        end = start + keys.shape[2]
        targets = [buffer[:, :, start:end] for buffer in self._buffers()]
        both = torch.stack((keys, values), dim=3).detach()
        if cpu_decode.quantize_into(both, *targets, self.bits, self.group):
            return  # quantised in one C call straight into the slots (the same bits)
        copy_ranges(list(self._buffers()), start, list(quantize(both, self.bits, self.group, self.scale_dtype)))

    def write(self, dest: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        new = self._quantize(keys, values)
        self.codes, self.scales, self.offsets = (
            scatter_slots(buffer, dest, part, valid) for buffer, part in zip(self._buffers(), new, strict=True)
        )

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "offsets": self.offsets}

    def commit_staged(self, target: torch.Tensor) -> None:
        if not cpu_decode.commit(*self._buffers(), target, self.bits, self.group):  # on the CPU: one C call
            super().commit_staged(target)

    def as_stored(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise and dequantise `(B, G, T, D)` keys and values; gradients pass straight through."""
        both = self._dequantize(self._quantize(keys, values))
        seen_keys, seen_values = both[:, :, :, 0], both[:, :, :, 1]
        if torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad):
            seen_keys = keys + (seen_keys - keys).detach()
            seen_values = values + (seen_values - values).detach()
        return seen_keys, seen_values

    # -- quantisation error ---------------------------------------------------------------------

    def token_errors(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Round-trip error of tokens before they are stored.

        Args:
            keys: `(B, G, T, head_size)`; values: `(B, G, T, head_size)`.

        Returns:
            `(B, G, T)` float32: mean squared round-trip error of the key plus that of the value.
        """
        both = torch.stack((keys, values), dim=3)
        errors = None
        if self.scale_dtype == torch.float16:  # on the CPU, one C call (`cpu_decode.round_trip_errors`)
            errors = cpu_decode.round_trip_errors(both, self.bits, self.group)
        if errors is None:
            errors = round_trip_error(both, self.bits, self.group, self.scale_dtype)
        return errors.sum(dim=-1)

    # -- internals ------------------------------------------------------------------------------

    def _buffers(self) -> QuantizedTensor:
        return self.codes, self.scales, self.offsets

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor) -> QuantizedTensor:
        """`(B, G, T, D)` keys and values -> codes, scales, offsets `(B, G, T, 2, *)`."""
        return quantize(torch.stack((keys, values), dim=3), self.bits, self.group, self.scale_dtype)

    def _dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        return dequantize(q, self.bits, self.group, self.dtype)


@register_storage("int8")
def _int8(shape: CacheShape, device: torch.device | None, dtype: torch.dtype, group_size: int) -> KVStorage:
    return QuantizedStorage(shape, device, dtype, bits=8, group_size=group_size)


@register_storage("int4")
def _int4(shape: CacheShape, device: torch.device | None, dtype: torch.dtype, group_size: int) -> KVStorage:
    return QuantizedStorage(shape, device, dtype, bits=4, group_size=group_size)
