"""`learned` and `kvzip` through litkv.hf: an HF model with `litkv.hf.Cache` keeps the slots litkv's GPT keeps in
every layer, row and head, with logits within 1e-5 relative and the same greedy tokens: `learned` with gates read
from the litkv checkpoint directory they were fitted in (continuous, threshold, one-shot per head and across
layers with gates of one scale; gates of the key and of the layer's hidden state), `kvzip` through its
reconstruction pass (`litkv.hf.kvzip_compress`); gates fitted for other weights refused in one line naming both
fingerprints."""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from helpers import random_gates
from hf_pairs import hf_and_litkv
from test_parity import CHUNKS, _check_same, _config
from tiny_checkpoint import train_tiny_tokenizer, write_chatml_tokenizer

from litkv import GPT, KVCacheConfig, generate, restore, snapshot
from litkv.checkpoints.checkpoint import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    load_model,
    load_tokenizer,
    save_gates,
    save_state_dict_atomic,
)
from litkv.checkpoints.convert import convert_hf_checkpoint
from litkv.gates.gate import GATES_FILE, EvictionGates
from litkv.inference.chat_template import ChatTemplate
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_compress
from litkv.kvcache.config import ChunkPlan
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.runner import run_chunks

transformers = pytest.importorskip("transformers")
hf_mod = pytest.importorskip("litkv.hf")

REPEAT = RepeatPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10, 11), overlap=3)
RAGGED = [70, 41, 9]


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, GPT, Path]]:
    """`{"per-head" | "one-scale" | "hidden" | "gemma3" | "gemma3-hidden": (HF model, litkv GPT loaded with the
    gates, checkpoint directory)}`: random gates fitted (as recorded) for the pair's weights, per head (no target)
    or on one scale (`target="kvzip"`), of the key or (`*hidden`) of the layer's attention input; Gemma-3 (a
    sliding and a global layer, RoPE of each) with gates of one scale."""
    tmp = tmp_path_factory.mktemp("gates")
    out, pairs = {}, {family: hf_and_litkv(family, tmp) for family in ("llama", "gemma3")}
    for kind, family, target in (
        ("per-head", "llama", None),
        ("one-scale", "llama", "kvzip"),
        ("hidden", "llama", "kvzip"),
        ("gemma3", "gemma3", "kvzip"),
        ("gemma3-hidden", "gemma3", "kvzip"),
    ):
        hf, model = pairs[family]
        directory = tmp / kind
        if family == "llama":
            shutil.copytree(tmp / "llama-litkv", directory)
        else:  # no converter without a preset name: the GPT's own weights and config written as `litkv convert` does
            directory.mkdir()
            save_state_dict_atomic(directory / SAFETENSORS_FILE, model.state_dict())
            (directory / CONFIG_FILE).write_text(yaml.dump(asdict(model.config)))
        g = random_gates(model.config, seed=3, window=4, sinks=2, gate_input="hidden" if "hidden" in kind else "key")
        weights = model_fingerprint(model)["weights"]
        gates = EvictionGates(g.weight, g.bias, g.window, g.sinks, weights, target, input=g.input)
        save_gates(gates, directory / GATES_FILE)
        out[kind] = (hf, load_model(directory).eval(), directory)
    return out


def _pairs(gated, kind: str) -> dict[str, tuple[torch.nn.Module, GPT]]:
    hf, model, _ = gated[kind]
    return {"gemma3" if kind.startswith("gemma3") else "llama": (hf, model)}


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk{c[0]}-prefill{c[1]}")
@pytest.mark.parametrize("storage", ["float", "int8"])
def test_learned_continuous(gated, storage: str, chunk) -> None:
    _check_same("llama", _pairs(gated, "per-head"), _config("learned", storage, chunk), [70, 70],
                gates=gated["per-head"][2])  # fmt: skip


def test_learned_threshold_ragged(gated) -> None:
    cfg = KVCacheConfig(policy="learned", cache_length=32, chunk_size=8, options={"threshold": 0.0})
    _check_same("llama", _pairs(gated, "per-head"), cfg, RAGGED, gates=gated["per-head"][2])


@pytest.mark.parametrize("kind", ["per-head", "one-scale"])
def test_learned_one_shot_ragged(gated, kind: str) -> None:
    """Gates of one scale rank across layers (the layers keep different counts), per-head gates within a layer."""
    cfg = _config("learned", "float", (8, None), one_shot=True)
    _check_same("llama", _pairs(gated, kind), cfg, RAGGED, gates=gated[kind][2])
    hf, _, directory = gated[kind]
    cache = hf_mod.Cache(hf, cfg, gates=directory)
    with torch.no_grad():
        hf(input_ids=torch.randint(3, 300, (1, 70), generator=torch.Generator().manual_seed(4)), past_key_values=cache)
        cache.end_prefill()
    assert all(c.policy.compresses_across_layers() == (kind == "one-scale") for c in cache.kv_caches)
    kept = [int((c.positions >= 0).sum()) for c in cache.kv_caches]
    assert sum(kept) == 24 * 2 * 2 and (kind == "per-head") == (len(set(kept)) == 1), kept


@pytest.mark.parametrize("one_shot", [False, True], ids=["continuous", "one-shot"])
def test_learned_gemma3_ragged(gated, one_shot: bool) -> None:
    """Gemma-3's sliding and global layers (each its RoPE table, the gates' keys rotated back by it)."""
    hf, model, directory = gated["gemma3"]
    cfg = _config("learned", "float", (8, None), one_shot=one_shot)
    _check_same("gemma3", {"gemma3": (hf, model)}, cfg, RAGGED, gates=directory)


def test_learned_greedy_tokens_equal_litkv_generate(gated) -> None:
    hf, model, directory = gated["per-head"]
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 300, (n,), generator=gen) for n in RAGGED]
    cfg = KVCacheConfig(policy="learned", cache_length=32, chunk_size=8)
    with torch.no_grad():
        expected = generate(model, prompts, max_new_tokens=16, kv_cache=cfg)
        ids = torch.zeros(3, 70, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, 70 - p.numel() :], mask[row, 70 - p.numel() :] = p, 1
        out = hf.generate(ids, attention_mask=mask, past_key_values=hf_mod.Cache(hf, cfg, gates=directory),
                          max_new_tokens=16, do_sample=False, pad_token_id=0)[:, 70:]  # fmt: skip
    assert out.tolist() == [t.tolist() for t in expected]


def test_gates_for_other_weights_are_refused(gated, tmp_path) -> None:
    """Gates of one checkpoint with a model of other weights: one line naming both fingerprints."""
    other, _ = hf_and_litkv("llama", tmp_path, seed=9)
    _, model, directory = gated["per-head"]
    cfg = KVCacheConfig(policy="learned", cache_length=32)
    with pytest.raises(ValueError) as err:
        hf_mod.Cache(other, cfg, gates=directory)
    text = str(err.value)
    assert "\n" not in text and model_fingerprint(model)["weights"] in text and "other weights" in text
    found = text.split("litkv holds them are ")[1].split(")")[0]
    assert found == model_fingerprint(load_model(tmp_path / "llama-litkv"))["weights"]
    with pytest.raises(ValueError, match="needs eviction gates") as err:
        hf_mod.Cache(other, cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="no layer's policy reads eviction gates") as err:
        hf_mod.Cache(other, KVCacheConfig(policy="h2o", cache_length=32), gates=directory)
    assert "\n" not in str(err.value) and "'h2o'" in str(err.value)


@pytest.mark.parametrize("chunk", [(8, None), (5, 16)], ids=["chunk8", "chunk5-prefill16"])
@pytest.mark.parametrize("one_shot", [False, True], ids=["continuous", "one-shot"])
@pytest.mark.parametrize("kind", ["hidden", "gemma3-hidden"])
def test_learned_hidden_state_gates_ragged(gated, kind: str, one_shot: bool, chunk) -> None:
    """Gates of the layer's hidden state: the attention modules' inputs reach each layer's cache (in the chunks
    litkv's runner cuts, rows of other lengths), so the slots are litkv's GPT's; one-shot ranks across layers."""
    family = "gemma3" if kind.startswith("gemma3") else "llama"
    cfg = _config("learned", "float", chunk, one_shot=one_shot)
    _check_same(family, _pairs(gated, kind), cfg, RAGGED, gates=gated[kind][2])


def test_learned_hidden_state_gates_greedy_tokens(gated) -> None:
    """`generate` with hidden-state gates (continuous, int8 slots): litkv's GPT's greedy tokens."""
    hf, model, directory = gated["hidden"]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=gen) for n in RAGGED]
    cfg = KVCacheConfig(policy="learned", cache_length=32, chunk_size=8, storage="int8")
    with torch.no_grad():
        expected = generate(model, prompts, max_new_tokens=16, kv_cache=cfg)
        ids = torch.zeros(3, 70, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, 70 - p.numel() :], mask[row, 70 - p.numel() :] = p, 1
        out = hf.generate(ids, attention_mask=mask, past_key_values=hf_mod.Cache(hf, cfg, gates=directory),
                          max_new_tokens=16, do_sample=False, pad_token_id=0)[:, 70:]  # fmt: skip
    assert out.tolist() == [t.tolist() for t in expected]


@pytest.mark.parametrize(
    "options", [{}, {"kvzip_plus": True}, {"layerwise": True, "n_sink": 2}], ids=["kvzip", "kvzip+", "layerwise"]
)
def test_kvzip_one_shot_ragged(gated, options: dict) -> None:
    """The reconstruction pass in chunks of 16 context tokens (several calls, rows of other lengths) scores and
    compresses as litkv's GPT's; then decode steps."""
    cfg = KVCacheConfig(
        policy="kvzip", cache_length=96, chunk_size=8, options={"budget": 24, "chunk_size": 16, **options}
    )
    _check_same("llama", _pairs(gated, "per-head"), cfg, RAGGED, repeat=REPEAT)


def test_kvzip_gemma3_ragged(gated) -> None:
    """Gemma-3: a sliding layer (window 8) and a global one, q/k norms, each layer's RoPE."""
    hf, model, _ = gated["gemma3"]
    cfg = KVCacheConfig(policy="kvzip", cache_length=96, chunk_size=8, options={"budget": 24, "chunk_size": 16})
    _check_same("gemma3", {"gemma3": (hf, model)}, cfg, RAGGED, repeat=REPEAT)


def test_kvzip_compress_once_ask_with_generate(gated) -> None:
    """A context prefilled, compressed by KVzip, snapshotted; each question restored onto it and answered by
    `generate`: the greedy tokens of litkv's GPT on the same compressed context."""
    hf, model, _ = gated["per-head"]
    cfg = KVCacheConfig(policy="kvzip", cache_length=96, chunk_size=16, options={"budget": 20, "chunk_size": 32})
    gen = torch.Generator().manual_seed(8)
    doc = torch.randint(3, 300, (1, 80), generator=gen)
    questions = [torch.randint(3, 300, (1, n), generator=gen) for n in (7, 12)]
    cache = hf_mod.Cache(hf, cfg)
    with torch.inference_mode():  # litkv's kvzip_score makes inference tensors of its scores, written in place later
        hf(input_ids=doc, past_key_values=cache)
        with pytest.raises(ValueError, match="kvzip_compress"):
            cache.end_prefill()
        hf_mod.kvzip_compress(hf, cache, doc, None, REPEAT)
        state = cache.snapshot()
        answers = []
        for q in questions:
            cache.restore(state)
            ids = torch.cat((doc, q), dim=1)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                              do_sample=False, pad_token_id=0)  # fmt: skip
            answers.append(out[0, ids.shape[1] :].tolist())
        restored = hf_mod.Cache(hf, cfg)
        restored.restore(state)
        with model.kv_caches_attached(cfg, 1) as caches:
            run_chunks(model, doc, torch.arange(80)[None], ChunkPlan.of(cfg))
            kvzip_compress(model, [doc[0]], REPEAT)
            for layer, (a, b) in enumerate(zip(caches.policy_caches, restored.kv_caches, strict=True)):
                assert torch.equal(a.positions, b.positions), f"layer {layer}: other slots kept"
            caches.end_prefill()
            lit_state = snapshot(model)
            for q, answer in zip(questions, answers, strict=True):
                restore(model, lit_state)
                n = q.shape[1]
                logits = run_chunks(model, q, torch.arange(80, 80 + n)[None], ChunkPlan.of(cfg))[:, -1]
                model.caches.end_prefill()
                tokens = []
                for step in range(8):
                    tokens.append(int(logits.argmax(dim=-1)))
                    logits = model(torch.tensor([[tokens[-1]]]), torch.tensor([[80 + n + step]]))[:, -1]
                assert answer == tokens
    assert answers[0] != answers[1]


def test_gates_of_a_bfloat16_checkpoint_run_on_the_float32_model(gated, tmp_path) -> None:
    """The checkpoint stores bfloat16 (`litkv convert --dtype`): the float32 transformers model's weights are
    compared as litkv holds them, in bfloat16 (accepted), not as float32."""
    hf, _, _ = gated["per-head"]
    convert_hf_checkpoint(gated["per-head"][2].parent / "llama-hf", tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_model(tmp_path / "bf16")
    g = random_gates(model.config, seed=3)
    weights = model_fingerprint(model)["weights"]
    assert weights != model_fingerprint(gated["per-head"][1])["weights"]
    save_gates(EvictionGates(g.weight, g.bias, g.window, g.sinks, weights), tmp_path / "bf16" / GATES_FILE)
    cache = hf_mod.Cache(hf, KVCacheConfig(policy="learned", cache_length=16), gates=tmp_path / "bf16")
    assert cache.gates is not None and cache.gates.weights == weights


def test_a_state_restores_only_with_its_gates(gated) -> None:
    """A `learned` state carries its gates' fingerprint: another cache on the same model with other gates refuses it."""
    hf, _, directory = gated["per-head"]
    cfg = KVCacheConfig(policy="learned", cache_length=16, options={"across_layers": False})
    cache = hf_mod.Cache(hf, cfg, gates=directory)
    with torch.no_grad():
        hf(input_ids=torch.randint(3, 300, (1, 20)), past_key_values=cache)
    state = cache.snapshot()
    hf_mod.Cache(hf, cfg, gates=directory).restore(state)
    with pytest.raises(ValueError, match="eviction gates differ"):
        hf_mod.Cache(hf, cfg, gates=gated["one-scale"][2]).restore(state)


@pytest.mark.parametrize("template", [True, False], ids=["chat-template", "none"])
def test_repeat_prompt_of_a_transformers_tokenizer_is_litkvs(tmp_path, template: bool) -> None:
    """`litkv.hf.repeat_prompt(tokenizer)` gives the ids `RepeatPrompt.build` gives from litkv's tokenizer."""
    (write_chatml_tokenizer if template else train_tiny_tokenizer)(tmp_path)
    want = RepeatPrompt.build(load_tokenizer(tmp_path), ChatTemplate.load(tmp_path))
    assert hf_mod.repeat_prompt(transformers.AutoTokenizer.from_pretrained(tmp_path)) == want
    assert (want.prefix_length > 0) == template and (len(want.suffix) > 1) == template
