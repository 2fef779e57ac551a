"""Cache state (litkv.states.state): snapshot/restore, files, forks, merges and roll-back, for every built-in
policy and storage, on CPU in float32.

Exactness is bitwise: a restored (or reloaded) cache continues with the very logits of the run that
never left; `truncate(n)` then the same `n` tokens again gives the logits of the run never truncated.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import evicts_alone

from litkv import GPT, CacheState, KVCacheConfig, keep_undo_log, restore, snapshot, truncate
from litkv.kvcache import KVCache, SlotMachine, SlotState, get_kv_cache_class, known_policies
from litkv.kvcache.h2o import H2OKVCache
from litkv.kvcache.storage_kinds import known_storages

# the built-in policies (other test modules may register examples; a custom policy is tested below)
POLICIES = [n for n in known_policies() if get_kv_cache_class(n).__module__.startswith("litkv.") and evicts_alone(n)]
CUSTOM = "test_state:DeclaredStateKVCache"  # by path: registering it would add it to every test's policy list
STORAGES = tuple(known_storages())  # every registered format, built-ins included
B = 2


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(7, gates=True)


def _tokens(length: int, seed: int, batch: int = B) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _run(model: GPT, tokens: torch.Tensor, start: int, chunks: list[int]) -> torch.Tensor:
    """Feed `tokens` `(B, sum(chunks))` at positions `start...` in calls of `chunks` tokens: logits `(B, T, V)`."""
    out, s = [], 0
    for n in chunks:
        pos = torch.arange(start + s, start + s + n).expand(tokens.shape[0], n)
        out.append(model(tokens[:, s : s + n], pos))
        s += n
    return torch.cat(out, dim=1)


def _config(policy: str, storage: str, cache_length: int = 24) -> KVCacheConfig:
    length = 96 if policy == "dense" else cache_length
    return KVCacheConfig(policy, cache_length=length, chunk_size=8, storage=storage, quant_group_size=8)


def _attach(model: GPT, cfg: KVCacheConfig, batch: int = B) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qh2o replaces float storage by int4, with a warning
        model.set_kv_caches(model.build_kv_caches(cfg, batch))


PREFIX = [8, 8, 8, 8, 3]  # 35 tokens: evicting caches (24 slots) are full and have evicted
CONTINUATION = [8, 1, 1, 1]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("policy", POLICIES)
@torch.inference_mode()
def test_snapshot_restore_and_file_round_trip_are_bitwise(model: GPT, policy: str, storage: str, tmp_path: Path):
    """prefix -> snapshot -> unrelated work -> restore -> continuation == prefix -> continuation, bitwise;
    the same after save/load through a file into a model with no caches attached."""
    prefix, cont, other = _tokens(35, 1), _tokens(11, 2), _tokens(11, 3)
    _attach(model, _config(policy, storage))
    _run(model, prefix, 0, PREFIX)
    state = snapshot(model, device="cpu", token_ids=prefix.tolist())
    expected = _run(model, cont, 35, CONTINUATION)
    _run(model, other, 46, [8, 3])  # the detour
    restore(model, state)
    assert torch.equal(_run(model, cont, 35, CONTINUATION), expected)
    state.save(tmp_path / "s.safetensors")
    model.set_kv_caches(None)
    loaded = CacheState.load(tmp_path / "s.safetensors")
    assert loaded.token_ids == prefix.tolist() and loaded.nbytes() == state.nbytes() > 0
    restore(model, loaded)
    assert torch.equal(_run(model, cont, 35, CONTINUATION), expected)
    model.set_kv_caches(None)


@pytest.mark.parametrize("policy", POLICIES)
@torch.inference_mode()
def test_fork_into_rows_equals_separate_runs(model: GPT, policy: str) -> None:
    """A one-row prefix forked into 3 rows, each continued with its own tokens == 3 runs of one row."""
    prefix, conts = _tokens(35, 4, batch=1), _tokens(9, 5, batch=3)
    cfg = _config(policy, "float")
    _attach(model, cfg, batch=1)
    _run(model, prefix, 0, PREFIX)
    state = snapshot(model)
    separate = []
    for row in range(3):
        restore(model, state)
        separate.append(_run(model, conts[row : row + 1], 35, [8, 1]))
    restore(model, state.select([0, 0, 0]))
    forked = _run(model, conts, 35, [8, 1])
    assert torch.allclose(forked, torch.cat(separate), rtol=0, atol=1e-5)
    assert torch.equal(forked.argmax(-1), torch.cat(separate).argmax(-1))
    model.set_kv_caches(None)


@pytest.mark.parametrize("policy", ["dense", "h2o", "expected-attention", "qh2o"])
@torch.inference_mode()
def test_merge_rows_of_different_lengths(model: GPT, policy: str) -> None:
    """Rows of 13 and 35 tokens from two states, merged, decode as each does alone (positions make it exact
    up to rounding: the shorter row attends over more, masked, slots)."""
    cfg = _config(policy, "float")
    short, long = _tokens(13, 6, batch=1), _tokens(35, 7, batch=1)
    nxt = _tokens(4, 8)
    alone, states = [], []
    for row, (tokens, chunks) in enumerate(((short, [8, 5]), (long, PREFIX))):
        _attach(model, cfg, batch=1)
        _run(model, tokens, 0, chunks)
        states.append(snapshot(model))
        n = tokens.shape[1]
        alone.append(torch.cat([_run(model, nxt[row : row + 1, i : i + 1], n + i, [1]) for i in range(4)], dim=1))
    merged = CacheState.cat(states)
    assert merged.batch_size == 2 and merged.last_pos.tolist() == [12, 34]
    restore(model, merged)
    pos = merged.last_pos + 1
    both = torch.cat([model(nxt[:, i : i + 1], (pos + i)[:, None]) for i in range(4)], dim=1)
    assert torch.allclose(both, torch.cat(alone), rtol=0, atol=1e-4)
    assert torch.equal(both.argmax(-1), torch.cat(alone).argmax(-1))
    model.set_kv_caches(None)


# -- truncate -------------------------------------------------------------------------------------


@torch.inference_mode()
def test_truncate_dense_is_exact_without_a_log(model: GPT) -> None:
    """Dense: any n, even inside a prefill chunk, without an undo log."""
    tokens = _tokens(30, 9)
    _attach(model, _config("dense", "float"))
    expected = _run(model, tokens, 0, [8, 8, 8, 6])
    _attach(model, _config("dense", "float"))
    _run(model, tokens, 0, [8, 8, 8, 6])
    truncate(model, 11)  # back to 19 tokens: inside the third chunk
    assert model.last_pos.tolist() == [18, 18]
    assert torch.equal(_run(model, tokens[:, 19:], 19, [5, 6]), expected[:, 19:])
    model.set_kv_caches(None)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("policy", POLICIES)
@torch.inference_mode()
def test_truncate_then_same_tokens_is_bitwise(model: GPT, policy: str, storage: str) -> None:
    """truncate(n) then the same n tokens again == no truncation (undo log of 6 calls; n = 3 decode steps,
    then n = 11: a chunk of 8 and 3 steps)."""
    prefix, cont = _tokens(35, 10), _tokens(11, 11)
    _attach(model, _config(policy, storage))
    _run(model, prefix, 0, PREFIX)
    keep_undo_log(model, depth=6)
    expected = _run(model, cont, 35, CONTINUATION)
    truncate(model, 3)  # the last three calls
    assert model.last_pos.tolist() == [42, 42]
    assert torch.equal(_run(model, cont[:, 8:], 43, [1, 1, 1]), expected[:, 8:])
    truncate(model, 11)
    assert torch.equal(_run(model, cont, 35, CONTINUATION), expected)
    model.set_kv_caches(None)


@torch.inference_mode()
def test_truncate_errors(model: GPT) -> None:
    _attach(model, _config("h2o", "float"))
    with pytest.raises(ValueError, match="no token yet"):
        truncate(model, 1)
    _run(model, _tokens(35, 12), 0, PREFIX)
    with pytest.raises(ValueError, match="without an undo log"):
        truncate(model, 1)
    log = keep_undo_log(model, depth=3)
    _run(model, _tokens(11, 13), 35, [1, 8, 1, 1])  # four calls, the log keeps three
    assert log.nbytes() > 0 and len(log.entries) == 3
    with pytest.raises(ValueError, match="depth=3"):
        truncate(model, 11)
    with pytest.raises(ValueError, match="inside a call"):
        truncate(model, 5)  # two decode steps and 3 of the chunk of 8
    truncate(model, 10)
    assert model.last_pos.tolist() == [35, 35] and len(log.entries) == 0
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        truncate(model, -1)
    with pytest.raises(ValueError, match="row 0 has seen"):
        truncate(model, 100)
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        keep_undo_log(model, depth=0)
    model.set_kv_caches(None)
    with pytest.raises(ValueError, match="no KV caches attached"):
        truncate(model, 1)


# -- select / cat errors --------------------------------------------------------------------------


@torch.inference_mode()
def test_select_and_cat_errors(model: GPT) -> None:
    _attach(model, _config("h2o", "float"))
    _run(model, _tokens(9, 14), 0, [8, 1])
    state = snapshot(model)
    for rows in ([], [2], [-1], [0.5], "0"):
        with pytest.raises(ValueError, match="rows must be"):
            state.select(rows)  # type: ignore[arg-type]
    assert state.select([1, 0, 1]).batch_size == 3
    _attach(model, _config("last-recent", "float"))
    _run(model, _tokens(9, 14), 0, [8, 1])
    with pytest.raises(ValueError, match="other cache configs"):
        CacheState.cat([state, snapshot(model)])
    with pytest.raises(TypeError, match="CacheState"):
        CacheState.cat([])
    model.set_kv_caches(None)


# -- files ----------------------------------------------------------------------------------------


@pytest.fixture
def state_file(model: GPT, tmp_path: Path) -> Path:
    with torch.inference_mode():
        _attach(model, _config("h2o", "int4"))
        _run(model, _tokens(35, 15), 0, PREFIX)
        path = tmp_path / "state.safetensors"
        snapshot(model, token_ids=[[1, 2], [3]]).save(path)
        model.set_kv_caches(None)
    return path


def _one_line_error(path: Path, model: GPT | None = None) -> str:
    with pytest.raises(ValueError) as info:
        state = CacheState.load(path)
        if model is not None:
            restore(model, state)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_truncated_file_is_a_one_line_error(state_file: Path) -> None:
    data = state_file.read_bytes()
    state_file.write_bytes(data[: len(data) // 2])
    assert "truncated or corrupt" in _one_line_error(state_file)


def test_tampered_tensor_bytes_are_detected(state_file: Path) -> None:
    data = bytearray(state_file.read_bytes())
    data[-5] ^= 0x01  # a byte of the last tensor's data
    state_file.write_bytes(bytes(data))
    assert "checksum mismatch" in _one_line_error(state_file)


def _rewrite_metadata(path: Path, edit) -> None:  # noqa: ANN001
    """Rewrite the safetensors header's litkv metadata with `edit(meta)` (valid safetensors afterwards)."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["litkv"])
    edit(meta)
    header["__metadata__"]["litkv"] = json.dumps(meta, sort_keys=True)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_tampered_metadata_is_detected(state_file: Path) -> None:
    _rewrite_metadata(state_file, lambda meta: meta["layers"][0].update(num_filled=3))
    assert "checksum mismatch" in _one_line_error(state_file)


def test_other_format_version_is_refused(state_file: Path) -> None:
    _rewrite_metadata(state_file, lambda meta: meta.update(version=99))
    assert "format version 99" in _one_line_error(state_file)


def test_version_1_files_are_read_unless_they_hold_int8_codes(model: GPT, tmp_path: Path) -> None:
    """Format version 2 stores int8 codes biased; a version-1 file (checksum intact) still restores
    bitwise, except one with int8 storage, whose bytes now mean other codes: refused in one line."""
    from safetensors.torch import load_file

    from litkv.states.state_file import digest

    for storage in ("int4", "int8"):
        with torch.inference_mode():
            _attach(model, _config("h2o", storage))
            _run(model, _tokens(35, 15), 0, PREFIX)
            path = tmp_path / f"{storage}.safetensors"
            snapshot(model).save(path)
            model.set_kv_caches(None)
        tensors = load_file(str(path))

        def as_version_1(meta: dict, tensors: dict = tensors) -> None:
            del meta["digest"]
            meta["version"] = 1
            meta["digest"] = digest(meta, tensors)

        expected = [{k: t.clone() for k, t in layer.tensors.items()} for layer in CacheState.load(path).layers]
        _rewrite_metadata(path, as_version_1)
        if storage == "int8":
            assert "holds int8 storage" in _one_line_error(path)
            continue
        loaded = CacheState.load(path)
        for layer, want in zip(loaded.layers, expected, strict=True):
            assert layer.tensors.keys() == want.keys()
            assert all(torch.equal(layer.tensors[k], want[k]) for k in want)


def test_not_a_state_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    assert "not a litkv cache state" in _one_line_error(tmp_path / "w.safetensors")
    (tmp_path / "junk").write_bytes(b"\x00" * 3)
    assert "not a readable safetensors file" in _one_line_error(tmp_path / "junk")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CacheState.load(tmp_path / "missing.safetensors")


@torch.inference_mode()
def test_loading_into_another_model_is_refused(state_file: Path, model: GPT, tiny_model: Callable[..., GPT]) -> None:
    other_config = tiny_model(7, overrides={"n_layer": 3})
    assert "another config" in _one_line_error(state_file, other_config)
    other_weights = tiny_model(8)
    assert "other weights" in _one_line_error(state_file, other_weights)
    restore(model, CacheState.load(state_file))  # the right model takes it
    assert model.kv_caches[0].config.storage == "int4" and model.last_pos.tolist() == [34, 34]
    model.set_kv_caches(None)


def test_file_holds_no_pickle(state_file: Path) -> None:
    """The file is safetensors: an 8-byte header length, a JSON header, raw tensor bytes."""
    data = state_file.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["litkv"])
    assert meta["format"] == "litkv-cache-state" and meta["version"] == 2 and meta["token_ids"] == [[1, 2], [3]]
    assert set(meta["fingerprint"]) == {"model_config", "weights", "eviction_gates"}  # the fixture has gates
    assert meta["layers"][0]["config"]["policy"] == "h2o"
    assert b"\x80\x04" not in data[: 8 + n]  # no pickle protocol marker in the header


# -- custom policies ------------------------------------------------------------------------------


class DeclaredStateKVCache(H2OKVCache):
    """H2O with an extra per-slot tensor and a per-row counter, declared: snapshots carry them."""

    slot_state = {**H2OKVCache.slot_state, "age": SlotState()}  # allocated by the base: no constructor
    row_state = ("calls",)

    def score(self, candidates):  # noqa: ANN001, ANN201
        import torch.nn.functional as F

        return super().score(candidates) - 0.01 * F.pad(self.age, (0, candidates.num_new))

    def update_state(self, placement, candidates):  # noqa: ANN001, ANN201
        import torch.nn.functional as F

        b = self.positions.shape[0]
        return {
            **super().update_state(placement, candidates),
            "age": placement.carry(F.pad(self.age + 1, (0, candidates.num_new))),
            "calls": torch.ones(b) if self.calls is None else self.calls + 1,
        }


@torch.inference_mode()
def test_custom_policy_declaring_its_state_gets_exact_snapshots(model: GPT) -> None:
    prefix, cont = _tokens(35, 16), _tokens(11, 17)
    _attach(model, _config(CUSTOM, "float"))
    _run(model, prefix, 0, PREFIX)
    state = snapshot(model)
    assert "slot.age" in state.layers[0].tensors and "row.calls" in state.layers[0].tensors
    expected = _run(model, cont, 35, CONTINUATION)
    restore(model, state)
    assert torch.equal(_run(model, cont, 35, CONTINUATION), expected)
    restore(model, state)
    keep_undo_log(model, depth=8)
    _run(model, cont, 35, CONTINUATION)
    truncate(model, 11)
    assert torch.equal(_run(model, cont, 35, CONTINUATION), expected)
    model.set_kv_caches(None)


class _Undeclared(H2OKVCache):
    def update_state(self, placement, candidates):  # noqa: ANN001, ANN201
        self.extra = 1
        return super().update_state(placement, candidates)


@torch.inference_mode()
def test_undeclared_state_warns(model: GPT) -> None:
    _Undeclared.slot_state = {}
    cfg = _config("h2o", "float")
    caches = [SlotMachine(_Undeclared, cfg, c.shape, None, torch.float32) for c in model.build_kv_caches(cfg, 1)]
    model.set_kv_caches(caches)
    with pytest.warns(UserWarning, match="declares no slot_state"):
        snapshot(model)
    model.set_kv_caches(None)


def test_snapshot_needs_caches(model: GPT) -> None:
    model.set_kv_caches(None)
    with pytest.raises(ValueError, match="no KV caches attached"):
        snapshot(model)
    with pytest.raises(TypeError, match="CacheState"):
        restore(model, "state")  # type: ignore[arg-type]
    assert isinstance(model.kv_caches, list) and KVCache is not None
