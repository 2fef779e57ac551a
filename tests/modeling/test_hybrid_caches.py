"""The recurrent state as a layer cache of `KVCaches` beside every attention policy, for each hybrid family
(Bamba: Mamba-2 beside attention; Qwen3.5: Gated DeltaNet beside gated attention with an output gate, q/k
norms and partial RoPE): a row in a ragged batch equals the row alone (tokens, attention slots, recurrent
state), with eviction happening on the attention layers during the prefill; `nbytes` counts both kinds; the
recurrent bytes stay flat in the prompt length."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import evicts_alone, tiny_gpt
from hybrid_families import HYBRID_FAMILIES, VOCAB

from litkv import GPT, KVCacheConfig, generate
from litkv.kvcache import SlotMachine, get_kv_cache_class, known_policies
from litkv.kvcache.recurrent import RecurrentCache

POLICIES = [n for n in known_policies() if get_kv_cache_class(n).__module__.startswith("litkv.") and evicts_alone(n)]
CACHE = 24
LENGTHS = (17, 45, 61)  # the two longer ones evict during the prefill
NEW = 6


@pytest.fixture(scope="module", params=list(HYBRID_FAMILIES))
def model(request: pytest.FixtureRequest) -> GPT:
    return tiny_gpt(3, torch.float64, config=HYBRID_FAMILIES[request.param](), gates=True)


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]


def _run(model: GPT, prompts: list[torch.Tensor], cfg: KVCacheConfig) -> tuple[list[list[int]], list, list]:
    """Greedy tokens, per row the attention slots' positions and the recurrent states, at the end."""
    seen: dict[str, list] = {}

    def keep(_: torch.Tensor) -> None:
        caches = model.kv_caches
        seen["held"] = [
            [
                [sorted(p for p in h.tolist() if p >= 0) for h in c.positions[r]]
                for c in caches
                if isinstance(c, SlotMachine)
            ]
            for r in range(len(prompts))
        ]
        seen["states"] = [
            [(c.conv[r].clone(), c.ssm[r].clone()) for c in caches if isinstance(c, RecurrentCache)]
            for r in range(len(prompts))
        ]

    out = generate(model, prompts, NEW, cfg, on_tokens=keep)
    return [t.tolist() for t in out], seen["held"], seen["states"]


@pytest.mark.parametrize("policy", POLICIES)
@torch.inference_mode()
def test_every_policy_on_attention_layers_row_equals_alone(
    model: GPT, prompts: list[torch.Tensor], policy: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        length = max(LENGTHS) + NEW if policy == "dense" else CACHE
        cfg = KVCacheConfig(policy, cache_length=length, chunk_size=7)
        tokens, held, states = _run(model, prompts, cfg)
        assert len(held[0]) == 2 and len(states[0]) == 2  # two attention and two recurrent layers
        for row, prompt in enumerate(prompts):
            alone_tokens, alone_held, alone_states = _run(model, [prompt], cfg)
            assert tokens[row] == alone_tokens[0]
            assert held[row] == alone_held[0]
            for (conv, ssm), (conv_a, ssm_a) in zip(states[row], alone_states[0], strict=True):
                torch.testing.assert_close(conv, conv_a, atol=1e-12, rtol=1e-12)
                torch.testing.assert_close(ssm, ssm_a, atol=1e-12, rtol=1e-12)
            if policy != "dense":
                assert all(len(head) <= CACHE for layer in held[row] for head in layer)
                if len(prompt) > CACHE:
                    assert any(len(head) == CACHE for layer in held[row] for head in layer)  # it did evict


def test_nbytes_counts_both_kinds_and_recurrent_bytes_are_flat(model: GPT) -> None:
    """Every layer's bytes counted once; a recurrent layer's state has the same bytes whatever the prompt
    length, the size its mixer's `state_shape` gives."""
    cfg = KVCacheConfig("h2o", cache_length=CACHE, chunk_size=7)
    sizes = []
    seen: list[tuple[int, list[int], int]] = []

    def keep(_: torch.Tensor) -> None:
        caches = model.caches
        recurrent = [c.nbytes() for c in caches if isinstance(c, RecurrentCache)]
        attention = sum(c.nbytes() for c in caches if isinstance(c, SlotMachine))
        seen.append((caches.nbytes(), recurrent, attention))

    for n in (10, 60):
        generate(model, [torch.randint(0, VOCAB, (n,))], 1, cfg, on_tokens=keep)
        total, recurrent, attention = seen[-1]
        assert total == sum(recurrent) + attention
        sizes.append(recurrent)
    assert sizes[0] == sizes[1]
    c = model.config
    if c.layer_kinds[0] == "mamba2":  # by hand from Bamba's sizes: conv window + SSM state, float64
        expected = (c.mamba_conv_dim * (c.mamba_d_conv - 1) + c.mamba_n_heads * c.mamba_head_dim * c.mamba_d_state) * 8
    else:  # Qwen3.5: conv (56 channels x 3) + the delta-rule state (4 heads of 8 x 6), float64
        expected = (3 * 56 + 4 * 8 * 6) * 8
    assert sizes[0] == [expected] * 2
