"""`tova`, `knorm` and `keydiff` against brute-force float64 versions of their rules (kept tokens equal
after every call of a chunked run with a left-padded row, float and int4 storage)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_policies_snapkv_ea import PER_KV, SCALE, BruteForce, _run_against_brute_force


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


CASES = [(1, "float", {}), (7, "float", dict(sinks=2, recent=3)), (7, "int4", dict(recent=0))]


@pytest.mark.parametrize(("chunk", "storage", "options"), CASES)
@pytest.mark.parametrize(
    ("policy", "oracle"),
    [("tova", BruteTOVA), ("knorm", BruteKNorm), ("keydiff", BruteKeyDiff)],
    ids=["tova", "knorm", "keydiff"],
)
def test_matches_brute_force(policy: str, oracle: type[BruteForce], chunk: int, storage: str, options: dict) -> None:
    _run_against_brute_force(policy, oracle, chunk, storage, options, seed=chunk + len(options))
