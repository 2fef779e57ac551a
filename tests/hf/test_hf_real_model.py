"""SmolLM2-135M-Instruct (the GGUF `litkv download smollm2-135m-instruct` keeps): transformers loads the file,
litkv converts it; with litkv.hf.Cache and h2o / snapkv / learned (the gates litkv ships, checked against
transformers' load of the weights), the HF model keeps the slots litkv's GPT keeps in every
layer, row and head and gives its logits and greedy tokens. Skipped where the file is absent."""

from __future__ import annotations

import pytest
import torch

from litkv import KVCacheConfig, generate
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.checkpoints.download import MODELS, gguf_file, obtain_checkpoint
from litkv.checkpoints.known import add_shipped_gates
from litkv.kvcache.config import ChunkPlan
from litkv.modeling.runner import run_chunks

transformers = pytest.importorskip("transformers")
hf_mod = pytest.importorskip("litkv.hf")

NAME = "smollm2-135m-instruct"
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years presses "
    "had spread to more than two hundred cities across Europe, and the price of books fell sharply. "
) * 5 + "Question: who combined movable type with a press? Answer:"


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory):
    source = gguf_file(MODELS[NAME], fetch=False)
    if source is None:
        pytest.skip(f"the {NAME} GGUF is not here: run `litkv download {NAME}`")
    out = tmp_path_factory.mktemp("real") / NAME
    obtain_checkpoint(MODELS[NAME], out)
    add_shipped_gates(NAME, out)  # the gates litkv ships, fitted for the weights litkv converts
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32, use_kernels=False
    ).eval()  # use_kernels: 5.25 kernelizes by default (hub kernels, the `kernels` package); 5.3 - 5.21 did not
    return hf, load_model(out).eval(), load_tokenizer(out), out


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["h2o", "snapkv", "learned"])
def test_real_model_keeps_litkv_slots_and_tokens(real, policy: str) -> None:
    """`learned`: the shipped gates, read from the checkpoint directory, accepted for transformers' own load of
    the GGUF (its weights as litkv converts them are the ones the gates were fitted for)."""
    hf, model, tokenizer, checkpoint = real
    gates = checkpoint if policy == "learned" else None
    assert model.eviction_gates is not None  # load_model checked them against the converted weights
    ids = torch.tensor([tokenizer.processor.encode(TEXT).ids])
    assert ids.shape[1] > 4 * 64
    cfg = KVCacheConfig(policy=policy, cache_length=64, chunk_size=32)
    with torch.no_grad():
        with model.kv_caches_attached(cfg, 1) as caches:
            ref = run_chunks(model, ids, torch.arange(ids.shape[1])[None], ChunkPlan.of(cfg))
            ref_slots = [c.positions.clone() for c in caches.policy_caches]
        cache = hf_mod.Cache(hf, cfg, gates=gates)
        out = hf(input_ids=ids, past_key_values=cache).logits
        expected = generate(model, [ids[0]], max_new_tokens=12, kv_cache=cfg)[0]
        fresh = hf_mod.Cache(hf, cfg, gates=gates)
        tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=fresh, max_new_tokens=12,
                             do_sample=False)[0, ids.shape[1] :]  # fmt: skip
    rel = float((out - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-5, rel
    for layer, (a, c) in enumerate(zip(ref_slots, cache.kv_caches, strict=True)):
        assert torch.equal(a, c.positions), f"layer {layer}"
    n = tokens.numel()  # transformers stops at the model's end-of-turn token, litkv's generate here does not
    assert tokens.tolist() == expected[:n].tolist()
    stops = hf.generation_config.eos_token_id
    assert n == 12 or int(tokens[-1]) in (stops if isinstance(stops, list) else [stops])
