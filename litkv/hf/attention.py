"""The attention function and the mask function `litkv.hf` registers with transformers (`"litkv"`).

A model set to the `"litkv"` attention implementation calls `litkv_attention` in every attention layer with the
layer's queries (after RoPE) and the keys and values its cache's `update` returned. When that cache is a
`litkv.hf.Cache`, the call is handed to it (`Cache.attend`: litkv's own layer cache attends, then evicts, with
the queries and attention weights the policy asks for); otherwise (another cache, no cache) it is transformers'
SDPA attention. The mask function gives the litkv path the 2D padding mask as it is (`(B, columns)`, no
`(T, S)` mask is built) and every other call SDPA's mask.

A call reaches the cache through a note left by `update` (`note_update`): the layer, and the key tensor it
returned, which must be the one the attention function is given. For a policy that reads the layer's attention
input (`needs_hidden`: `learned` with gates of the hidden state), `watch_hidden` puts a forward pre-hook on each
attention module that notes the `hidden_states` it is called with (`note_hidden`); the attention function hands
that note to the cache when it is its module's.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import torch

__all__ = [
    "ATTN_IMPLEMENTATION",
    "litkv_attention",
    "litkv_mask",
    "note_hidden",
    "note_mask_sizes",
    "note_update",
    "register",
    "watch_hidden",
]

#: The name under which the attention and mask functions are registered.
ATTN_IMPLEMENTATION = "litkv"

_NOTES = threading.local()
_WATCHED: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()  # module -> hook handle


class Cache(Protocol):
    """What the attention function needs of a `litkv.hf.Cache`: its `attend`."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pad_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        scale: float,
        window: int | None,
        softcap: float | None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


def note_update(cache: Cache, layer: int, key: torch.Tensor) -> None:
    """`Cache.update` of `layer` returned `key`: the next attention call with that key goes to `cache`."""
    _NOTES.update = (cache, layer, key)


def note_hidden(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A forward pre-hook (`with_kwargs=True`) of an attention module: note the `hidden_states` `(B, T, C)` it is
    called with (its first argument), for the attention function that `module` calls next."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    _NOTES.hidden = (module, hidden) if isinstance(hidden, torch.Tensor) else None


def watch_hidden(model: torch.nn.Module) -> None:
    """Put `note_hidden` on each attention module of `model` (each module whose name ends in `self_attn`), once.

    Raises:
        ValueError: `model` has no such module.
    """
    modules = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no self_attn modules: its attention inputs cannot be read")
    for module in modules:
        if module not in _WATCHED:
            _WATCHED[module] = module.register_forward_pre_hook(note_hidden, with_kwargs=True)


def note_mask_sizes() -> None:
    """A `litkv.hf.Cache` gave the mask sizes: the mask about to be built is for it (the 2D padding mask)."""
    _NOTES.mask_for_litkv = True


def litkv_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask interface: for a `litkv.hf.Cache`, the 2D padding mask `(B, columns)` bool (`None`: no
    pads); else SDPA's mask (`masking_utils.sdpa_mask`, same arguments)."""
    if getattr(_NOTES, "mask_for_litkv", False):
        _NOTES.mask_for_litkv = False
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                f"litkv.hf.Cache takes a 2D padding attention_mask (batch, columns), got {attention_mask.dim()}D"
            )
        return attention_mask
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def litkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: `query` `(B, H, T, hs)`, `key`/`value` `(B, G, T, hs)` (what the cache's
    `update` returned) -> `(B, T, H, hv)` and no weights. Through a `litkv.hf.Cache` when its `update` returned
    `key`; else transformers' SDPA attention with the same arguments."""
    noted = getattr(_NOTES, "update", None)
    _NOTES.update = None
    seen = getattr(_NOTES, "hidden", None)
    _NOTES.hidden = None
    if noted is None or noted[2] is not key:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        extra = {name: x for name, x in (("sliding_window", sliding_window), ("softcap", softcap)) if x is not None}
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs
        )
    cache, layer, _ = noted
    if module.training and dropout:
        raise ValueError("litkv.hf.Cache runs inference only: the model is in training mode with attention dropout")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    hidden = seen[1] if seen is not None and seen[0] is module else None
    y = cache.attend(layer, query, key, value, attention_mask, kwargs.get("position_ids"), scale, sliding_window,
                     softcap, hidden)  # fmt: skip
    b, h, t, _ = query.shape
    return y.view(b, t, h, -1), None


def register() -> None:
    """Register `litkv_attention` and `litkv_mask` with transformers under `ATTN_IMPLEMENTATION` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, litkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, litkv_mask)
