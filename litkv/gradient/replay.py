"""A cache that replays one recorded chunk: given cached keys/values/positions, nothing evicted.

During the backward pass each chunk is recomputed with the slots it attended to in the forward pass.
The policy is never run again: its choices come from the tape, so H2O's scores are not recomputed.
`ReplayKVCache` is not a policy: it implements only what attention needs of a cache (`LayerCache`).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from litkv.kvcache.base import CacheShape
from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.storage import KVStorage
from litkv.kvcache.storage_kinds import make_storage

__all__ = ["ReplayKVCache", "stored_view", "stores_gradients"]


class ReplayKVCache:
    """Attends to fixed cached slots plus the new tokens, and keeps the new keys/values for the caller.

    Args:
        keys: `(B, G, n, key_size)` cached keys as attention read them, usually leaves requiring grad.
        values: `(B, G, n, value_size)` cached values.
        positions: `(B, G, n)` int64 token positions of the cached slots, `-1` for empty ones.
        stored_as: the recorded cache's config; with lossy storage, the new tokens are attended as it
            stores them (`KVStorage.as_stored`), as in the recorded forward pass.
        recorded_new: with lossy storage, the new tokens' keys `(B, G, T, key_size)` and values as the
            forward pass stored them, and `(B, G, T)` bool where they were stored. Attention uses those
            (gradients straight through to the recomputed ones): recomputed keys may differ in their last
            bit, and rounding them again could flip a code.

    Attributes:
        new_keys, new_values: `(B, G, T, *)` keys/values of the replayed chunk, set by `attend_inputs`.
    """

    needs_attn_weights: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False
    heads_share_positions: ClassVar[bool] = False

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        stored_as: KVCacheConfig | None = None,
        recorded_new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        b, g, n, key_size = keys.shape
        if values.shape[:3] != keys.shape[:3] or tuple(positions.shape) != (b, g, n):
            raise ValueError(
                f"cached keys {tuple(keys.shape)}, values {tuple(values.shape)} and positions "
                f"{tuple(positions.shape)} must agree in (B, G, n)"
            )
        self.cached_keys = keys
        self.cached_values = values
        self.positions = positions
        self.num_filled = n
        self.new_keys: torch.Tensor | None = None
        self.new_values: torch.Tensor | None = None
        self.recorded_storage: KVStorage | None = None
        self.recorded_new = recorded_new
        if stored_as is not None and stored_as.storage != "float":
            one = CacheShape(b, g, 1, key_size, values.shape[-1])
            self.recorded_storage = make_storage(
                stored_as.storage, one, keys.device, keys.dtype, stored_as.quant_group_size
            )

    def attend_inputs(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        input_pos: torch.Tensor,
        queries: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cached slots followed by the new tokens: `(B, G, n + T, *)` keys/values and positions."""
        if self.new_keys is not None:
            raise RuntimeError("a replay cache replays exactly one chunk; attend_inputs() was called twice")
        b, g, t = keys.shape[:3]
        if (b, g) != tuple(self.positions.shape[:2]) or tuple(input_pos.shape) != (b, t):
            raise ValueError(
                f"replayed chunk does not match the recording: cached (B, G) = {tuple(self.positions.shape[:2])}, "
                f"got keys {tuple(keys.shape)} and input_pos {tuple(input_pos.shape)}"
            )
        self.new_keys, self.new_values = keys, values
        if self.recorded_storage is not None:
            keys, values = self._as_recorded(keys, values)
        new_pos = input_pos[:, None, :].expand(b, g, t)
        if self.num_filled == 0:
            return keys, values, new_pos
        all_keys = torch.cat((self.cached_keys.to(keys.dtype), keys), dim=2)
        all_values = torch.cat((self.cached_values.to(values.dtype), values), dim=2)
        return all_keys, all_values, torch.cat((self.positions.to(new_pos.device), new_pos), dim=2)

    def _as_recorded(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New keys/values as the recorded forward pass attended them (see `recorded_new`)."""
        seen_keys, seen_values = self.recorded_storage.as_stored(keys, values)
        if self.recorded_new is None:
            return seen_keys, seen_values
        rec_keys, rec_values, stored = (x.to(keys.device) for x in self.recorded_new)
        stored = stored[..., None]
        seen_keys = torch.where(stored, keys + (rec_keys.to(keys.dtype) - keys).detach(), seen_keys)
        seen_values = torch.where(stored, values + (rec_values.to(values.dtype) - values).detach(), seen_values)
        return seen_keys, seen_values

    def evict_and_store(self, attn_weights: torch.Tensor | None) -> None:
        """Nothing to evict or write."""

    def nbytes(self) -> int:
        return self.cached_keys.nbytes + self.cached_values.nbytes


def stored_view(config: KVCacheConfig, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values as a later chunk reads them back from a cache with `config`'s storage.

    Lossless storage returns its inputs. Lossy storage writes them into a fresh storage of the same kind
    and reads them back, so the result and its autograd graph are those of `forward_chunked`.

    Args:
        keys: `(B, G, T, key_size)`; values: `(B, G, T, value_size)`.

    Returns:
        Keys and values of the same shapes.
    """
    if config.storage == "float":
        return keys, values
    b, g, t, key_size = keys.shape
    shape = CacheShape(b, g, t, key_size, values.shape[-1])
    storage = make_storage(config.storage, shape, keys.device, keys.dtype, config.quant_group_size)
    if storage.lossless:
        return keys, values
    dest = torch.arange(t, device=keys.device).expand(b, g, t)
    valid = torch.ones(b, g, t, dtype=torch.bool, device=keys.device)
    storage.write(dest, keys, values, valid)
    return storage.read()


def stores_gradients(config: KVCacheConfig, shape: CacheShape, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether keys/values read back from `config`'s storage carry gradients to the ones written.

    True for float storage; False for quantised storage, whose rounding is not differentiable (then
    `forward_chunked` sends no gradient through cached entries, and neither does the engine).
    """
    probe_keys = torch.zeros(1, 1, 1, shape.key_size, device=device, dtype=dtype, requires_grad=True)
    probe_values = torch.zeros(1, 1, 1, shape.value_size, device=device, dtype=dtype, requires_grad=True)
    with torch.enable_grad():
        keys, values = stored_view(config, probe_keys, probe_values)
    return keys.requires_grad or values.requires_grad
