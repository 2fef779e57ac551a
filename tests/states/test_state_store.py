"""The one state store (litkv.states.state_store) under the server's conversation store (litkv.serve.store):
it degrades instead of failing a turn, trims its directory, removes dead writers' temporary files, and
restores an entry only when it proves everything it claims (key, tokens, model, caches, reply ids).

Each turn's reply is compared with the reply of a store that never saw the tampered files (the
reference: the conversation recomputed from scratch)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import forge_entry
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_checkpoint import make_tiny_checkpoint
from torch.overrides import TorchFunctionMode

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.core import atomic
from litkv.kvcache.config import KVCacheConfig
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult
from litkv.serve.engine import message_keys
from litkv.states.state import CacheState, restore
from litkv.states.state_file import digest
from litkv.states.state_store import EntryCheck, StateStore

KV = KVCacheConfig(policy="h2o", cache_length=32, chunk_size=8)
TURNS = ["The quick brown fox", "What is the passkey?", "Remember it.", "the lazy dog"]


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    out = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(out)
    return load_model(out), load_tokenizer(out)


def _store(model: object, directory: Path | None = None, max_bytes: int = 1 << 30, **kw: object) -> ConversationStore:
    return ConversationStore(max_bytes, directory, model=model, kv_cache=KV, **kw)  # type: ignore[arg-type]


def converse(engine: Engine, turns: list[str]) -> tuple[list[list[int]], list[tuple[str, str]], list[TurnResult]]:
    """Run `turns` as one conversation, resending the history each time: (reply ids, messages, results)."""
    messages: list[tuple[str, str]] = []
    replies, results = [], []
    for text in turns:
        messages.append(("user", text))
        result = TurnResult()
        "".join(engine.run(TurnRequest(list(messages), 8, temperature=0.0), result))
        messages.append(("assistant", result.content))
        replies.append(result.reply_ids)
        results.append(result)
    return replies, messages, results


def _key_after(engine: Engine, messages: list[tuple[str, str]], n: int) -> str:
    """The store key of the state after the first `n` messages (ending with an assistant reply)."""
    return message_keys(engine.root, messages[:n])[-1]


def _fails_to_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write of a state file or a note fails as `litkv.core.atomic` fails on a full disk (ENOSPC)."""
    import litkv.states.state_file
    import litkv.states.state_store

    def full(path: Path, *args: object) -> None:
        raise atomic.FileWriteError(errno.ENOSPC, f"cannot write {str(path)!r}: No space left on device")

    monkeypatch.setattr(litkv.states.state_file, "write_atomic", full)
    monkeypatch.setattr(litkv.states.state_store, "write_text_atomic", full)


# -- degrades, never fails ------------------------------------------------------------------------


def test_full_disk_turns_succeed_from_memory_with_one_warning(
    model_and_tok: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = model_and_tok
    expected, _, _ = converse(Engine(model, tok, KV, _store(model)), TURNS)
    _fails_to_write(monkeypatch)
    engine = Engine(model, tok, KV, _store(model, tmp_path / "states"))
    with pytest.warns(UserWarning, match="going on in memory only") as record:
        replies, _, results = converse(engine, TURNS)
    assert replies == expected and all(r.stored for r in results)
    assert len([w for w in record if "memory only" in str(w.message)]) == 1
    assert engine.store.hits["memory"] == len(TURNS) - 1  # every later turn restored its state from memory
    assert not list((tmp_path / "states").iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_read_only_directory_turns_succeed_from_memory(model_and_tok: tuple, tmp_path: Path) -> None:
    model, tok = model_and_tok
    expected, _, _ = converse(Engine(model, tok, KV, _store(model)), TURNS[:2])
    directory = tmp_path / "states"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        engine = Engine(model, tok, KV, _store(model, directory))
        with pytest.warns(UserWarning, match="going on in memory only"):
            assert converse(engine, TURNS[:2])[0] == expected
    finally:
        directory.chmod(0o755)


def test_stale_temp_files_of_dead_writers_removed_at_start(model_and_tok: tuple, tmp_path: Path) -> None:
    model, _ = model_and_tok
    directory = tmp_path / "states"
    directory.mkdir()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    stale = directory / f"{atomic.TMP_PREFIX}k.safetensors.{dead}-0123abcd"
    live = directory / f"{atomic.TMP_PREFIX}j.safetensors.{os.getppid()}-0123abcd"
    for path in (stale, live):
        path.write_bytes(b"\0" * 100)
    store = _store(model, directory)
    assert not stale.exists() and live.exists() and store.disk_bytes() == 100


def test_directory_trimmed_to_its_byte_bound(model_and_tok: tuple, tmp_path: Path) -> None:
    model, tok = model_and_tok
    probe = Engine(model, tok, KV, _store(model, tmp_path / "probe"))
    converse(probe, TURNS)
    sizes = sorted(f.stat().st_size for f in (tmp_path / "probe").iterdir())
    bound = sum(sizes[-3:])  # room for about three of the largest files
    engine = Engine(model, tok, KV, _store(model, tmp_path / "states", max_bytes=1 << 30, disk_bytes=bound))
    for i, text in enumerate(TURNS):
        converse(engine, [f"{text} {i}", "and then?"])
        assert engine.store.disk_bytes() <= bound
    assert 0 < len(list((tmp_path / "states").glob("*.safetensors"))) < 2 * len(TURNS)


# -- an entry proves everything it claims ---------------------------------------------------------


def test_another_conversations_state_under_xs_key_is_a_miss(
    model_and_tok: tuple, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Conversation B's state file (valid, same model and cache) copied over conversation X's: after a
    restart, X's next turn does not restore it (a warning; the file removed) and answers as recomputed."""
    model, tok = model_and_tok
    directory = tmp_path / "states"
    x_turns, b_turns = TURNS[:2], ["In the beginning was the word", "was with the fox"]
    writer = Engine(model, tok, KV, _store(model, directory))
    _, x_messages, _ = converse(writer, x_turns[:1])
    _, b_messages, _ = converse(writer, b_turns[:1])
    x_key, b_key = _key_after(writer, x_messages, 2), _key_after(writer, b_messages, 2)
    shutil.copy(directory / f"{b_key}.safetensors", directory / f"{x_key}.safetensors")
    expected, _, _ = converse(Engine(model, tok, KV, _store(model, max_bytes=0)), x_turns)

    engine = Engine(model, tok, KV, _store(model, directory))
    result = TurnResult()
    with caplog.at_level(logging.WARNING):
        "".join(engine.run(TurnRequest([*x_messages, ("user", x_turns[1])], 8, temperature=0.0), result))
    assert "does not prove key" in caplog.text and not (directory / f"{x_key}.safetensors").exists()
    assert engine.store.hits == {"memory": 0, "disk": 0} and result.reused_tokens == 0
    assert result.reply_ids == expected[1]


def _craft_huge_dense_state(model: object, path: Path, key: str) -> None:
    """A valid-looking, correctly checksummed entry under `key`: a dense cache claiming 1,000,000 slots
    per layer, of which 3 are stored (a file of a few kB)."""
    dense = KVCacheConfig(policy="dense", cache_length=32, chunk_size=8)
    model.set_kv_caches(model.build_kv_caches(dense, 1))  # type: ignore[attr-defined]
    model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None])  # type: ignore[operator]
    from litkv.states.state import snapshot

    small = path.parent / "small.safetensors"
    snapshot(model).save(small)  # type: ignore[arg-type]
    with safe_open(str(small), framework="pt") as f:
        meta = json.loads(f.metadata()["litkv"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    meta.pop("digest")
    for layer in meta["layers"]:
        layer["config"]["cache_length"] = layer["shape"]["cache_length"] = 1_000_000
    meta["entry"] = {"key": key, "tokens": 3, "ids_sha256": None}
    meta["digest"] = digest(meta, tensors)
    save_file(tensors, str(path), metadata={"litkv": json.dumps(meta)})
    small.unlink()
    CacheState.load(path)  # the file itself is valid: only what it claims is refused


class _LargestTensor(TorchFunctionMode):
    """Records the largest number of elements of any tensor a torch call returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.largest = max(self.largest, out.numel())
        return out


def test_crafted_state_claiming_a_huge_cache_is_refused_before_allocation(
    model_and_tok: tuple, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 1,000,000-slot dense state (a few kB on disk) under a key of the server: refused from its header
    (a warning naming the claimed cache_length), no tensor of that size made, the turn recomputed."""
    model, tok = model_and_tok
    directory = tmp_path / "states"
    directory.mkdir()
    writer = Engine(model, tok, KV, _store(model))
    _, messages, _ = converse(writer, TURNS[:1])
    key = _key_after(writer, messages, 2)
    _craft_huge_dense_state(model, directory / f"{key}.safetensors", key)
    store = _store(model, directory)
    spy = _LargestTensor()
    with caplog.at_level(logging.WARNING), spy:
        state = store.get(key)
        if state is not None:  # what the engine would do with it
            restore(model, state)
    assert state is None and "cache_length is 1000000, expected 32" in caplog.text
    assert spy.largest < 1_000_000
    request = TurnRequest([*messages, ("user", TURNS[1])], 8, temperature=0.0)
    expected, result = TurnResult(), TurnResult()
    "".join(Engine(model, tok, KV, _store(model, max_bytes=0)).run(request, expected))  # never stored anything
    "".join(Engine(model, tok, KV, store).run(request, result))
    assert result.reply_ids == expected.reply_ids and result.reused_tokens == 0


def test_state_of_other_weights_under_the_right_key_is_a_miss(
    model_and_tok: tuple, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A state taken from the same architecture with one weight changed, with a proof forged to claim
    the server's key: refused from its header (the weights' fingerprint), never restored."""
    import copy

    model, tok = model_and_tok
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight[0, 0] += 1.0
    directory = tmp_path / "states"
    _, messages, _ = converse(Engine(other, tok, KV, _store(other, directory)), TURNS[:1])
    engine = Engine(model, tok, KV, _store(model, directory))
    key, their_key = _key_after(engine, messages, 2), _key_after(Engine(other, tok, KV, _store(other)), messages, 2)
    assert key != their_key  # the key's root is the fingerprint: forge the proof as well
    forge_entry(directory / f"{their_key}.safetensors", directory / f"{key}.safetensors", key=key)
    with caplog.at_level(logging.WARNING):
        assert engine.store.get(key) is None
    assert "taken from another model" in caplog.text


def test_forged_reply_ids_dropped_and_recomputed(
    model_and_tok: tuple, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Stored reply ids outside the vocabulary, or more than the prompt budget, are not fed: a warning,
    and the reply is taken from its text, as by a store that never had them."""
    model, tok = model_and_tok
    directory = tmp_path / "states"
    writer = Engine(model, tok, KV, _store(model, directory))
    _, messages, _ = converse(writer, TURNS[:1])
    key = _key_after(writer, messages, 2)
    (directory / f"{key}.safetensors").unlink()  # the state is gone: the turn replays the reply's ids
    expected = TurnResult()
    plain = Engine(model, tok, KV, _store(model, max_bytes=0))
    "".join(plain.run(TurnRequest([*messages, ("user", TURNS[1])], 8, temperature=0.0), expected))
    vocab = model.config.padded_vocab_size
    for forged in ([vocab + 5], [1] * 20_000):
        StateStore(1 << 20, directory).put_note(key, {"reply_ids": forged})  # signed: the checks of meaning
        store = _store(model, directory, max_prompt_tokens=64)
        with caplog.at_level(logging.WARNING):
            assert store.reply_ids(key) is None
        assert "dropping the stored reply ids" in caplog.text and not (directory / f"{key}.json").exists()
        result = TurnResult()
        engine = Engine(model, tok, KV, _store(model, directory, max_prompt_tokens=64))
        StateStore(1 << 20, directory).put_note(key, {"reply_ids": forged})  # signed: the checks of meaning
        "".join(engine.run(TurnRequest([*messages, ("user", TURNS[1])], 8, temperature=0.0), result))
        assert result.reply_ids == expected.reply_ids and result.prompt_tokens == expected.prompt_tokens


def test_entry_check_of_a_policy_that_cannot_be_built_on_the_meta_device(
    model_and_tok: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`EntryCheck.of` sizes the caches on the meta device; a custom policy whose constructor reads a
    value (impossible there) gets the check of its configs as given, equal to the built caches'."""
    from litkv import register_kv_cache
    from litkv.kvcache import SlotMachine, registry
    from litkv.kvcache.h2o import H2OKVCache

    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())  # the registration is undone after

    class HostReadKVCache(H2OKVCache):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)  # type: ignore[arg-type]
            self.first = int(self.positions.flatten()[0])  # a host read: fails on the meta device

    register_kv_cache("test-host-read")(HostReadKVCache)
    model, _ = model_and_tok
    cfg = KVCacheConfig(policy="test-host-read", cache_length=16)
    check = EntryCheck.of(model, cfg)
    built = model.build_kv_caches(cfg, 1)
    assert all(isinstance(c, SlotMachine) for c in built)
    assert check == EntryCheck.of(model, cfg)
    assert [s["cache_length"] for s in check.shapes] == [c.shape.cache_length for c in built] == [16, 16]
    assert [c["policy"] for c in check.configs] == ["test-host-read"] * 2
