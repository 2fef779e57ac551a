"""Every registered policy in bfloat16 and float16 keeps what it keeps in float64, wherever its float64
scores are well separated.

The 16-bit model and its float64 twin hold the same (rounded) weights (`half.half_pair`). Both prefill
16 tokens into 16 slots, then one call of 8 tokens makes each layer evict 8 of its 24 candidates. The
float64 run's scores of that decision are read at `ScoreKVCache.lowest` (where every score policy's
choice is made), with the sinks and the recent window protected as the policy protects them. A
candidate is well separated when its float64 score is more than `MARGIN * eps(dtype) * max|score|`
away from the cut (the mean of the last dropped and the first kept score): the 16-bit run must keep
every well-separated kept candidate and drop every well-separated dropped one, and at least half of the
candidates must be well separated (the check is not empty). Policies without scores (`dense`,
`last-recent`: positions only) must keep exactly the float64 set.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from half import HALF_DTYPES, dtype_id, half_pair
from helpers import evicts_alone

from litkv import GPT, KVCacheConfig
from litkv.kvcache import get_kv_cache_class, known_policies
from litkv.kvcache.score import ScoreKVCache

POLICIES = [n for n in known_policies() if get_kv_cache_class(n).__module__.startswith("litkv.") and evicts_alone(n)]
#: Multiples of eps(dtype) * max|score| within which a float64 score counts as tied with the cut.
MARGIN = 4.0
PREFILL, CALL, SLOTS, ROWS = 16, 8, 16, 2


@pytest.fixture(scope="module", params=HALF_DTYPES, ids=dtype_id)
def pair(request: pytest.FixtureRequest) -> tuple[GPT, GPT, torch.dtype]:
    return (*half_pair(request.param), request.param)


def _run(model: GPT, policy: str, spy: list) -> list[torch.Tensor]:
    """Prefill, then one evicting call; returns each layer's `(B, G, L)` positions. `spy` receives
    `(cache, protected scores, positions, k)` of every `ScoreKVCache.lowest` call."""
    idx = torch.randint(0, 128, (ROWS, PREFILL + CALL), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(PREFILL + CALL).expand(ROWS, -1)
    length = PREFILL + CALL if policy == "dense" else SLOTS
    cfg = KVCacheConfig(policy, cache_length=length, chunk_size=CALL, prefill_length=PREFILL)
    original = ScoreKVCache.lowest

    def lowest(self: ScoreKVCache, scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
        protected = self._protected(positions)
        kept = scores if protected is None else scores.masked_fill(protected, float("inf"))
        spy.append((self, kept.double(), positions.clone(), k))
        return original(self, scores, positions, k)

    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # qh2o replaces float storage by int4, with a warning
        ScoreKVCache.lowest = lowest  # type: ignore[method-assign]
        try:
            with model.kv_caches_attached(cfg, ROWS) as caches:
                model(idx[:, :PREFILL], pos[:, :PREFILL])
                model(idx[:, PREFILL:], pos[:, PREFILL:])
                return [c.positions.clone() for c in caches]
        finally:
            ScoreKVCache.lowest = original  # type: ignore[method-assign]


def _held(positions: torch.Tensor) -> list[list[set[int]]]:
    return [[{p for p in head.tolist() if p >= 0} for head in row] for row in positions]


def _check_separated(held: list[list[set[int]]], decision: tuple, dtype: torch.dtype, where: str) -> tuple[int, int]:
    """Assert the well-separated part of the float64 `decision`; returns (separated, all) candidate counts."""
    _, scores, positions, k = decision
    separated = total = 0
    for b in range(scores.shape[0]):
        for g in range(scores.shape[1]):
            s, p = scores[b, g], positions[b, g]
            real = p >= 0
            s, p = s[real], p[real]
            order = torch.sort(s).values  # the cut lies between the k-th and (k+1)-th lowest
            cut = (order[k - 1] + order[k]) / 2 if torch.isfinite(order[k]) else order[k - 1]
            finite = s[torch.isfinite(s)]
            margin = MARGIN * torch.finfo(dtype).eps * float(finite.abs().max())
            for score, position in zip(s.tolist(), p.tolist(), strict=True):
                total += 1
                if abs(score - cut) <= margin:
                    continue
                separated += 1
                kept = score > cut
                assert (position in held[b][g]) == kept, (
                    f"{where} row {b} head {g}: position {position} (float64 score {score:.4g}, cut {cut:.4g}, "
                    f"margin {margin:.3g}) {'dropped' if kept else 'kept'} in {dtype_id(dtype)}"
                )
    return separated, total


@pytest.mark.parametrize("policy", POLICIES)
def test_kept_set_equals_float64_where_scores_are_well_separated(
    pair: tuple[GPT, GPT, torch.dtype], policy: str
) -> None:
    model, model64, dtype = pair
    half_spy: list = []
    held = _run(model, policy, half_spy)
    spy: list = []
    held64 = _run(model64, policy, spy)
    if not issubclass(get_kv_cache_class(policy), ScoreKVCache):
        assert not spy
        assert [_held(p) for p in held] == [_held(p) for p in held64]
        return
    last = {id(call[0]): call for call in spy}  # each layer's evicting decision is its last
    assert len(last) == len(held) and len({id(c[0]) for c in half_spy}) == len(held)
    separated = total = 0
    for layer, (positions, decision) in enumerate(zip(held, last.values(), strict=True)):
        assert decision[3] == CALL, f"layer {layer}: the last decision dropped {decision[3]}, expected {CALL}"
        s, t = _check_separated(_held(positions), decision, dtype, f"{policy} layer {layer}")
        separated, total = separated + s, total + t
    assert separated >= total / 2, f"only {separated} of {total} candidates are well separated: the check is empty"


#: Largest error of H2O's accumulated attention against float64, in eps(dtype) relative to the largest sum
#: (measured: 0.5; sums accumulated in the model's 16-bit dtype give 16 for bfloat16, 4.4 for float16).
SUMS_EPS = 2.0


def test_h2o_attention_sums_accumulate_in_float32(pair: tuple[GPT, GPT, torch.dtype]) -> None:
    """200 one-token calls into a cache with room for all: each token's accumulated attention (sums of up
    to 200 weights, the largest about 14) stays within `SUMS_EPS` eps of float64's; 16-bit accumulation
    would lose the increments below half a unit of the sum's last place."""
    model, model64, dtype = pair
    n = 200
    idx = torch.randint(0, 128, (ROWS, n), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(n).expand(ROWS, n)

    def sums(m: GPT) -> list[torch.Tensor]:
        cfg = KVCacheConfig("h2o", cache_length=n, chunk_size=1, prefill_length=1)
        with torch.inference_mode(), m.kv_caches_attached(cfg, ROWS) as caches:
            for s in range(n):
                m(idx[:, s : s + 1], pos[:, s : s + 1])
            return [c.state_tensors()["slot.attn_sums"].double() for c in caches]

    for layer, (got, ref) in enumerate(zip(sums(model), sums(model64), strict=True)):
        error = float((got - ref).abs().max() / ref.abs().max())
        assert error <= SUMS_EPS * torch.finfo(dtype).eps, f"layer {layer}: relative error {error:.3g}"
