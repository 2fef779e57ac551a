"""Cache states of a hybrid model hold both kinds of layer, bitwise: snapshot / restore / select / cat /
state files, refused across kinds; truncate brings the recurrent state back from the undo log's
checkpoints at call boundaries, or refuses (never a silent incoherence)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bamba_helpers import VOCAB, bamba_config
from helpers import tiny_gpt

from litkv import GPT, KVCacheConfig
from litkv.kvcache.recurrent import RecurrentCache
from litkv.states.state import CacheState, RecurrentLayerState, restore, snapshot
from litkv.states.undo import keep_undo_log, truncate

CFG = KVCacheConfig("h2o", cache_length=16)


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_gpt(11, torch.float64, config=bamba_config())


def _attach(model: GPT, rows: int = 1) -> None:
    model.set_kv_caches(model.build_kv_caches(CFG, rows))


def _call(model: GPT, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """One call of `tokens` `(B, T)` at positions `start + arange(T)`; the last logits `(B, V)`."""
    pos = start[:, None] + torch.arange(tokens.shape[1])
    with torch.no_grad():
        return model(tokens, pos)[:, -1]


def _state_equal(a: CacheState, b: CacheState) -> bool:
    return a.kinds == b.kinds and all(
        set(x.tensors) == set(y.tensors) and all(torch.equal(x.tensors[k], y.tensors[k]) for k in x.tensors)
        for x, y in zip(a.layers, b.layers, strict=True)
    )


def _decode(model: GPT, first: torch.Tensor, start: int, steps: int) -> list[int]:
    out, token = [], first
    for i in range(steps):
        logits = _call(model, token[:, None], torch.tensor([start + i]))
        token = logits.argmax(-1)
        out.append(int(token))
    return out


def test_snapshot_restore_is_bitwise_and_holds_both_kinds(model: GPT, tmp_path: Path) -> None:
    _attach(model)
    prompt = torch.randint(0, VOCAB, (1, 30))  # longer than the cache: h2o evicts
    _call(model, prompt[:, :15], torch.tensor([0]))
    _call(model, prompt[:, 15:], torch.tensor([15]))
    state = snapshot(model)
    assert state.kinds == ["mamba2", "attention", "mamba2", "attention"]
    assert isinstance(state.layers[0], RecurrentLayerState) and state.layers[0].tensors["ssm"].abs().sum() > 0
    first = torch.tensor([5])
    expected = _decode(model, first, 30, 6)
    after = snapshot(model)
    restore(model, state)
    assert _state_equal(snapshot(model), state)
    assert _decode(model, first, 30, 6) == expected
    assert _state_equal(snapshot(model), after)
    state.save(tmp_path / "s.safetensors")
    loaded = CacheState.load(tmp_path / "s.safetensors")
    assert _state_equal(loaded, state)
    model.set_kv_caches(None)
    restore(model, loaded)  # fresh caches of both kinds
    assert isinstance(model.kv_caches[0], RecurrentCache)
    assert _decode(model, first, 30, 6) == expected


def test_select_and_cat_give_each_row_its_own_continuation(model: GPT) -> None:
    prompts = [torch.randint(0, VOCAB, (1, n)) for n in (12, 15)]
    states, expected = [], []
    for p in prompts:
        _attach(model)
        _call(model, p, torch.tensor([0]))
        states.append(snapshot(model))
        expected.append(_decode(model, torch.tensor([3]), p.shape[1], 4))
    merged = CacheState.cat(states)
    assert merged.batch_size == 2 and merged.layers[0].tensors["conv"].shape[0] == 2
    for row in (0, 1):
        picked = merged.select([row])
        assert all(
            torch.equal(picked.layers[i].tensors[k], states[row].layers[i].tensors[k])
            for i in (0, 2)
            for k in ("conv", "ssm")
        )
        restore(model, picked)
        assert _decode(model, torch.tensor([3]), prompts[row].shape[1], 4) == expected[row]


def test_states_never_cross_kinds(model: GPT, tiny_model, tmp_path: Path) -> None:  # noqa: ANN001
    plain = tiny_model(seed=1, dtype=torch.float64)
    plain.set_kv_caches(plain.build_kv_caches(CFG, 1))
    with torch.no_grad():
        plain(torch.randint(0, 96, (1, 5)), torch.arange(5)[None])
    attention_only = snapshot(plain)
    _attach(model)
    _call(model, torch.randint(0, VOCAB, (1, 5)), torch.tensor([0]))
    hybrid = snapshot(model)
    with pytest.raises(ValueError, match=r"layer kinds \['attention', 'attention'\], the model \['mamba2'"):
        restore(model, attention_only)
    hybrid.save(tmp_path / "h.safetensors")
    with pytest.raises(ValueError, match=r"layer kinds \['mamba2', 'attention', 'mamba2', 'attention'\], the model"):
        restore(plain, CacheState.load(tmp_path / "h.safetensors"))
    with pytest.raises(ValueError, match="layer kinds"):
        CacheState.cat([hybrid, attention_only])


def test_truncate_restores_the_recurrent_checkpoint_of_the_call_boundary(model: GPT) -> None:
    _attach(model)
    log = keep_undo_log(model, depth=16)
    _call(model, torch.randint(0, VOCAB, (1, 10)), torch.tensor([0]))
    _call(model, torch.randint(0, VOCAB, (1, 7)), torch.tensor([10]))
    at_boundary = snapshot(model)  # after 17 tokens
    _call(model, torch.randint(0, VOCAB, (1, 9)), torch.tensor([17]))  # h2o evicts from here
    _decode(model, torch.tensor([1]), 26, 3)
    with pytest.raises(ValueError, match="inside a call"):
        truncate(model, 7)  # 29 - 7 = 22: inside the 9-token call
    truncate(model, 12)
    assert _state_equal(snapshot(model), at_boundary)
    assert log.nbytes() > 0
    truncate(model, 7)  # back to the first call's end
    assert int(model.last_pos[0]) == 9


def test_a_refused_call_leaves_the_recurrent_state_alone(model: GPT) -> None:
    _attach(model)
    _call(model, torch.randint(0, VOCAB, (1, 5)), torch.tensor([0]))
    before = snapshot(model)
    with pytest.raises(ValueError, match="at most cache_length=16 new tokens per call"):
        _call(model, torch.randint(0, VOCAB, (1, 17)), torch.tensor([5]))
    assert _state_equal(snapshot(model), before)


def test_truncate_without_undo_log_is_refused_and_changes_nothing(model: GPT) -> None:
    model.set_kv_caches(model.build_kv_caches(KVCacheConfig("dense", cache_length=32), 1))
    _call(model, torch.randint(0, VOCAB, (1, 8)), torch.tensor([0]))
    before = snapshot(model)
    with pytest.raises(ValueError, match="recurrent .Mamba-2. layers' state is restored from checkpoints"):
        truncate(model, 3)
    assert _state_equal(snapshot(model), before)


def test_prefix_store_holds_both_kinds(model: GPT, tmp_path: Path) -> None:
    """Warm (restored prefix states, memory and disk) == cold == each prompt alone."""
    from litkv import PrefixCache, generate

    cfg = KVCacheConfig("h2o", cache_length=16, chunk_size=8)
    shared = torch.randint(0, VOCAB, (20,))
    prompts = [torch.cat((shared, torch.randint(0, VOCAB, (n,)))) for n in (3, 9)]
    alone = [generate(model, [p], 5, cfg)[0].tolist() for p in prompts]
    store = PrefixCache(10**8, directory=tmp_path / "prefix")
    cold = [t.tolist() for t in generate(model, prompts, 5, cfg, prefix_cache=store)]
    warm = [t.tolist() for t in generate(model, prompts, 5, cfg, prefix_cache=store)]
    disk = [t.tolist() for t in generate(model, prompts, 5, cfg, prefix_cache=PrefixCache(10**8, tmp_path / "prefix"))]
    assert cold == warm == disk == alone
    assert store.hits > 0
