"""Gradients through the KV cache for sequences longer than the cache (see `chunked_backward`)."""

from litkv.gradient.chunked_backward import chunked_loss_backward, record_forward
from litkv.gradient.replay import ReplayKVCache, stored_view
from litkv.gradient.tape import LayerTape

__all__ = ["LayerTape", "ReplayKVCache", "chunked_loss_backward", "record_forward", "stored_view"]
