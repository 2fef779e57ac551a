"""`learned` with gates of the layer's hidden state (`EvictionGates.input == "hidden"`, KVzap's input): the logits
equal a float64 oracle `x . w / sqrt(C) + b` and do not depend on the chunk or on how many layers are computed
together; a model's decode steps evicting all layers together are bitwise each layer alone (continuous and
one-shot); the file keeps the input; callers without the hidden state and training through the cache refuse
such gates in one line. (The kept tokens against a float64 top-k: tests/kvcache/test_learned_across_layers.py.)"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import attach_random_gates, random_gates

from litkv import GPT, KVCacheConfig
from litkv.gates.gate import EvictionGates
from litkv.gates.soft import SoftEviction, soft_eviction
from litkv.kvcache.learned import _gate_hidden
from litkv.modeling.fingerprint import gates_fingerprint

N, G, C = 4, 3, 40


def test_logits_equal_a_float64_oracle_and_do_not_depend_on_the_chunk_or_the_layers() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(N, G, C, generator=gen), torch.randn(N, G, generator=gen)
    hidden = torch.randn(2, N, 29, C, generator=gen) * 3  # (B, n layers, T, C)
    logits = _gate_hidden(weight, bias, hidden)
    assert logits.dtype == torch.float32 and logits.shape == (2, N, G, 29)
    want = torch.einsum("bntc,ngc->bngt", hidden.double(), weight.double()) / math.sqrt(C)
    torch.testing.assert_close(logits.double(), want + bias.double()[None, :, :, None], rtol=1e-5, atol=1e-5)
    for layer in range(N):  # one layer alone, one token alone: bitwise the same numbers
        alone = _gate_hidden(weight[layer : layer + 1], bias[layer : layer + 1], hidden[:, layer : layer + 1])
        assert torch.equal(alone[:, 0], logits[:, layer])
        for t in (0, 13, 28):
            one = _gate_hidden(
                weight[layer : layer + 1], bias[layer : layer + 1], hidden[1:, layer : layer + 1, t : t + 1]
            )
            assert torch.equal(one[0, 0, :, 0], logits[1, layer, :, t])


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return attach_random_gates(tiny_model(21), seed=5, gate_input="hidden")


def _run(model: GPT, cfg: KVCacheConfig, together: bool) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Prefill 16 tokens of a left-padded batch of 2 in chunks of 8 (one-shot: then compress), then 20 decode
    steps; the logits of every call and each layer's final state."""
    idx = torch.randint(0, model.config.padded_vocab_size, (2, 36), generator=torch.Generator().manual_seed(12))
    pos = torch.arange(36).expand(2, 36).clone()
    pos[1, :3] = -1
    model.set_kv_caches(model.build_kv_caches(cfg, 2))
    try:
        model.caches.evict_layers_together = together
        logits = [model(idx[:, :8], pos[:, :8]), model(idx[:, 8:16], pos[:, 8:16])]
        model.caches.end_prefill()
        logits += [model(idx[:, i : i + 1], pos[:, i : i + 1]) for i in range(16, 36)]
        return logits, [{k: v.clone() for k, v in c.state_tensors().items()} for c in model.kv_caches]
    finally:
        model.set_kv_caches(None)


@pytest.mark.parametrize(
    "options",
    [{"sinks": 1, "recent": 2}, {"mode": "one-shot", "budget": 6, "sinks": 1, "recent": 2}],
    ids=["continuous", "one-shot"],
)
@torch.inference_mode()
def test_decode_steps_of_all_layers_together_equal_each_layer_alone(model: GPT, options: dict) -> None:
    """Continuous: steps that evict (`select_drop_layers`); one-shot: steps into the slots the compression
    emptied (`prepare_layers`)."""
    length = 40 if options.get("mode") == "one-shot" else 12
    cfg = KVCacheConfig("learned", cache_length=length, chunk_size=8, options=options)
    together, alone = _run(model, cfg, True), _run(model, cfg, False)
    for a, b in zip(together[0], alone[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(together[1], alone[1], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (together[1][0]["slot.logits"] != 0).any()  # the gates scored something


@torch.inference_mode()
def test_a_call_without_the_hidden_state_is_refused(model: GPT) -> None:
    cache = model.build_kv_caches(KVCacheConfig("learned", cache_length=8), 1)
    model.set_kv_caches(cache)
    try:
        layer = model.kv_caches[0]
        c = model.config
        keys = torch.randn(1, c.n_query_groups, 3, c.head_size)
        layer.attend_inputs(keys, keys.clone(), torch.arange(3)[None], None)
        with pytest.raises(ValueError, match="did not hand to the cache"):
            layer.evict_and_store(None)
    finally:
        model.set_kv_caches(None)


def test_the_file_keeps_the_input_and_key_files_keep_their_digest(tmp_path: Path, model: GPT) -> None:
    from litkv.checkpoints.checkpoint import save_gates

    gates = model.eviction_gates
    save_gates(gates, tmp_path / "hidden.safetensors")
    loaded = EvictionGates.load(tmp_path / "hidden.safetensors")
    assert loaded.input == "hidden" and torch.equal(loaded.weight, gates.weight.cpu())
    key = random_gates(model.config, seed=5)
    _, meta = key.file_contents()
    assert "input" not in meta  # a key-input file is written as before hidden inputs existed
    same_tensors = EvictionGates(gates.weight, gates.bias, gates.window, gates.sinks)
    with pytest.raises(ValueError, match=r"n_query_groups, head_size\)"):  # read as a key gate it does not fit
        same_tensors.check_model(4, model.config.n_query_groups, model.config.head_size, model.config.n_embd, "x")
    assert gates_fingerprint(same_tensors) != gates_fingerprint(gates)
    with pytest.raises(ValueError, match="gate input must be one of"):
        EvictionGates(gates.weight, gates.bias, 2, 1, input="value")


def test_training_through_the_cache_refuses_hidden_gates(model: GPT) -> None:
    gates = model.eviction_gates
    with pytest.raises(ValueError, match="not trained through the cache"):
        gates.logits(0, torch.zeros(1, model.config.n_query_groups, 2, model.config.head_size))
    soft = SoftEviction(gates, n_elem=model.config.rope_n_elem)
    with pytest.raises(ValueError, match="soft eviction trains key-input gates"), soft_eviction(model, soft):
        pass


@torch.inference_mode()
def test_a_compressed_caches_slots_carry_each_tokens_oracle_logit(model: GPT) -> None:
    """One-shot: after the compression, decode steps write into empty slots (the direct path, in place): every
    filled slot's logit is the float64 oracle `x . w / sqrt(C) + b` of the token it holds, `x` that token's
    attention input as the attention module received it (a forward pre-hook), and 0 in every empty slot."""
    cfg = KVCacheConfig("learned", cache_length=40, options={"mode": "one-shot", "budget": 6, "sinks": 1, "recent": 2})
    gates = model.eviction_gates
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(model.config.n_layer)}
    hooks = [
        block.attn.register_forward_pre_hook(lambda m, args, i=i: inputs[i].append(args[0].double()))
        for i, block in enumerate(model.transformer.h)
    ]
    idx = torch.randint(0, model.config.padded_vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(30).expand(2, 30).clone()
    pos[1, :3] = -1
    try:
        with model.kv_caches_attached(cfg, 2) as caches:
            model(idx[:, :8], pos[:, :8])
            model(idx[:, 8:16], pos[:, 8:16])
            caches.end_prefill()
            for i in range(16, 30):
                model(idx[:, i : i + 1], pos[:, i : i + 1])
            for layer, cache in enumerate(caches.policy_caches):
                x = torch.cat(inputs[layer], dim=1)  # (B, 30, C): column j holds position pos[:, j]
                want = torch.einsum("btc,gc->bgt", x, gates.weight[layer].double()) / math.sqrt(x.shape[-1])
                want = want + gates.bias[layer].double()[None, :, None]
                held = cache.positions  # (B, G, L)
                expected = torch.where(held >= 0, want.gather(2, held.clamp(min=0)), 0.0)  # position = column
                assert int((held >= 16).sum()) == held.shape[0] * held.shape[1] * 14  # every decode token kept
                torch.testing.assert_close(cache.policy.logits.double(), expected, rtol=1e-5, atol=1e-5)
    finally:
        for hook in hooks:
            hook.remove()
