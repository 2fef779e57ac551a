"""`RecurrentTape`: what the gradient engine keeps of a recurrent (Mamba-2) layer across the chunks.

The forward records the layer's state before every chunk (on the host). The backward, chunk by chunk in
reverse, restarts the layer from that state as a leaf that requires grad; the state after the chunk is
a backward root whose gradient is what the next chunk sent back to its own starting state. So the
gradient flows through the whole chain of states, as through one pass over the sequence.
"""

from __future__ import annotations

import torch

from litkv.kvcache.recurrent import RecurrentCache

__all__ = ["RecurrentTape"]


class RecurrentTape:
    """States of one recurrent layer at the chunk boundaries, and the gradient flowing back through them."""

    def __init__(self, cache: RecurrentCache) -> None:
        self.shape = cache.shape
        self.dtype = cache.dtype
        self.kind = cache.kind
        self.starts: list[dict[str, torch.Tensor]] = []  # the state before each chunk, on the host
        self.grad: dict[str, torch.Tensor] | None = None  # d loss / d (state after the chunk being replayed)
        self.leaves: dict[str, torch.Tensor] = {}  # the replayed chunk's starting state (leaves)

    def record_start(self, cache: RecurrentCache) -> None:
        """Keep the state before the next chunk."""
        self.starts.append({k: v.detach().to("cpu", copy=True) for k, v in cache.state_tensors().items()})

    def replay_cache(self, chunk: int, device: torch.device) -> RecurrentCache:
        """A cache starting from the state before `chunk`, whose tensors are leaves that require grad."""
        cache = RecurrentCache(self.shape, device, self.dtype, kind=self.kind)
        self.leaves = {k: v.to(device).requires_grad_(True) for k, v in self.starts[chunk].items()}
        cache.conv, cache.ssm = self.leaves["conv"], self.leaves["ssm"]
        return cache

    def roots(self, cache: RecurrentCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The state after the replayed chunk with the gradient the next chunk sent (none for the last)."""
        if self.grad is None:
            return []
        out = []
        for name, tensor in cache.state_tensors().items():
            if tensor.requires_grad:
                out.append((tensor, self.grad[name].to(tensor.device, tensor.dtype)))
        return out

    def take_grads(self) -> None:
        """After the chunk's backward: its starting state's gradient, for the chunk before."""
        self.grad = {k: torch.zeros_like(v) if v.grad is None else v.grad.detach() for k, v in self.leaves.items()}
        self.leaves = {}
