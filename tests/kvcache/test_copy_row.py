"""`KVCaches.copy_row` between caches where one side's policy has row state and the other none yet:
expected-attention's query statistics (sums, so zeros mean unset) are copied with the row, the other rows
get zeros, and the row then continues as in the caches it came from (float64 model, so rounding is not
the question here; the serve tests check bitwise equality)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from litkv import GPT, KVCacheConfig
from litkv.kvcache.caches import KVCaches

CFG = KVCacheConfig("expected-attention", cache_length=24, chunk_size=8)


def _caches(model: GPT, batch: int, cfg: KVCacheConfig = CFG) -> KVCaches:
    """Caches as the server's rows use them (`litkv.serve.batch.RowBatch`): static shapes, every slot attended."""
    caches = KVCaches(model.build_kv_caches(cfg, batch))
    caches.static_shapes = True
    for cache in caches.policy_caches:
        cache.num_filled = cache.cache_length
    caches.last_pos = torch.full((batch,), -1, dtype=torch.long)
    return caches


def _feed(model: GPT, caches: KVCaches, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Feed `ids` `(B, T)` at positions `start..start+T-1` into `caches`; logits of the last token `(B, V)`."""
    model.set_kv_caches(caches)
    pos = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
    return model(ids, pos)[:, -1]


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(3, torch.float64)


def test_a_row_with_statistics_copies_into_caches_that_have_none(model: GPT) -> None:
    gen = torch.Generator().manual_seed(0)
    prompt, steps = torch.randint(0, 128, (1, 40), generator=gen), torch.randint(0, 128, (6,), generator=gen)
    alone = _caches(model, 1)
    with torch.inference_mode():
        for start in range(0, 40, 8):  # evicts from the third chunk
            _feed(model, alone, prompt[:, start : start + 8], start)
        batch = _caches(model, 3)  # no call yet: no statistics
        batch.copy_row(1, alone, 0)
        stats = alone[0].policy.stats
        assert torch.equal(batch[0].policy.stats[0][1], stats[0][0]) and not batch[0].policy.stats[1][0].any()
        for i, token in enumerate(steps.tolist()):
            want = _feed(model, alone, torch.tensor([[token]]), 40 + i)
            got = _feed(model, batch, torch.tensor([[5], [token], [7]]), 40 + i)  # rows 0, 2: fresh
            torch.testing.assert_close(got[1:2], want, rtol=0, atol=1e-12)
        for mine, ref in zip(batch[0].policy.stats, alone[0].policy.stats, strict=True):
            torch.testing.assert_close(mine[1:2], ref, rtol=0, atol=1e-12)
        # and back: a row of the batch into caches without statistics, and one without into caches with
        again = _caches(model, 1)
        again.copy_row(0, batch, 1)
        assert torch.equal(again[0].positions, batch[0].positions[1:2])
        empty = _caches(model, 1)
        batch.copy_row(2, empty, 0)
        assert not any(part[2].any() for part in batch[0].policy.stats) and (batch[0].positions[2] == -1).all()


def test_other_row_state_mismatches_are_still_refused(model: GPT) -> None:
    cfg = KVCacheConfig("tova", cache_length=24, chunk_size=8, options={"mode": "one-shot", "budget": 16})
    alone = _caches(model, 1, cfg)
    with torch.inference_mode():
        _feed(model, alone, torch.randint(0, 128, (1, 8)), 0)
    with pytest.raises(ValueError, match="copy_row: layer 0"):
        _caches(model, 2, cfg).copy_row(0, alone, 0)
