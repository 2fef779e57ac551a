"""Batch invariance in 16 bits is structural, as in float32 (docs/design.md, "Batch invariance"): each row
of a left-padded batch is cut, evicted and protected as it would be alone. Rounding is not invariant
(matmul kernels round a row differently with the batch's shape), so scores that tie up to 16-bit rounding
may order differently; what must hold exactly, for every policy:

- positional policies (`dense`, `last-recent`): the same held positions per (layer, KV head), and logits
  within `LOGIT_EPS` eps of the row alone's;
- every policy: as many tokens held per (layer, KV head) as alone, the sinks and the recent window held.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from half import HALF_DTYPES, LOGIT_EPS, dtype_id, half_bound, half_pair
from helpers import evicts_alone, max_diff

from litkv import GPT, KVCacheConfig
from litkv.inference.generate import pad_prompts
from litkv.kvcache import get_kv_cache_class, known_policies
from litkv.kvcache.config import ChunkPlan
from litkv.modeling.runner import run_chunks

POLICIES = [n for n in known_policies() if get_kv_cache_class(n).__module__.startswith("litkv.") and evicts_alone(n)]
POSITIONAL = ("dense", "last-recent")
LENGTHS = (9, 30, 45)
SLOTS, RECENT, SINKS = 16, 4, 2


def _config(policy: str) -> KVCacheConfig:
    fields = get_kv_cache_class(policy).Options.__dataclass_fields__
    options = {k: v for k, v in (("sinks", SINKS), ("recent", RECENT)) if k in fields}
    length = max(LENGTHS) if policy == "dense" else SLOTS
    return KVCacheConfig(policy, cache_length=length, chunk_size=7, options=options)


def _held(model: GPT, row: int) -> list[list[list[int]]]:
    return [[sorted(p for p in head.tolist() if p >= 0) for head in c.positions[row]] for c in model.kv_caches]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("policy", POLICIES)
@torch.inference_mode()
def test_row_in_ragged_batch_is_cut_and_evicted_as_alone(policy: str, dtype: torch.dtype) -> None:
    model, _ = half_pair(dtype, seed=5)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in LENGTHS]
    cfg = _config(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qh2o replaces float storage by int4, with a warning
        idx, input_pos = pad_prompts(prompts, torch.device("cpu"))
        with model.kv_caches_attached(cfg, len(prompts)):
            batched = run_chunks(model, idx, input_pos, ChunkPlan.of(cfg))
            held = [_held(model, r) for r in range(len(prompts))]
        for row, prompt in enumerate(prompts):
            with model.kv_caches_attached(cfg, 1):
                alone = run_chunks(model, prompt[None], torch.arange(len(prompt))[None], ChunkPlan.of(cfg))[0]
                alone_held = _held(model, 0)
            n = len(prompt)
            for layer, (heads, alone_heads) in enumerate(zip(held[row], alone_held, strict=True)):
                for head, (got, want) in enumerate(zip(heads, alone_heads, strict=True)):
                    where = f"row {row} layer {layer} head {head}"
                    assert len(got) == len(want) == min(n, cfg.cache_length), where
                    if policy in POSITIONAL:
                        assert got == want, where
                    protected = set(range(min(SINKS, n))) | set(range(max(0, n - RECENT), n))
                    if "sinks" in cfg.options or policy == "dense":
                        assert protected <= set(got), f"{where}: sinks/recent {sorted(protected - set(got))} evicted"
            if policy in POSITIONAL:
                diff, bound = max_diff(batched[row, -n:], alone), half_bound(alone, dtype, LOGIT_EPS)
                assert diff <= bound, f"row {row}: {diff:.3g} > {bound:.3g}"
