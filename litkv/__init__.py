"""litkv: a LitGPT-style GPT whose KV cache is a pluggable abstraction."""

from litkv.block_store import BlockStore
from litkv.blocks import Segment, generate_segments
from litkv.config import Config, KVCacheConfig
from litkv.generate import forward_chunked, generate
from litkv.gradient import chunked_loss_backward
from litkv.kvcache import KVCache, register_kv_cache
from litkv.model import GPT
from litkv.prefix import PrefixCache
from litkv.state import CacheState, restore, snapshot
from litkv.undo import keep_undo_log, truncate

__all__ = [
    "BlockStore",
    "CacheState",
    "GPT",
    "Config",
    "KVCache",
    "KVCacheConfig",
    "PrefixCache",
    "Segment",
    "chunked_loss_backward",
    "forward_chunked",
    "generate",
    "generate_segments",
    "keep_undo_log",
    "register_kv_cache",
    "restore",
    "snapshot",
    "truncate",
]
