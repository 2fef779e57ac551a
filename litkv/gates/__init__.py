"""Learned eviction: trainable per-(layer, KV head) gates and their soft training-time attention (the
training recipe, `litkv finetune --learn_eviction true`, is `litkv.finetune.gate_training`; see docs/learned.md)."""

from litkv.gates.gate import GATES_FILE, EvictionGates, unrotate_keys
from litkv.gates.soft import SoftEviction, soft_eviction

__all__ = ["GATES_FILE", "EvictionGates", "SoftEviction", "soft_eviction", "unrotate_keys"]
