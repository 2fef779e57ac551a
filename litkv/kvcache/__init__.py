"""KV cache policies and storage. See `litkv.kvcache.base.KVCache` for the contract."""

from litkv.kvcache.base import CacheSettings, CacheShape, Candidates, KVCache, LayerCache, Placement, SlotState
from litkv.kvcache.dense import DenseKVCache
from litkv.kvcache.last_recent import LastRecentKVCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.options import LastRecentOptions, NoOptions, PolicyOptions, ScoreOptions
from litkv.kvcache.registry import get_kv_cache_class, known_policies, register_kv_cache
from litkv.kvcache.score import ScoreKVCache
from litkv.kvcache.storage import FloatStorage, KVStorage

__all__ = [
    "CacheSettings",
    "CacheShape",
    "Candidates",
    "DenseKVCache",
    "FloatStorage",
    "KVCache",
    "KVStorage",
    "LastRecentKVCache",
    "LastRecentOptions",
    "LayerCache",
    "NoOptions",
    "Placement",
    "PolicyOptions",
    "ScoreKVCache",
    "ScoreOptions",
    "SlotMachine",
    "SlotState",
    "get_kv_cache_class",
    "known_policies",
    "register_kv_cache",
]
