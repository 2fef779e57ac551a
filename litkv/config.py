"""Model configuration (LitGPT's `Config`, reused as is) and, re-exported, the KV cache configuration."""

from __future__ import annotations

from litgpt.config import Config

from litkv.kvcache.config import DEFAULT_CHUNK_SIZE, KVCacheConfig
from litkv.kvcache.storage_kinds import STORAGE_KINDS

__all__ = ["Config", "DEFAULT_CHUNK_SIZE", "KVCacheConfig", "STORAGE_KINDS"]
