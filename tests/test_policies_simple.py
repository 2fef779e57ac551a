"""`tova`, `knorm` and `keydiff` against brute-force float64 versions of their rules (kept tokens equal
after every call of a chunked run with a left-padded row, float and int4 storage)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_policies_snapkv_ea import HS, N_HEAD, PADS, PER_KV, SCALE, B, BruteForce, G, L

from litkv import KVCacheConfig
from litkv.attention import attend, build_mask
from litkv.kvcache import CacheShape, get_kv_cache_class


class BruteTOVA(BruteForce):
    """This call's softmax weights, summed over its non-pad queries and the group's heads (no memory)."""

    def scores(self, b: int, g: int, held: list[int], new: list[int], call_scores: bool) -> dict[int, float]:
        out = dict.fromkeys(held, 0.0)
        for i in new:
            seen = [j for j in held if self.pos[b, j] <= self.pos[b, i]]
            for h in range(g * PER_KV, (g + 1) * PER_KV):
                logits = torch.stack([self.q[b, h, i] @ self.k[b, g, j] for j in seen]) * SCALE
                for j, w in zip(seen, torch.softmax(logits, dim=0).tolist(), strict=True):
                    out[j] += w
        return out


class BruteKNorm(BruteForce):
    """Minus the key's L2 norm."""

    def scores(self, b: int, g: int, held: list[int], new: list[int], call_scores: bool) -> dict[int, float]:
        return {j: -float(self.k[b, g, j].norm()) for j in held}


class BruteKeyDiff(BruteForce):
    """Minus the cosine similarity of the key to the mean of the held tokens' unit keys."""

    def scores(self, b: int, g: int, held: list[int], new: list[int], call_scores: bool) -> dict[int, float]:
        if not held:
            return {}
        units = {j: self.k[b, g, j] / self.k[b, g, j].norm() for j in held}
        anchor = sum(units.values()) / len(units)
        return {j: -float(F.cosine_similarity(u, anchor, dim=0)) for j, u in units.items()}


def _run(policy: str, oracle_class: type[BruteForce], chunk: int, storage: str, options: dict, seed: int) -> None:
    n = 3 * L + 9
    config = KVCacheConfig(policy, cache_length=L, chunk_size=chunk, prefill_length=5, storage=storage,
                           quant_group_size=8, options=options)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, HS, generator=gen) for h in (N_HEAD, G, G))
    pos = torch.arange(n).expand(B, n).clone()
    pos[1] = torch.arange(n) - PADS
    pos[1, :PADS] = -1
    cache = get_kv_cache_class(policy)(config, CacheShape(B, G, L, HS, HS), None, torch.float32)
    seen_k, seen_v = cache.storage.as_stored(k, v)
    oracle = oracle_class(config, q.double(), seen_k.double(), seen_v.double(), pos)
    evicting = 0
    for start, end in config.chunk_bounds(n):
        ps = pos[:, start:end]
        qs, ks, vs = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        keys, values, k_pos = cache.attend_inputs(ks, vs, ps, qs)
        _, w = attend(qs, keys, values, build_mask(ps, k_pos), SCALE, need_weights=cache.needs_attn_weights,
                      query_valid=ps >= 0)  # fmt: skip
        cache.evict_and_store(w)
        oracle.step(start, end)
        for b in range(B):
            for g in range(G):
                held = sorted(p for p in cache.positions[b, g].tolist() if p >= 0)
                where = f"chunk [{start}, {end}) row {b} head {g}, smallest decision margin {oracle.min_gap:.1e}"
                assert held == oracle.kept(b, g), where
        evicting += int(all(len(oracle.state[b][g]) == L for b in range(B) for g in range(G)))
    assert evicting >= n // (2 * chunk)


CASES = [(1, "float", {}), (7, "float", dict(sinks=2, recent=3)), (7, "int4", dict(recent=0))]


@pytest.mark.parametrize(("chunk", "storage", "options"), CASES)
@pytest.mark.parametrize(
    ("policy", "oracle"),
    [("tova", BruteTOVA), ("knorm", BruteKNorm), ("keydiff", BruteKeyDiff)],
    ids=["tova", "knorm", "keydiff"],
)
def test_matches_brute_force(policy: str, oracle: type[BruteForce], chunk: int, storage: str, options: dict) -> None:
    _run(policy, oracle, chunk, storage, options, seed=chunk + len(options))
