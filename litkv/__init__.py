"""litkv: a LitGPT-style GPT whose KV cache is a pluggable abstraction."""

from litkv.gradient import chunked_loss_backward
from litkv.inference.blocks import Segment, generate_segments
from litkv.inference.generate import forward_chunked, generate
from litkv.kvcache import KVCache, register_kv_cache
from litkv.modeling.config import Config, KVCacheConfig
from litkv.modeling.model import GPT
from litkv.states.block_store import BlockStore
from litkv.states.prefix import PrefixCache
from litkv.states.state import CacheState, restore, snapshot
from litkv.states.undo import keep_undo_log, truncate

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
