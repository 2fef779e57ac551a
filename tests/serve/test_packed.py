"""A packed call (`litkv.modeling.packed`): groups of tokens through their own caches in one pass over the
layers, sharing the linear layers' products where the probe (`litkv.serve.rounding.CountProbe`) says the
pack's row count rounds like each group's own: every group's hidden states and caches bitwise those of its
own call; and a pack across rounding classes is not (the test can fail)."""

from __future__ import annotations

import pytest
import torch

from litkv.kvcache.caches import KVCaches
from litkv.modeling.config import KVCacheConfig
from litkv.modeling.model import GPT
from litkv.modeling.packed import Group, packed_forward, packing_refusal, plan_packs
from litkv.modeling.runner import ChunkPlan, run_chunks
from litkv.serve.rounding import CountProbe
from tests.helpers import tiny_gpt


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_gpt(0)


def make_groups(model: GPT, kv: KVCacheConfig, m: int, chunks: list[int]) -> list[Group]:
    """A decode step of `m` rows (each prefilled with 11 tokens of its own) and prompt chunks of the given
    widths, each on a row of its own prefilled with 5 + j tokens; deterministic: two calls give equal groups."""
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.padded_vocab_size

    def caches(rows: int, prefill: int) -> KVCaches:
        c = KVCaches(model.build_kv_caches(kv, rows))
        with model.kv_caches_attached(c):
            idx = torch.randint(vocab, (rows, prefill), generator=gen)
            run_chunks(model, idx, torch.arange(prefill).expand(rows, -1), ChunkPlan(4, 4))
        return c

    groups = [Group(caches(m, 11), torch.randint(vocab, (m, 1), generator=gen), torch.full((m, 1), 11), True)]
    for j, t in enumerate(chunks):
        start = 5 + j
        idx = torch.randint(vocab, (1, t), generator=gen)
        groups.append(Group(caches(1, start), idx, torch.arange(start, start + t)[None]))
    return groups


def alone(model: GPT, group: Group) -> torch.Tensor:
    """The group's own call (a decode step inside `trusted_inputs`, as a server steps)."""
    with model.kv_caches_attached(group.caches):
        if group.trusted:
            with model.trusted_inputs(int(group.input_pos.max()) + 1):
                return model(group.idx, group.input_pos, lm_head=False)
        return model(group.idx, group.input_pos, lm_head=False)


def states(group: Group) -> list[torch.Tensor]:
    return [t.clone() for cache in group.caches.policy_caches for t in cache.state_tensors().values()]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("policy", ["dense", "h2o"])
@pytest.mark.parametrize(("m", "chunks"), [(3, [7, 9]), (6, [8]), (2, [1, 6])])
def test_packed_groups_equal_their_own_calls(model: GPT, policy: str, m: int, chunks: list[int]) -> None:
    """Decode rows and prompt chunks in one packed call, packed as the probe allows: hidden states and cache
    states bitwise those of each group's own call (h2o: 14 slots, its caches evict in the call)."""
    kv = KVCacheConfig(policy=policy, cache_length=32 if policy == "dense" else 14)
    probe = CountProbe(model.transformer.h, 64)
    reference = make_groups(model, kv, m, chunks)
    expected = [alone(model, g) for g in reference]
    groups = make_groups(model, kv, m, chunks)
    packs = plan_packs([g.rows for g in groups], probe.alike)
    got = packed_forward(model, groups, packs)
    for g, (h, want) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(h, want), (g, packs)
        assert equal(states(groups[g]), states(reference[g])), (g, packs)
    if m == 6:  # 6 + 8 rows round like 6 and like 8 on the CPUs the suite runs on: one product for both
        assert probe.alike(14, 6) and probe.alike(14, 8) and packs == [[0, 1]]


@pytest.mark.parametrize("arch", ["pythia", "gemma2", "gemma3"])
def test_packed_groups_of_other_architectures(arch: str) -> None:
    """Parallel residual and a GELU MLP (pythia), a sliding window shorter than the chunks, soft-capping and
    post-norms (gemma2), per-layer RoPE and q/k norms (gemma3): each group bitwise its own call."""
    model = tiny_gpt(0, arch=arch)
    kv = KVCacheConfig(policy="h2o", cache_length=14)
    expected = [alone(model, g) for g in make_groups(model, kv, 12, [14, 13])]
    probe = CountProbe(model.transformer.h, 64)
    groups = make_groups(model, kv, 12, [14, 13])
    packs = plan_packs([g.rows for g in groups], probe.alike)
    assert len(packs) < len(groups)  # some product is shared
    for h, want in zip(packed_forward(model, groups, packs), expected, strict=True):
        assert torch.equal(h, want)


def test_a_pack_across_rounding_classes_is_not_exact(model: GPT) -> None:
    """3 decode rows and chunks of 7 and 9 tokens forced into one product of 19 rows, a count that rounds
    unlike 3 rows here: the decode rows' hidden states differ from their own call's (what the probe prevents)."""
    probe = CountProbe(model.transformer.h, 64)
    if probe.alike(19, 3):
        pytest.skip("19 rows round like 3 on this CPU")
    kv = KVCacheConfig(policy="dense", cache_length=32)
    expected = [alone(model, g) for g in make_groups(model, kv, 3, [7, 9])]
    got = packed_forward(model, make_groups(model, kv, 3, [7, 9]), [[0, 1, 2]])
    assert not torch.equal(got[0], expected[0])


def test_plan_packs_and_refusals(model: GPT) -> None:
    classes = {1: 0, 2: 1, 3: 2, 4: 2, 5: 2}  # counts above 5: class 3

    def alike(n: int, k: int) -> bool:
        return classes.get(n, 3) == classes.get(k, 3)

    assert plan_packs([3, 7, 9], alike) == [[0], [1, 2]]
    assert plan_packs([6, 8, 1], alike) == [[0, 1], [2]]
    assert plan_packs([3, 1, 1], alike) == [[0], [1], [2]]
    assert packing_refusal(model) is None
    gated = tiny_gpt(0, arch="pythia")  # a GPT-NeoX MLP packs too
    assert packing_refusal(gated) is None
    kv = KVCacheConfig(policy="dense", cache_length=32)
    with pytest.raises(ValueError, match="not a partition"):
        packed_forward(model, make_groups(model, kv, 2, [4]), [[0]])


@pytest.mark.slow
def test_real_model_decode_rows_share_a_product_with_chunks(real_smollm2: tuple) -> None:
    """SmolLM2-135M-Instruct, h2o evicting: 16 decode rows and chunks of 64 and 32 tokens, packed as the probe
    allows, each group bitwise its own call; where the probe measures 16, 32, 64 and 112 rows alike (the
    development CPU: the class of 16 and more), all three share one product of 112 rows."""
    model = real_smollm2[1]
    kv = KVCacheConfig(policy="h2o", cache_length=80)
    expected = [alone(model, g) for g in make_groups(model, kv, 16, [64, 32])]
    probe = CountProbe(model.transformer.h, 128)
    groups = make_groups(model, kv, 16, [64, 32])
    packs = plan_packs([g.rows for g in groups], probe.alike)
    for g, (h, want) in enumerate(zip(packed_forward(model, groups, packs), expected, strict=True)):
        assert torch.equal(h, want), (g, packs)
    if all(probe.alike(rows, 112) for rows in (16, 64, 32)):  # measured here (the development CPU: yes)
        assert packs == [[0, 1, 2]]
