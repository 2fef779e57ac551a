"""Learned eviction: trainable per-(layer, KV head) gates and their soft training-time attention (the
training recipe, `litkv finetune --learn_eviction true`, is `litkv.finetune.gates`; see docs/learned.md)."""

from litkv.learned.gate import GATES_FILE, EvictionGates, unrotate_keys
from litkv.learned.soft import SoftEviction, soft_eviction

__all__ = ["GATES_FILE", "EvictionGates", "SoftEviction", "soft_eviction", "unrotate_keys"]
