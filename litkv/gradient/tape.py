"""What the no-grad forward pass records per layer, and how the backward pass walks it back.

For one layer, the tape keeps on the host:

- the key and value of every token as attention read them from the cache (after RoPE; dequantised
  when the storage is lossy), `(B, G, T + 1, head_size)`; index `T` is a scratch row that absorbs
  writes and reads for empty slots;
- per chunk, which slots the chunk changed and the token positions those slots held before it (the
  policy's choices, `O(chunk)` per chunk);
- float32 gradient accumulators for the cached keys and values, the same shape as the keys/values
  (only when stored entries carry gradients: quantised storage is not differentiable).

Starting from the positions after the last chunk, undoing the changes of chunks `N-1, ..., c` gives
the slot positions chunk `c` attended to. Host memory is `O(T)`; nothing here grows on the compute
device.
"""

from __future__ import annotations

import torch

from litkv.kvcache.machine import SlotMachine

__all__ = ["LayerTape"]

_HOST = torch.device("cpu")


class LayerTape:
    """Host-side record of one layer's cache over a chunked pass, plus gradient accumulators.

    Args:
        cache: the layer's (fresh) cache; its shape, dtype and config (as the policy adjusted it) are kept.
        seq_len: `T`.
        track_grads: whether stored keys/values carry gradients back to the keys/values that produced
            them (False for non-differentiable lossy storage); without, no accumulators are kept.

    Attributes:
        config: the cache's config (its storage kind is what `stored_view` must reproduce).
        track_grads: as given.
    """

    def __init__(self, cache: SlotMachine, seq_len: int, track_grads: bool) -> None:
        s = cache.shape
        b, g, rows = s.batch_size, s.n_query_groups, seq_len + 1
        self.config = cache.config
        self.seq_len = seq_len
        self.track_grads = track_grads
        self.keys = torch.zeros(b, g, rows, s.key_size, dtype=cache.dtype, device=_HOST)
        self.values = torch.zeros(b, g, rows, s.value_size, dtype=cache.dtype, device=_HOST)
        self.stored = torch.zeros(b, g, rows, dtype=torch.bool, device=_HOST)  # keys/values recorded
        grad_rows = rows if track_grads else 0
        self.grad_keys = torch.zeros(b, g, grad_rows, s.key_size, dtype=torch.float32, device=_HOST)
        self.grad_values = torch.zeros(b, g, grad_rows, s.value_size, dtype=torch.float32, device=_HOST)
        self._rows = torch.arange(b)[:, None, None]
        self._groups = torch.arange(g)[None, :, None]
        self._slots: list[torch.Tensor] = []
        self._previous: list[torch.Tensor] = []
        self._positions: torch.Tensor | None = None
        self._cursor = 0

    # -- forward: recording ---------------------------------------------------------------------

    def record_chunk(self, cache: SlotMachine, before: torch.Tensor, start: int, end: int) -> None:
        """Record what the chunk `[start, end)` did to `cache`.

        Args:
            cache: the layer's cache, right after the chunk's `update()`.
            before: `(B, G, L)` the cache's positions before the chunk.
            start, end: token range of the chunk (positions are token indices).
        """
        after = cache.positions
        changed = after != before
        n = int(changed.sum(dim=2).max()) if changed.numel() else 0
        slots = torch.sort(changed.to(torch.int8), dim=2, descending=True, stable=True).indices[..., :n]
        self._slots.append(slots.to(_HOST, torch.int32))
        self._previous.append(before.gather(2, slots).to(_HOST, torch.int32))
        new_pos = after.gather(2, slots)
        target = torch.where((new_pos >= start) & (new_pos < end), new_pos, self.seq_len).to(_HOST)
        keys, values = cache.storage.read()
        for stored, host in ((keys, self.keys), (values, self.values)):
            index = slots[..., None].expand(*slots.shape, stored.shape[-1])
            host.index_put_((self._rows, self._groups, target), stored.gather(2, index).to(_HOST, host.dtype))
        self.stored.index_put_((self._rows, self._groups, target), torch.ones_like(target, dtype=torch.bool))

    def recorded(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys `(B, G, n, key_size)`, values and a `(B, G, n)` bool "was stored" of tokens `[start, end)`,
        as the forward pass stored them (undefined where not stored)."""
        return self.keys[:, :, start:end], self.values[:, :, start:end], self.stored[:, :, start:end]

    def finish(self, cache: SlotMachine) -> None:
        """Record the positions after the last chunk; the backward walk starts from them."""
        self._positions = cache.positions.to(_HOST, torch.int64, copy=True)
        self._cursor = len(self._slots)

    # -- backward: replaying ----------------------------------------------------------------------

    def rewind(self, chunk: int) -> torch.Tensor:
        """Positions of the slots chunk `chunk` attended to, `(B, G, n)` int64 on the host (`-1`: empty).

        Must be called for chunks `N-1, N-2, ..., 0` in this order.
        """
        if self._positions is None:
            raise RuntimeError("LayerTape.rewind() called before finish()")
        if chunk != self._cursor - 1:
            raise RuntimeError(
                f"LayerTape.rewind() must go backwards one chunk at a time: expected chunk "
                f"{self._cursor - 1}, got {chunk}"
            )
        self._cursor = chunk
        self._positions.scatter_(2, self._slots[chunk].long(), self._previous[chunk].long())
        # Trailing slots empty in every row and head are left out (policies may fill slots in any order).
        used = (self._positions >= 0).flatten(0, 1).any(dim=0).nonzero()
        n = int(used[-1]) + 1 if used.numel() else 0
        return self._positions[..., :n].clone()

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Recorded keys `(B, G, n, key_size)` and values `(B, G, n, value_size)` of `positions` `(B, G, n)`."""
        index = self._host_index(positions)
        return self.keys[index], self.values[index]

    def accumulate(self, positions: torch.Tensor, grad_keys: torch.Tensor, grad_values: torch.Tensor) -> None:
        """Add gradients `(B, G, n, *)` of the cached entries at `positions` `(B, G, n)` to the accumulators."""
        if not self.track_grads:
            raise RuntimeError("this tape keeps no gradient accumulators (track_grads=False)")
        index = self._host_index(positions)
        self.grad_keys.index_put_(index, grad_keys.to(_HOST, torch.float32), accumulate=True)
        self.grad_values.index_put_(index, grad_values.to(_HOST, torch.float32), accumulate=True)

    def grads_of(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulated gradients of the stored keys/values of tokens `[start, end)`: `(B, G, end - start, *)`.

        Empty along the token axis when the tape does not track gradients.
        """
        return self.grad_keys[:, :, start:end], self.grad_values[:, :, start:end]

    def _host_index(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = positions.to(_HOST, torch.int64)
        return self._rows, self._groups, torch.where(pos >= 0, pos, self.seq_len)
