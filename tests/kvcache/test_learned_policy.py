"""The `learned` policy (litkv/kvcache/learned.py) and the loading of eviction gates (litkv/checkpoints/checkpoint.py).

The oracle is independent of the policy's code path: the pre-RoPE key of every token is recomputed from
the block's input (captured with a block hook) through the layer's own norm and qkv projection, no RoPE
and no `unrotate_keys`; its logit is computed in float64 from the gate tensors. With static logits the
cache after every call must hold exactly the sinks, the recent window and the highest-logit others
(threshold mode: only those at or above the threshold).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch._dynamo
from helpers import attach_random_gates, random_gates
from safetensors.torch import save_file

from litkv import GPT, KVCacheConfig, generate, keep_undo_log, snapshot, truncate
from litkv.checkpoints.checkpoint import load_model, save_gates
from litkv.gates.gate import GATES_FILE, EvictionGates, unrotate_keys
from litkv.kvcache.learned import NO_GATES, LearnedKVCache
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.storage import CacheShape
from litkv.kvcache.storage_kinds import known_storages
from litkv.modeling.fingerprint import model_fingerprint

QUANTISED = [s for s in known_storages() if s != "float"]  # every packed format, built-ins included

B = 2
LENGTH = 16  # cache slots
WINDOW, SINKS = 4, 2  # the recent window (given explicitly; the default is half the cache) and the gates' sinks
PROMPT = 52
CHUNKS = [9, 5, 1, 1, 7, 3, 1, 8, 1, 1, 4, 11]  # direct fill, then concat and staged (one-token) calls
Check = Callable[[int, LearnedKVCache, torch.Tensor, int], None]


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(31, torch.float64, gates=True, gate_seed=32, window=WINDOW, sinks=SINKS)


def _tokens(seed: int, batch: int = B, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _config(storage: str = "float", chunk: int = 8, **options: object) -> KVCacheConfig:
    options = {"recent": WINDOW, **options}
    return KVCacheConfig("learned", cache_length=LENGTH, chunk_size=chunk, storage=storage, quant_group_size=8,
                         options=options)  # fmt: skip


# -- the oracle -----------------------------------------------------------------------------------


def _pre_rope_keys(model: GPT, layer: int, x: torch.Tensor) -> torch.Tensor:
    """`(B, G, T, D)` float64 keys of block input `x` `(B, T, n_embd)`: norm and qkv projection, no RoPE."""
    c = model.config
    block = model.transformer.h[layer]
    kv = c.n_query_groups * c.head_size
    _, k, _ = block.attn.qkv(block.norm_1(x)).split((c.n_head * c.head_size, kv, kv), dim=-1)
    return k.view(x.shape[0], x.shape[1], c.n_query_groups, c.head_size).transpose(1, 2).double()


def _oracle_logits(gates: EvictionGates, layer: int, keys: torch.Tensor) -> torch.Tensor:
    """`(B, G, T)` float64 `k . w / sqrt(D) + b` of pre-RoPE keys `(B, G, T, D)`."""
    weight, bias = gates.weight[layer].double(), gates.bias[layer].double()
    return torch.einsum("bgtd,gd->bgt", keys, weight) / math.sqrt(keys.shape[-1]) + bias[None, :, None]


def _expected(logits: list[float], sinks: int, recent: int, threshold: float | None) -> list[int]:
    """Positions held after `len(logits)` tokens: sinks, the recent window, then the highest logits among
    the others (at or above `threshold`, if any) for the slots left. Equal logits (as float32, the
    policy's precision; one token id at two positions has one pre-RoPE key in layer 0): the newer is kept."""
    seen = len(logits)
    protected = {p for p in range(seen) if p < sinks or p >= seen - recent}
    others = [p for p in range(seen) if p not in protected and (threshold is None or logits[p] >= threshold)]
    rounded = torch.tensor(logits, dtype=torch.float32).tolist()
    others.sort(key=lambda p: (-rounded[p], -p))
    return sorted(protected | set(others[: LENGTH - len(protected)]))


def _drive(model: GPT, cfg: KVCacheConfig, idx: torch.Tensor, check: Check) -> None:
    """Feed `idx` in `CHUNKS`; after every call, `check(layer, cache, oracle logits (B, G, seen), seen)`."""
    gates = model.eviction_gates
    logits: list[list[torch.Tensor]] = [[] for _ in range(model.config.n_layer)]
    inputs: dict[int, torch.Tensor] = {}
    model.set_kv_caches(model.build_kv_caches(cfg, idx.shape[0]))
    try:
        start = 0
        for n in CHUNKS:
            pos = torch.arange(start, start + n).expand(idx.shape[0], n)
            model(idx[:, start : start + n], pos, block_hook=lambda i, x: inputs.__setitem__(i, x))
            start += n
            for layer, cache in enumerate(model.kv_caches):
                logits[layer].append(_oracle_logits(gates, layer, _pre_rope_keys(model, layer, inputs[layer])))
                check(layer, cache, torch.cat(logits[layer], dim=2), start)
    finally:
        model.set_kv_caches(None)


def _check_against_oracle(threshold: float | None, stats: dict[str, int]) -> Check:
    def check(layer: int, cache: LearnedKVCache, oracle: torch.Tensor, seen: int) -> None:
        for row in range(oracle.shape[0]):
            for head in range(oracle.shape[1]):
                where = f"layer {layer}, row {row}, head {head}, after {seen} tokens"
                slots = cache.positions[row, head]
                held = sorted(p for p in slots.tolist() if p >= 0)
                want = _expected(oracle[row, head].tolist(), SINKS, WINDOW, threshold)
                assert held == want, where
                assert set(range(max(0, seen - WINDOW), seen)) <= set(held), f"{where}: recent window emptied"
                filled = slots >= 0
                carried, fresh = cache.policy.logits[row, head][filled].double(), oracle[row, head][slots[filled]]
                torch.testing.assert_close(carried, fresh, rtol=0, atol=1e-5, msg=f"{where}: carried logits")
                stats["short"] += int(seen > LENGTH and len(held) < LENGTH)
                stats["full"] += int(len(held) == LENGTH)

    return check


# -- (a), (b), (f): the kept sets and the carried logits against the oracle -------------------------


@pytest.mark.parametrize("storage", known_storages())
@torch.inference_mode()
def test_kept_sets_and_carried_logits_equal_a_float64_oracle(model: GPT, storage: str) -> None:
    """After every call (fill, prefill chunks, one-token steps), per (layer, row, KV head): held positions
    == sinks + recent window + highest-logit others, and each slot's logit == the oracle's for its token.
    With quantised storage the logits are those of the un-quantised keys (the oracle's)."""
    stats = {"short": 0, "full": 0}
    _drive(model, _config(storage), _tokens(1), _check_against_oracle(None, stats))
    assert stats["short"] == 0 and stats["full"] > 0


@pytest.mark.parametrize("storage", QUANTISED)
@torch.inference_mode()
def test_quantised_storage_logits_come_from_the_new_keys_not_the_stored_ones(model: GPT, storage: str) -> None:
    """Control for the test above: logits recomputed from the stored (dequantised) keys differ from the
    carried ones, by more than the oracle tolerance; the carried ones match the un-quantised oracle."""
    model.set_kv_caches(model.build_kv_caches(_config(storage), B))
    try:
        idx = _tokens(2)
        for s in range(0, 40, 8):
            model(idx[:, s : s + 8], torch.arange(s, s + 8).expand(B, 8))
        cache = model.kv_caches[0]
        keys, _ = cache.storage.read()  # (B, G, L, D) after RoPE, dequantised
        layer_gates = EvictionGates(model.eviction_gates.weight[:1], model.eviction_gates.bias[:1], WINDOW, SINKS)
        n = model.config.rope_n_elem
        heads = []
        for head in range(keys.shape[1]):
            cos, sin = model.rope(cache.positions[:, head])
            heads.append(unrotate_keys(keys[:, head : head + 1], cos, sin, n))
        stored = layer_gates.logits(0, torch.cat(heads, dim=1))
        assert float((stored - cache.policy.logits).abs().max()) > 1e-4
    finally:
        model.set_kv_caches(None)


# -- (e) threshold mode -----------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["float", "int4"])
@torch.inference_mode()
def test_threshold_empties_old_slots_below_it_and_never_the_recent_window(model: GPT, storage: str) -> None:
    """Threshold 0: held == sinks + recent window + the highest of the others whose logit is >= 0 (at
    most `cache_length` in all); the cache holds fewer tokens than slots at some calls and is full at others."""
    stats = {"short": 0, "full": 0}
    _drive(model, _config(storage, threshold=0.0), _tokens(3), _check_against_oracle(0.0, stats))
    assert stats["short"] > 0 and stats["full"] > 0, stats


@torch.inference_mode()
def test_threshold_rows_of_a_ragged_batch_equal_the_rows_alone(model: GPT) -> None:
    cfg = _config(chunk=7, threshold=0.0)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (9, 30, 47)]
    held: list[list] = []

    def keep(_: torch.Tensor) -> None:
        held[:] = [[c.positions[r].tolist() for c in model.kv_caches] for r in range(len(model.kv_caches[0].positions))]

    batched = generate(model, prompts, 8, cfg, on_tokens=keep)
    batched_held = [[[sorted(p for p in h if p >= 0) for h in layer] for layer in row] for row in held]
    for row, prompt in enumerate(prompts):
        alone = generate(model, [prompt], 8, cfg, on_tokens=keep)[0]
        assert torch.equal(batched[row], alone), f"row {row}"
        assert batched_held[row] == [[sorted(p for p in h if p >= 0) for h in layer] for layer in held[0]]


@torch.no_grad()
def test_threshold_truncate_equals_never_having_made_the_calls(model: GPT) -> None:
    """The undo log of a threshold cache records the slots it empties as well as those it overwrites."""
    cfg = _config(threshold=0.0)
    idx = _tokens(5)
    calls = [(0, 12), (12, 20), (20, 27), (27, 28), (28, 29), (29, 36)]
    model.set_kv_caches(model.build_kv_caches(cfg, B))
    try:
        keep_undo_log(model, 8)
        for s, e in calls:
            model(idx[:, s:e], torch.arange(s, e).expand(B, e - s))
        assert any(bool((c.positions < 0).any()) for c in model.kv_caches)  # the threshold emptied slots
        truncate(model, 16)  # the last four calls
        rolled = snapshot(model)
        model.set_kv_caches(model.build_kv_caches(cfg, B))
        for s, e in calls[:2]:
            model(idx[:, s:e], torch.arange(s, e).expand(B, e - s))
        fresh = snapshot(model)
    finally:
        model.set_kv_caches(None)
    for got, want in zip(rolled.layers, fresh.layers, strict=True):
        g, w = got.full_tensors(), want.full_tensors()
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)


@pytest.mark.slow
def test_threshold_compiled_decode_gives_eager_tokens(tiny_model: Callable[..., GPT]) -> None:
    from torch._dynamo.utils import counters

    gpt = tiny_model(3, overrides={"block_size": 512}, gates=True, window=4)
    cfg = KVCacheConfig("learned", cache_length=32, chunk_size=16, options={"threshold": 0.0})
    prompts = [_tokens(6, 1, 45)[0], _tokens(7, 1, 70)[0]]
    eager = generate(gpt, prompts, 60, cfg)
    torch._dynamo.reset()
    counters.clear()
    try:
        gpt.compiled_decode_step(backend="eager")
        compiled = generate(gpt, prompts, 60, cfg, compile=True)
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


# -- (c) gates saved and loaded with the checkpoint ----------------------------------------------------


def test_gates_saved_next_to_the_weights_load_with_the_model_and_give_the_same_tokens(ckpt: Path, tmp_path: Path):
    model = load_model(ckpt)
    assert model.eviction_gates is None
    gates = random_gates(model.config, seed=8, window=3, sinks=1)
    gates.weights = model_fingerprint(model)["weights"]
    model.eviction_gates = gates
    cfg = KVCacheConfig("learned", cache_length=16, chunk_size=5)
    prompts = [torch.arange(7, 60) % 300, torch.arange(100, 130)]
    before = generate(model, prompts, 12, cfg)
    directory = tmp_path / "with_gates"
    directory.mkdir()
    for f in ckpt.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    save_gates(gates, directory / GATES_FILE)
    loaded = load_model(directory)
    got = loaded.eviction_gates
    assert got is not None and (got.window, got.sinks) == (3, 1)
    assert torch.equal(got.weight, gates.weight) and torch.equal(got.bias, gates.bias)
    after = generate(loaded, prompts, 12, cfg)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    loaded.eviction_gates = random_gates(model.config, seed=9, window=3, sinks=1)
    other = generate(loaded, prompts, 12, cfg)
    assert any(not torch.equal(a, b) for a, b in zip(before, other, strict=True))  # the gates do matter


# -- (d) errors -----------------------------------------------------------------------------------------


def _with_gates_file(ckpt: Path, tmp_path: Path, write: Callable[[Path], None]) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for f in ckpt.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    write(directory / GATES_FILE)
    return directory


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: p.write_bytes(b"\x00\x01 not safetensors at all"), "not a readable safetensors file"),
        (lambda p: p.write_bytes(b""), "not a readable safetensors file"),
        (lambda p: save_file({"weight": torch.zeros(2, 2, 8), "other": torch.zeros(1)}, str(p)), "not an eviction"),
        (lambda p: save_gates(EvictionGates.create(3, 2, 8, 4, 2), p), "the gates are for (n_layer, n_query_groups"),
        (lambda p: save_gates(EvictionGates.create(2, 2, 16, 4, 2), p), "the model has (2, 2, 8)"),
    ],
    ids=["garbage", "empty", "other-tensors", "n_layer", "head_size"],
)
def test_bad_gates_file_is_a_value_error_naming_it(ckpt: Path, tmp_path: Path, write, message: str) -> None:  # noqa: ANN001
    directory = _with_gates_file(ckpt, tmp_path, write)
    with pytest.raises(ValueError, match="eviction_gates.safetensors") as info:
        load_model(directory)
    assert message in str(info.value)


def test_gates_without_a_fingerprint_are_refused_never_run(ckpt: Path, tmp_path: Path) -> None:
    """Issue 50, item 3: a gates file whose `weights` fingerprint was deleted is refused in one line (it
    would otherwise run on any weights of the same shape); the same gates with it load."""
    model = load_model(ckpt)
    gates = random_gates(model.config, seed=8, window=3, sinks=1)
    directory = _with_gates_file(ckpt, tmp_path, lambda p: save_gates(gates, p))
    with pytest.raises(ValueError, match="record no fingerprint") as info:
        load_model(directory)
    assert "eviction_gates.safetensors" in str(info.value) and "\n" not in str(info.value)
    gates.weights = model_fingerprint(model)["weights"]
    save_gates(gates, directory / GATES_FILE)
    assert load_model(directory).eviction_gates is not None


def test_learned_without_gates_is_refused_when_the_caches_are_attached(ckpt: Path) -> None:
    model = load_model(ckpt)
    with pytest.raises(ValueError) as info:
        generate(model, [torch.arange(30)], 2, KVCacheConfig("learned", cache_length=16))
    assert str(info.value) == NO_GATES


def _layer_cache(**options: object) -> LearnedKVCache:
    cfg = KVCacheConfig("learned", cache_length=8, chunk_size=4, options=options)
    return SlotMachine(LearnedKVCache, cfg, CacheShape(1, 2, 8, 16, 16), None, torch.float32)


def test_cache_binding_errors(model: GPT) -> None:
    cache = _layer_cache()
    cache.policy.bind_rope(model._rope_table, model.config.rope_n_elem)
    keys = torch.randn(1, 2, 4, 16)
    cache.attend_inputs(keys, keys, torch.arange(4)[None])
    with pytest.raises(RuntimeError, match=r"no eviction gates \(bind_gates\)"):
        cache.evict_and_store(None)
    with pytest.raises(ValueError, match="policy 'learned' needs trained eviction gates"):
        _layer_cache().policy.bind_gates(None, 0)
    with pytest.raises(ValueError, match=r"the gates are for .*\(2, 2, 8\).*the model has \(2, 2, 16\)"):
        _layer_cache().policy.bind_gates(EvictionGates.create(2, 2, 8, 2, 1), 0)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\)"):
        _layer_cache().policy.bind_gates(EvictionGates.create(2, 2, 16, 2, 1), 2)
    clamped = _layer_cache()  # the gates' window 7 and sinks 2 do not fit 8 slots: clamped, the gates still rank
    clamped.policy.bind_gates(EvictionGates.create(2, 2, 16, 7, 2), 0)
    assert (clamped.policy.sinks, clamped.policy.recent) == (2, 3)
    _layer_cache(recent=2).policy.bind_gates(EvictionGates.create(2, 2, 16, 7, 2), 0)  # explicit recent wins
    with pytest.raises(TypeError, match="threshold must be a finite number"):
        _layer_cache(threshold="high")
    with pytest.raises(ValueError, match="sinks \\+ recent must be <= cache_length"):
        _layer_cache(sinks=5, recent=4)


def test_defaults_come_from_the_gates_and_options_override_them() -> None:
    cache = _layer_cache()
    cache.policy.bind_gates(EvictionGates.create(2, 2, 16, 3, 1), 1)
    assert (cache.policy.sinks, cache.policy.recent) == (1, 3)  # the gates' sinks; recent: half of the 7 slots left
    cache = _layer_cache(sinks=0, recent=5)
    cache.policy.bind_gates(EvictionGates.create(2, 2, 16, 3, 1), 1)
    assert (cache.policy.sinks, cache.policy.recent) == (0, 5)


def test_states_and_prefix_seeds_know_the_gates(tiny_model: Callable[..., GPT]) -> None:
    """A `learned` state restores only into a model with the same gates; the prefix store's seed (the
    fingerprint) changes with the gates; a state of another policy ignores them."""
    from litkv import restore
    from litkv.modeling.fingerprint import model_fingerprint

    model = tiny_model(3, config="pythia-14m", gates=True, gate_seed=4)
    prompt = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(5))
    states = {}
    for policy in ("learned", "h2o"):
        with model.kv_caches_attached(KVCacheConfig(policy, cache_length=12), batch_size=1):
            for start in (0, 10):  # 20 tokens through 12 slots: evicting
                model(prompt[:, start : start + 10], input_pos=torch.arange(start, start + 10)[None])
            states[policy] = snapshot(model)
    before = model_fingerprint(model)
    attach_random_gates(model, seed=5)
    assert model_fingerprint(model)["eviction_gates"] != before["eviction_gates"]
    assert model_fingerprint(model)["weights"] == before["weights"]
    with (
        model.kv_caches_attached(KVCacheConfig("learned", cache_length=12), batch_size=1),
        pytest.raises(ValueError, match="other eviction gates"),
    ):
        restore(model, states["learned"])
    with model.kv_caches_attached(KVCacheConfig("h2o", cache_length=12), batch_size=1):
        restore(model, states["h2o"])
