"""The hybrid families the tests run alike, as one parametrized list: Bamba (Mamba-2 beside attention) and
Qwen3.5 (Gated DeltaNet beside gated attention with an output gate, q/k norms and partial RoPE). Each tiny
config has 4 layers, two of them attention layers, and a vocabulary of `VOCAB` tokens."""

from __future__ import annotations

from collections.abc import Callable

from bamba_helpers import VOCAB as BAMBA_VOCAB
from bamba_helpers import bamba_config
from qwen35_helpers import VOCAB as QWEN35_VOCAB
from qwen35_helpers import qwen35_config

from litkv.modeling.config import Config

HYBRID_FAMILIES: dict[str, Callable[[], Config]] = {"bamba": bamba_config, "qwen3.5": qwen35_config}
VOCAB = BAMBA_VOCAB
if QWEN35_VOCAB != BAMBA_VOCAB:
    raise ValueError(f"the hybrid helpers' vocabularies differ: {BAMBA_VOCAB} and {QWEN35_VOCAB}")
