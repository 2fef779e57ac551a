"""litkv: a LitGPT-style GPT whose KV cache is a pluggable abstraction.

`import litkv` imports nothing heavy: each public name below is imported from its module on first use
(PEP 562), so `litkv --help` and scripts that use one part do not pay for torch, LitGPT and Lightning
until they need them.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from litkv.checkpoints.runtime import load
    from litkv.gradient import chunked_loss_backward
    from litkv.inference.blocks import Segment
    from litkv.inference.chat_prompt import chat_prompt, chat_stop_tokens
    from litkv.inference.generate import forward_chunked, generate
    from litkv.inference.sampling import Sampling
    from litkv.kvcache import KVCache, register_kv_cache
    from litkv.kvcache.config import KVCacheConfig
    from litkv.modeling.config import Config
    from litkv.modeling.model import GPT
    from litkv.states.block_store import BlockStore
    from litkv.states.prefix import PrefixCache
    from litkv.states.state import CacheState, restore, snapshot
    from litkv.states.undo import keep_undo_log, truncate

#: Public name -> the module that defines it (imported when the name is first read).
_LAZY: dict[str, str] = {
    "BlockStore": "litkv.states.block_store",
    "CacheState": "litkv.states.state",
    "GPT": "litkv.modeling.model",
    "Config": "litkv.modeling.config",
    "KVCache": "litkv.kvcache",
    "KVCacheConfig": "litkv.kvcache.config",
    "PrefixCache": "litkv.states.prefix",
    "Sampling": "litkv.inference.sampling",
    "Segment": "litkv.inference.blocks",
    "chat_prompt": "litkv.inference.chat_prompt",
    "chat_stop_tokens": "litkv.inference.chat_prompt",
    "chunked_loss_backward": "litkv.gradient",
    "forward_chunked": "litkv.inference.generate",
    "generate": "litkv.inference.generate",
    "keep_undo_log": "litkv.states.undo",
    "load": "litkv.checkpoints.runtime",
    "register_kv_cache": "litkv.kvcache",
    "restore": "litkv.states.state",
    "snapshot": "litkv.states.state",
    "truncate": "litkv.states.undo",
}

try:
    __version__ = version("litkv")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "BlockStore",
    "CacheState",
    "Config",
    "GPT",
    "KVCache",
    "KVCacheConfig",
    "PrefixCache",
    "Sampling",
    "Segment",
    "chat_prompt",
    "chat_stop_tokens",
    "chunked_loss_backward",
    "forward_chunked",
    "generate",
    "keep_undo_log",
    "load",
    "register_kv_cache",
    "restore",
    "snapshot",
    "truncate",
]


def __getattr__(name: str) -> object:
    """The public name `name`, imported from its module on first use and kept in the package's namespace."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'litkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
