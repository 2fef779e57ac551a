"""Counts a file declares, checked before anything is allocated or a model is constructed.

A config (litkv's `model_config.yaml`, a Hugging Face `config.json`, hybrid ones included) or a GGUF
file's metadata declares counts: layers, widths, heads, vocabulary, context. A model is built from them
(on the meta device first, which still costs time per layer), so a count edited to 10**9 would run for
minutes into a MemoryError. Each count is checked here first against a ceiling above every released
model (`CEILINGS`), and the layer count against the layers whose tensors the file holds; a GGUF file's
strings and arrays against their own ceilings. Every refusal is one line naming the file and the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = ["CEILINGS", "MAX_GGUF_ARRAY", "MAX_GGUF_STRING", "check_ceilings", "check_layer_count", "layer_indices"]

#: The largest value of each count litkv builds a model from (well above every released model: ~130
#: layers, width 16k-25k, 256k-token vocabularies, 10M-token contexts, 128 heads).
CEILINGS: dict[str, int] = {
    "n_layer": 1024,
    "n_embd": 65_536,
    "n_head": 1024,
    "n_query_groups": 1024,
    "head_size": 4096,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 22,
    "padded_vocab_size": 1 << 22,
    "block_size": 1 << 27,
    "mamba_n_heads": 4096,
    "mamba_head_dim": 4096,
    "mamba_n_groups": 1024,
    "mamba_d_state": 4096,
    "mamba_d_conv": 64,
    "mamba_chunk_size": 1 << 16,
}
#: The longest GGUF metadata string (a chat template is ~10 KB) and the most elements of one array (the
#: vocabulary's tokens, its merges) litkv reads.
MAX_GGUF_STRING = 1 << 22
MAX_GGUF_ARRAY = 1 << 23

# the layer index in a tensor name: litkv/LitGPT `transformer.h.3.`, Hugging Face `model.layers.3.`, GGUF `blk.3.`
_LAYER = re.compile(r"(?:^|\.)(?:h|layers|blk|blocks)\.(\d+)\.")


def check_ceilings(values: Mapping[str, object], source: str, names: Mapping[str, str] | None = None) -> None:
    """ValueError naming `source` and the field for an integer count above its ceiling.

    Args:
        values: field -> value as the file writes it (non-integers are left to the caller's checks).
        source: the file, named in the message.
        names: field -> the `CEILINGS` key it is (default: the field's own name).
    """
    for field, value in values.items():
        kind = (names or {}).get(field, field)
        ceiling = CEILINGS.get(kind)
        if ceiling is None or isinstance(value, bool) or not isinstance(value, int):
            continue
        if value > ceiling:
            raise ValueError(
                f"{source}: {field} = {value} is beyond any model litkv builds (at most {ceiling}); "
                "the file is corrupt or was edited"
            )


def layer_indices(names: Iterable[str]) -> set[int]:
    """The layer indices that tensor `names` hold weights for (`transformer.h.N.`, `layers.N.`, `blk.N.`)."""
    out = set()
    for name in names:
        match = _LAYER.search(name)
        if match:
            out.add(int(match.group(1)))
    return out


def check_layer_count(declared: object, names: Iterable[str], source: str, field: str, weights: str) -> None:
    """ValueError naming `source`, `field` and `weights` unless the weights hold exactly layers
    `0..declared-1` (checked only when an integer is declared; a file with no layer tensors at all is
    left to the shape checks that follow)."""
    if isinstance(declared, bool) or not isinstance(declared, int):
        return
    present = layer_indices(names)
    if not present:
        return
    if present != set(range(declared)):
        found = f"{len(present)} layers (indices {min(present)}..{max(present)})"
        raise ValueError(f"{source}: {field} = {declared}, but {weights} holds {found}")
