"""litkv: a LitGPT-style GPT whose KV cache is a pluggable abstraction."""

from litkv.config import Config, KVCacheConfig
from litkv.generate import forward_chunked, generate
from litkv.gradient import chunked_loss_backward
from litkv.kvcache import KVCache, register_kv_cache
from litkv.model import GPT

__all__ = [
    "GPT",
    "Config",
    "KVCache",
    "KVCacheConfig",
    "chunked_loss_backward",
    "forward_chunked",
    "generate",
    "register_kv_cache",
]
