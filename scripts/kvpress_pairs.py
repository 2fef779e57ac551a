"""The kvpress presses litkv's policies are compared with, and the litkv options that match each press
(used by `parity_kvpress.py` and `compare_kvpress.py`; needs kvpress, an optional dependency)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kvpress

WINDOW = 32  # SnapKV observation window on both sides
# name -> (litkv policy, litkv options, kvpress press from a compression ratio)
PAIRS: dict[str, tuple[str, dict[str, Any], Callable[[float], kvpress.BasePress]]] = {
    "knorm": ("knorm", {"recent": 0}, lambda r: kvpress.KnormPress(compression_ratio=r)),
    "keydiff": ("keydiff", {"recent": 0}, lambda r: kvpress.KeyDiffPress(compression_ratio=r)),
    "tova": ("tova", {"recent": 0, "heads": "all"}, lambda r: kvpress.TOVAPress(compression_ratio=r)),
    "snapkv": (
        "snapkv",
        {"recent": 0, "window": WINDOW, "kernel": 5},
        lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=WINDOW, kernel_size=5),
    ),
    "expected-attention": (
        "expected-attention",
        {"recent": 0, "n_sink": 4, "n_future_positions": 512},
        lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r, n_future_positions=512, n_sink=4),
    ),
    "last-recent": ("last-recent", {"sinks": 4}, lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=4)),
    "h2o": (
        "h2o",
        {"recent": 0, "normalize_scores": True},
        lambda r: kvpress.ObservedAttentionPress(compression_ratio=r),
    ),
}
# AdaKV pairs: kvpress masks instead of removing (AdaKVPress needs a non-eager twin)
ADAKV: dict[str, tuple[str, dict[str, Any], Callable[[float], kvpress.BasePress]]] = {
    "adakv-expected-attention": (
        "litkv.kvcache.adakv:AdaKVExpectedAttention",
        {**PAIRS["expected-attention"][1], "alpha_safeguard": 0.2},
        lambda r: kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=r), alpha_safeguard=0.2),
    ),
    "adakv-snapkv": (
        "litkv.kvcache.adakv:AdaKVSnapKV",
        {**PAIRS["snapkv"][1], "alpha_safeguard": 0.2},
        lambda r: kvpress.AdaKVPress(
            kvpress.SnapKVPress(compression_ratio=r, window_size=WINDOW, kernel_size=5), alpha_safeguard=0.2
        ),
    ),
}
