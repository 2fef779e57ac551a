"""`qh2o`: H2O on quantised storage with scores aware of quantisation error (Q-Hitter).

Q-Hitter (Zhang et al., MLSys 2024) keeps tokens that are both heavy hitters and survive
quantisation well. Here, per (row, KV head) and per call, the score of each candidate is

    score = h2o / max(h2o) - quant_error_weight * error / max(error)

where `h2o` is the H2O score (accumulated attention, divided by query counts with
`normalize_scores`) and `error` the token's quantisation error: the mean squared round-trip error of
its key plus that of its value, measured when it entered the cache. Both terms are normalised the same
way (by their largest value among the row's candidates), so `quant_error_weight` trades a share of
the largest attention score for a share of the largest error. Sinks and the recent window are kept as
in H2O.

Storage: the policy only makes sense on quantised slots. `KVCacheConfig(policy="qh2o")` with the
default `storage="float"` uses `"int4"` (with a warning); pass `storage="int8"` or `"int4"` explicitly
to silence it.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from litkv.config import KVCacheConfig
from litkv.kvcache.h2o import H2OKVCache
from litkv.kvcache.quantized import QuantizedStorage
from litkv.kvcache.storage import CacheShape

__all__ = ["QuantizedH2OKVCache"]


class QuantizedH2OKVCache(H2OKVCache):
    """H2O whose eviction score penalises tokens with a large quantisation error.

    Attributes:
        quant_errors: `(B, G, L)` float32 quantisation error of each slot's token (0 when empty).
    """

    def __init__(
        self, config: KVCacheConfig, shape: CacheShape, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        if config.storage == "float":
            warnings.warn(
                "policy 'qh2o' needs quantised storage; using storage='int4' (pass storage='int8' or "
                "'int4' in KVCacheConfig to choose)",
                stacklevel=2,
            )
            config = dataclasses.replace(config, storage="int4")
        super().__init__(config, shape, device, dtype)
        if not isinstance(self.storage, QuantizedStorage):
            raise TypeError(f"qh2o needs QuantizedStorage, got {type(self.storage).__name__}")
        self.quant_errors = torch.zeros_like(self.attn_sums)
        self._new_errors: torch.Tensor | None = None

    def attend_inputs(
        self, keys: torch.Tensor, values: torch.Tensor, input_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `KVCache.attend_inputs`; also measures the new tokens' quantisation errors `(B, G, T)`."""
        out = super().attend_inputs(keys, values, input_pos)
        errors = self.storage.token_errors(keys, values)
        self._new_errors = errors.masked_fill(input_pos[:, None, :] < 0, 0.0)
        return out

    def score(self, positions: torch.Tensor, attn_weights: torch.Tensor | None) -> torch.Tensor:
        """`(B, G, L + T)` normalised H2O score minus the weighted normalised quantisation error."""
        attention = super().score(positions, attn_weights)  # 0 for empty slots and pads
        errors = torch.cat((self.quant_errors, self._call_new_errors()), dim=2)  # 0 there too
        weight = self.config.quant_error_weight
        return _share_of_max(attention) - weight * _share_of_max(errors)

    def after_write(self, replaced: torch.Tensor, slot_weights: torch.Tensor | None) -> None:
        """Carry the new tokens' errors into their slots, then update the H2O state."""
        errors = self.new_to_slots(self.quant_errors, self._call_new_errors())
        self.quant_errors = errors.masked_fill(self.positions < 0, 0.0)
        self._new_errors = None
        super().after_write(replaced, slot_weights)

    def _call_new_errors(self) -> torch.Tensor:
        if self._new_errors is None:
            raise RuntimeError("quantisation errors of the new tokens are only known during a call")
        return self._new_errors


def _share_of_max(x: torch.Tensor) -> torch.Tensor:
    """`x / max(x)` along the last axis (0 where the maximum is 0). `x`: `(B, G, N)`, non-negative."""
    return x / x.amax(dim=2, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny)
