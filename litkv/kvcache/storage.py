"""Where cache slots live. A policy is composed with one storage object; it never subclasses it.

Every storage holds `cache_length` slots per (batch row, KV head) and offers the same operations:
read all slots, read a prefix, write a contiguous range, and scatter-write chosen slots. Writes are
in place under `torch.no_grad()` and functional (new tensors) when autograd records, so that
`forward_chunked` stays differentiable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ROOM",
    "CacheShape",
    "FloatStorage",
    "KVStorage",
    "PackedSlots",
    "copy_ranges",
    "load_into",
    "move_staged",
    "needs_functional",
    "scatter_slots",
]


@dataclass(frozen=True)
class CacheShape:
    """Sizes of one layer's cache: `(batch_size, n_query_groups, cache_length, key_size / value_size)`."""

    batch_size: int
    n_query_groups: int
    cache_length: int
    key_size: int
    value_size: int


def needs_functional(*tensors: torch.Tensor) -> bool:
    """Whether autograd records a write of these tensors (then writes make new tensors, not in place)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def load_into(owner: str, live: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` into the `live` tensors of the same names (in place, no autograd).

    Raises ValueError naming `owner`, the tensor, and the expected and actual names, shapes or dtypes.
    """
    if set(tensors) != set(live):
        raise ValueError(f"{owner}: expected state tensors {sorted(live)}, got {sorted(tensors)}")
    for name, target in live.items():
        source = tensors[name]
        if tuple(source.shape) != tuple(target.shape) or source.dtype != target.dtype:
            raise ValueError(
                f"{owner}: state tensor {name!r} must be {tuple(target.shape)} {target.dtype}, "
                f"got {tuple(source.shape)} {source.dtype}"
            )
    with torch.no_grad():
        for name, target in live.items():
            target.copy_(tensors[name])


def scatter_slots(buffer: torch.Tensor, dest: torch.Tensor, source: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Write `source` into the slots `dest` of `buffer` where `valid`; other destinations keep their value.

    Args:
        buffer: `(B, G, L, *rest)`.
        dest: `(B, G, T)` slot indices, distinct per (row, head).
        source: `(B, G, T, *rest)`.
        valid: `(B, G, T)` bool.

    Returns:
        The updated buffer: the same tensor when written in place, else a new one.
    """
    rest = buffer.shape[3:]
    index = dest.view(*dest.shape, *([1] * len(rest))).expand(*dest.shape, *rest)
    old = buffer.gather(2, index)
    mask = valid.view(*valid.shape, *([1] * len(rest)))
    new = torch.where(mask, source.to(buffer.dtype), old)
    if needs_functional(buffer, source):
        return buffer.scatter(2, index, new)
    return buffer.scatter_(2, index, new)


def _copy_ranges(buffers: list[torch.Tensor], start: int, sources: list[torch.Tensor]) -> None:
    for buffer, source in zip(buffers, sources, strict=True):
        buffer[:, :, start : start + source.shape[2]] = source


def _move_staged(buffers: list[torch.Tensor], length: int, target: torch.Tensor) -> None:
    for buffer in buffers:
        staged = buffer[:, :, length : length + 1].clone()
        index = target.view(*target.shape, *([1] * (buffer.dim() - 3))).expand(staged.shape)
        buffer.scatter_(2, index, staged)


# Under `torch.compile` a decode step writes its cache through these ops, which say they mutate `buffers`: inductor
# then writes them in place. Written as slice and scatter writes, the step's two writes of a buffer with an opaque
# attention op reading it in between were made functional, each buffer copied whole about three times per layer.
_copy_ranges_op = torch.library.custom_op("litkv::copy_ranges", _copy_ranges, mutates_args=("buffers",))
_move_staged_op = torch.library.custom_op("litkv::move_staged", _move_staged, mutates_args=("buffers",))


def copy_ranges(buffers: list[torch.Tensor], start: int, sources: list[torch.Tensor]) -> None:
    """`buffer[:, :, start : start + T] = source` in place for each pair: `buffer` `(B, G, N, *)`, `source`
    `(B, G, T, *)`."""
    (_copy_ranges_op if torch.compiler.is_compiling() else _copy_ranges)(buffers, start, sources)


def move_staged(buffers: list[torch.Tensor], length: int, target: torch.Tensor) -> None:
    """Copy slot `length` of each buffer `(B, G, N, *)` (the staged token) into slot `target` `(B, G, 1)` of each
    (row, head), in place; `target == length` leaves it where it is."""
    (_move_staged_op if torch.compiler.is_compiling() else _move_staged)(buffers, length, target)


# Slots after the `cache_length` ones where a decode step's new token waits while it is attended
# (`KVStorage.stage`), so that a step never copies the cache: it moves into the freed slot afterwards.
ROOM = 1


class PackedSlots:
    """Slots in a storage's own format, attended by that format's own kernel (`attend`; for
    `QuantizedStorage`: `litkv.kvcache.quant_attention`), so that a decode step does not convert every
    slot and `litkv.modeling.attention.attend` dispatches to it without knowing the format.

    `shape` is that of the keys, `(B, G, S, key_size)`; `unpack()` gives the keys and values in the model
    dtype, `(B, G, S, key_size)` and `(B, G, S, value_size)`, for whoever needs them as tensors.
    """

    @property
    def shape(self) -> torch.Size:
        raise NotImplementedError

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attend(
        self,
        q: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None,
        need_weights: bool,
        query_valid: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Masked grouped-query attention of `q` over these slots, as `litkv.modeling.attention.attend` (same
        arguments and results: `q` `(B, n_head, T, hs)`, `mask` `(B, G or 1, T, S)`, or None for one query per
        head that sees every slot -> `y` `(B, T, n_head * hv)` and the weights `(B, G, S)` float32 or `None`)."""
        raise NotImplementedError


class KVStorage:
    """Interface of a slot storage. `FloatStorage` is the plain one; quantised ones follow it.

    Buffers hold `cache_length + ROOM` slots: the last `ROOM` are staging room for a call's new tokens
    (`stage`, `read_staged`, `commit_staged`), never part of the cache's state.
    """

    lossless: bool = True
    reads_packed: bool = False  # `read_packed` gives the slots in a format an attention kernel reads
    cache_length: int = 0

    def read_prefix(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots `[0, end)` as `(B, G, end, key_size)`, `(B, G, end, value_size)`."""
        raise NotImplementedError

    def write_range(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write `(B, G, T, *)` keys and values into slots `[start, start + T)`."""
        raise NotImplementedError

    def write(self, dest: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Write `(B, G, T, *)` keys/values into slots `dest` `(B, G, T)` where `valid` `(B, G, T)`."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of the `cache_length` slots (the `ROOM` staging slots, `ROOM / L` more, not counted)."""
        return sum(t.nbytes for t in self.state_tensors().values())

    def buffers(self) -> dict[str, torch.Tensor]:
        """The tensors that hold the slots and the room, by name, each `(B, G, L + ROOM, ...)`."""
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that hold the slots, by name, each `(B, G, L, ...)` (slot index on dim 2).

        Views of the live buffers (no copy): a snapshot clones them, `load_state_tensors` copies back.
        """
        return {name: buffer[:, :, : self.cache_length] for name, buffer in self.buffers().items()}

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots as `(B, G, L, key_size)`, `(B, G, L, value_size)` in the model dtype."""
        return self.read_prefix(self.cache_length)

    def stage(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write `(B, G, T, *)` new keys and values (`T <= ROOM`) into the room after the slots, in place."""
        self.write_range(self.cache_length, keys, values)

    def read_staged(self, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots then the `num_new` staged tokens, as stored: `(B, G, L + num_new, *)`."""
        return self.read_prefix(self.cache_length + num_new)

    def read_packed(self, end: int) -> PackedSlots | None:
        """Slots `[0, end)` still packed (a decode step's view, no copy), for a storage whose format an attention
        kernel reads directly; `None` (the default): attention gets `read_prefix`'s tensors."""
        return None

    def commit_staged(self, target: torch.Tensor) -> None:
        """Move the staged token (room slot `L`) into slot `target` `(B, G, 1)` of each (row, head), in
        place; `target == L` leaves it in the room (dropped). Only that token is copied, as stored."""
        move_staged(list(self.buffers().values()), self.cache_length, target)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy tensors shaped as `state_tensors()` returns them into this storage's slots."""
        load_into(type(self).__name__, self.state_tensors(), tensors)

    def as_stored(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New `(B, G, T, *)` keys and values exactly as a later read will return them once written.

        Attention uses this for the new tokens of a call, so that a token looks the same to every query
        whether it arrives in the same chunk or a later one (no dependence on chunk boundaries or on
        left padding). Lossless storage returns its inputs; lossy storage passes gradients straight
        through its rounding.
        """
        return keys, values


class FloatStorage(KVStorage):
    """Keys and values kept as they come, in the model dtype."""

    lossless = True

    def __init__(self, shape: CacheShape, device: torch.device | None, dtype: torch.dtype) -> None:
        b, g, n = shape.batch_size, shape.n_query_groups, shape.cache_length + ROOM
        self.cache_length = shape.cache_length
        self.keys = torch.zeros(b, g, n, shape.key_size, device=device, dtype=dtype)
        self.values = torch.zeros(b, g, n, shape.value_size, device=device, dtype=dtype)

    def read_prefix(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, :end], self.values[:, :, :end]

    def write_range(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        end = start + keys.shape[2]
        if needs_functional(self.keys, keys, values):
            self.keys = torch.cat((self.keys[:, :, :start], keys, self.keys[:, :, end:]), dim=2)
            self.values = torch.cat((self.values[:, :, :start], values, self.values[:, :, end:]), dim=2)
        else:
            copy_ranges([self.keys, self.values], start, [keys, values])

    def write(self, dest: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        self.keys = scatter_slots(self.keys, dest, keys, valid)
        self.values = scatter_slots(self.values, dest, values, valid)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"keys": self.keys, "values": self.values}
