"""litkv.hf.Cache beyond parity: memory (slots, not tokens), plain forward loops, compress once and ask many
through litkv's state API, a user's own policy, the attention function's fallback for other caches, and the
one-line refusals (model types, hybrids, `learned` without gates, `kvzip` without its reconstruction pass,
transformers versions)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hf_pairs import hf_and_litkv
from test_parity import _check_same, _config, pairs  # noqa: F401  (the module fixture)

from litkv import GPT, KVCacheConfig, register_kv_cache, restore, snapshot
from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.kvcache import registry
from litkv.kvcache.candidates import Candidates
from litkv.kvcache.config import ChunkPlan
from litkv.kvcache.score import ScoreKVCache
from litkv.modeling.runner import run_chunks

transformers = pytest.importorskip("transformers")
hf_mod = pytest.importorskip("litkv.hf")
from litkv.hf.compat import cache_argument, check_model_type, check_transformers_version  # noqa: E402


class ValueNormKVCache(ScoreKVCache):
    """A user's policy: evicts the candidates whose values have the smallest norm."""

    def score(self, candidates: Candidates) -> torch.Tensor:
        return candidates.values.float().norm(dim=-1)


@pytest.fixture(scope="module")
def pair(pairs) -> tuple[torch.nn.Module, GPT]:  # noqa: F811
    return pairs["llama"]


def test_memory_is_cache_length_slots_after_a_prompt_eight_times_longer(pair) -> None:
    hf, _ = pair
    cache_length, prompt = 32, 256
    ids = torch.randint(3, 300, (2, prompt), generator=torch.Generator().manual_seed(0))
    sizes = []
    for n in (cache_length, prompt):
        cache = hf_mod.Cache(hf, KVCacheConfig(policy="h2o", cache_length=cache_length))
        with torch.no_grad():
            hf(input_ids=ids[:, :n], past_key_values=cache)
        for layer in cache.kv_caches:
            for name, t in layer.state_tensors().items():
                if t.dim() >= 3 and t.shape[:2] == (2, 2):  # (B, G, slots, ...) tensors
                    assert t.shape[2] in (cache_length, cache_length + 1), name  # + the decode step's room
        sizes.append(cache.nbytes())
        assert cache.get_seq_length() == n
    assert sizes[0] == sizes[1]  # flat in the prompt's length
    dynamic = transformers.DynamicCache()
    with torch.no_grad():
        hf.set_attn_implementation("sdpa")
        hf(input_ids=ids, past_key_values=dynamic)
    dense = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    assert dense == 2 * 2 * 2 * prompt * 16 * 4 * 2  # layers x (k, v) x B x G x tokens x hs x bytes
    assert sizes[1] < dense / 4


def test_plain_forward_loop_without_positions(pair) -> None:
    """No attention_mask, no position_ids: transformers takes the positions from the columns seen, which stay
    the tokens seen after eviction; logits as with explicit positions and as litkv's GPT."""
    hf, model = pair
    cfg = KVCacheConfig(policy="tova", cache_length=16, chunk_size=8)
    ids = torch.randint(3, 300, (1, 60), generator=torch.Generator().manual_seed(1))
    cache = hf_mod.Cache(hf, cfg)
    with torch.no_grad(), model.kv_caches_attached(cfg, 1) as caches:
        out = [hf(input_ids=ids[:, :40], past_key_values=cache).logits[:, -1]]
        ref = [run_chunks(model, ids[:, :40], torch.arange(40)[None], ChunkPlan.of(cfg))[:, -1]]
        caches.end_prefill()
        for j in range(40, 60):
            out.append(hf(input_ids=ids[:, j : j + 1], past_key_values=cache).logits[:, -1])
            ref.append(model(ids[:, j : j + 1], torch.tensor([[j]]))[:, -1])
            assert cache.get_seq_length() == j + 1
    for a, b in zip(out, ref, strict=True):
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-5


def test_compress_once_ask_many(pair) -> None:
    """A document prefilled and compressed once (one-shot snapkv), its state snapshotted, restored for each
    question: every answer is litkv's GPT's through `litkv.snapshot` / `litkv.restore`."""
    hf, model = pair
    cfg = KVCacheConfig(policy="snapkv", cache_length=96, chunk_size=16, options={"mode": "one-shot", "budget": 20})
    gen = torch.Generator().manual_seed(2)
    doc = torch.randint(3, 300, (1, 80), generator=gen)
    questions = [torch.randint(3, 300, (1, n), generator=gen) for n in (7, 12, 5)]
    cache = hf_mod.Cache(hf, cfg)
    with torch.no_grad():
        hf(input_ids=doc, past_key_values=cache)
        cache.end_prefill()
        state = cache.snapshot()
        assert state.nbytes() < cache.nbytes()  # the compressed slots only
        answers = []
        for q in questions:
            cache.restore(state)
            assert cache.get_seq_length() == 80
            ids = torch.cat((doc, q), dim=1)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                              do_sample=False, pad_token_id=0)  # fmt: skip
            answers.append(out[0, ids.shape[1] :].tolist())
        with model.kv_caches_attached(cfg, 1) as caches:
            run_chunks(model, doc, torch.arange(80)[None], ChunkPlan.of(cfg))
            caches.end_prefill()
            lit_state = snapshot(model)
            for q, answer in zip(questions, answers, strict=True):
                restore(model, lit_state)
                pos = torch.arange(80, 80 + q.shape[1])[None]
                logits = run_chunks(model, q, pos, ChunkPlan.of(cfg))[:, -1]
                model.caches.end_prefill()
                tokens = []
                for step in range(8):
                    tokens.append(int(logits.argmax(dim=-1)))
                    nxt = torch.tensor([[tokens[-1]]])
                    logits = model(nxt, torch.tensor([[80 + q.shape[1] + step]]))[:, -1]
                assert answer == tokens
    assert len({tuple(a) for a in answers}) > 1


def test_restore_refuses_another_model(pair, tmp_path) -> None:
    hf, _ = pair
    other, _ = hf_and_litkv("llama", tmp_path, seed=9)
    cfg = KVCacheConfig(policy="h2o", cache_length=16)
    cache = hf_mod.Cache(hf, cfg)
    with torch.no_grad():
        hf(input_ids=torch.randint(3, 300, (1, 20)), past_key_values=cache)
    state = cache.snapshot()
    with pytest.raises(ValueError, match="another model"):
        hf_mod.Cache(other, cfg).restore(state)


@pytest.fixture
def users_policy() -> Iterator[str]:
    """`ValueNormKVCache` registered for one test (registered at import, it would join every list of policies
    that the test modules collected after this one build: `known_policies()` parametrizations)."""
    register_kv_cache("test-hf-value-norm")(ValueNormKVCache)
    yield "test-hf-value-norm"
    registry._REGISTRY._entries.pop("test-hf-value-norm")


@pytest.mark.parametrize("policy", ["test-hf-value-norm", "litkv.kvcache.adakv:AdaKVExpectedAttention"])
def test_a_users_own_policy(pairs, policy: str, users_policy: str) -> None:  # noqa: F811
    options = {"mode": "one-shot", "budget": 24} if "adakv" in policy else {}
    cfg = KVCacheConfig(policy=policy, cache_length=32 if not options else 96, chunk_size=8, options=options)
    _check_same("llama", pairs, cfg, [70, 50])


def test_other_caches_get_transformers_sdpa(pair) -> None:
    """A model set to litkv's attention attends with transformers' SDPA when given no cache or its own."""
    hf, _ = pair
    ids = torch.randint(3, 300, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        hf.set_attn_implementation("sdpa")
        ref = hf(input_ids=ids, attention_mask=mask, past_key_values=transformers.DynamicCache()).logits
        hf_mod.Cache(hf, KVCacheConfig(policy="h2o", cache_length=16))
        assert hf.config._attn_implementation == "litkv"
        ours = hf(input_ids=ids, attention_mask=mask, past_key_values=transformers.DynamicCache()).logits
        no_cache = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(ours, ref) and torch.equal(no_cache, ref)


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_refusals_are_one_line(pair) -> None:
    hf, _ = pair
    with pytest.raises(ValueError) as err:
        hf_mod.Cache(hf, KVCacheConfig(policy="learned", cache_length=16))
    assert "learned" in _one_line(err) and "gates=" in str(err.value)
    cache = hf_mod.Cache(hf, KVCacheConfig(policy="kvzip", cache_length=16, options={"budget": 8}))
    with torch.no_grad():
        hf(input_ids=torch.randint(3, 300, (1, 12)), past_key_values=cache)
    with pytest.raises(ValueError) as err:
        cache.end_prefill()  # kvzip compresses by its reconstruction pass only
    assert "kvzip_compress" in _one_line(err)
    h2o = hf_mod.Cache(hf, KVCacheConfig(policy="h2o", cache_length=16))
    with pytest.raises(ValueError) as err:
        hf_mod.kvzip_compress(hf, h2o, torch.ones(1, 4), None, RepeatPrompt((5,), (6,), (7,)))
    assert "holds nothing" in _one_line(err)
    for hybrid in ("bamba", "qwen3_5", "qwen3_next"):
        with pytest.raises(ValueError) as err:
            check_model_type(hybrid)
        assert "hybrid" in _one_line(err) and hybrid in str(err.value)
    neox = transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )  # fmt: skip
    )
    with pytest.raises(ValueError) as err:
        hf_mod.Cache(neox, KVCacheConfig(policy="h2o", cache_length=16))
    assert "'gpt_neox'" in _one_line(err)
    with pytest.raises(ValueError) as err:
        hf_mod.Cache(hf, [KVCacheConfig(policy="h2o", cache_length=16)])
    assert "one KVCacheConfig per layer" in _one_line(err)


@pytest.mark.parametrize("version", ["4.57.1", "5.26.0", "6.0.0"])
def test_transformers_outside_the_range_is_refused(version: str) -> None:
    with pytest.raises(ImportError) as err:
        check_transformers_version(version)
    assert version in _one_line(err)


def test_transformers_installed_is_in_the_range() -> None:
    check_transformers_version(transformers.__version__)
    for tested in ("5.3.0", "5.17.0", "5.25.0"):
        check_transformers_version(tested)


def test_both_update_forms_and_the_cache_argument(pair) -> None:
    """A layer's `update` as transformers up to 5.17 call it (`cache_kwargs`) and as 5.25 does (`kwargs=`); the
    forward's cache keyword read from its signature (`cache` where declared, else `past_key_values`)."""
    hf, _ = pair
    cache = hf_mod.Cache(hf, KVCacheConfig(policy="h2o", cache_length=16))
    k = torch.randn(1, hf.config.num_key_value_heads, 3, hf.config.head_dim)
    assert cache.layers[0].update(k, k, {"cache_position": torch.arange(3)})[0] is k
    assert cache.layers[0].update(k, k, kwargs={"position_ids": torch.arange(3)[None]})[0] is k
    assert cache_argument(hf) in ("cache", "past_key_values")

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    assert cache_argument(Old()) == "past_key_values" and cache_argument(New()) == "cache"
