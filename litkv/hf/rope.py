"""The RoPE tables of a transformers model as litkv's policies read them (`KVCache.bind_rope`: `table(n) -> (cos,
sin)` `(N, n_elem)`, `N >= n`), for the policies that score with RoPE (`expected-attention`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

__all__ = ["rope_table"]

RopeTable = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def rope_table(model: torch.nn.Module, layer: int, device: torch.device) -> tuple[RopeTable, int]:
    """`(table, n_elem)` for `layer` of `model`, from the model's own rotary embedding (its `rotary_emb` module;
    Gemma-3's per layer type)."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no rotary_emb module: a RoPE-scoring policy cannot run on it")
    extra: tuple[object, ...] = ()
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    if layer_types is not None and "layer_type" in inspect.signature(rotary.forward).parameters:
        extra = (layer_types[layer],)
    built: list[tuple[torch.Tensor, torch.Tensor]] = []

    def table(needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not built or built[0][0].shape[0] < needed:
            length = 1 << max(needed - 1, 4095).bit_length()
            x = torch.zeros(1, dtype=torch.float32, device=device)
            positions = torch.arange(length, device=device)[None]
            with torch.no_grad():
                cos, sin = rotary(x, positions, *extra)
            built[:] = [(cos[0].float(), sin[0].float())]
        return built[0]

    return table, table(1)[0].shape[-1]
