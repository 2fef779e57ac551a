"""Store entries proven by their content (issue 47, item 2).

A state-store or block-store file records its key, the number of tokens and the digest of their ids
inside the checksummed metadata; a lookup compares them with the request's. The round's attack: another
conversation's (or document's) state copied under X's key with its label edited was restored and X was
answered from the other context. Here the attacker also recomputes the checksum (the strongest forgery
without a secret): the token ids still differ from the request's, so the entry is refused (one warning),
removed, and the turn answers as recomputed. Reply files: ids that do not decode to the reply's text
are ignored.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers import forge_entry
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_checkpoint import make_tiny_checkpoint

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult
from litkv.serve.engine import message_keys
from litkv.states.block_store import BlockStore
from litkv.states.state import CacheState
from litkv.states.state_store import StateStore

KV = KVCacheConfig(policy="h2o", cache_length=32, chunk_size=8)


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    out = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(out)
    return load_model(out), load_tokenizer(out)


def _store(model: object, directory: Path | None = None, max_bytes: int = 1 << 30) -> ConversationStore:
    return ConversationStore(max_bytes, directory, model=model, kv_cache=KV)  # type: ignore[arg-type]


def _turn(engine: Engine, messages: list[tuple[str, str]]) -> TurnResult:
    result = TurnResult()
    "".join(engine.run(TurnRequest(list(messages), 8, temperature=0.0), result))
    return result


def _first_turn(engine: Engine, text: str) -> tuple[list[tuple[str, str]], str]:
    """One turn; the messages with the reply, and the key of the state stored after it."""
    result = _turn(engine, [("user", text)])
    messages = [("user", text), ("assistant", result.content)]
    return messages, message_keys(engine.root, messages)[-1]


def test_relabelled_state_of_another_conversation_is_refused(
    model_and_tok: tuple, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, tok = model_and_tok
    directory = tmp_path / "states"
    writer = Engine(model, tok, KV, _store(model, directory))
    x_messages, x_key = _first_turn(writer, "The quick brown fox")
    _, y_key = _first_turn(writer, "In the beginning was the word")
    x_file, y_file = directory / f"{x_key}.safetensors", directory / f"{y_key}.safetensors"
    follow = [*x_messages, ("user", "What is the passkey?")]
    x_entry = CacheState.load_entry(x_file)[1]
    memory = Engine(model, tok, KV, _store(model))
    _first_turn(memory, "The quick brown fox")
    continued = _turn(memory, follow)  # X's own state, held in memory

    # the stored entry really is X's: restored from disk after a restart, as from memory
    honest = Engine(model, tok, KV, _store(model, directory))
    assert _turn(honest, follow).reply_ids == continued.reply_ids and honest.store.hits["disk"] == 1

    # Y's state under X's key, its entry relabelled and its checksum recomputed
    forge_entry(y_file, x_file, key=x_key)
    engine = Engine(model, tok, KV, _store(model, directory))
    with caplog.at_level(logging.WARNING):
        result = _turn(engine, follow)
    assert caplog.text.count("taken over other token ids") == 1 and engine.store.hits["disk"] == 0
    # recomputed from X's stored reply ids: the answer X's own state gives
    assert result.reply_ids == continued.reply_ids and result.reused_tokens == 0

    # Y's entry made X's (key and token digest) without the checksum: refused by the checksum
    caplog.clear()
    with safe_open(str(y_file), framework="pt") as f:
        header = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    meta = json.loads(header["litkv"])
    meta["entry"] = x_entry
    save_file(tensors, str(x_file), metadata={"litkv": json.dumps(meta)})
    engine = Engine(model, tok, KV, _store(model, directory))
    with caplog.at_level(logging.WARNING):
        assert _turn(engine, follow).reply_ids == continued.reply_ids
    assert "checksum mismatch" in caplog.text


def _write_signed_note(directory: Path, key: str, note: dict) -> None:
    """A note file as the store writes it (with its mac under the user's secret)."""
    StateStore(1 << 20, directory).put_note(key, note)


def test_forged_reply_ids_that_do_not_give_the_reply_text_are_ignored(
    model_and_tok: tuple, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three valid ids in the reply file (the round's finding: used silently)."""
    model, tok = model_and_tok
    directory = tmp_path / "states"
    writer = Engine(model, tok, KV, _store(model, directory))
    messages, key = _first_turn(writer, "The quick brown fox")
    (directory / f"{key}.safetensors").unlink()  # the state is gone: the turn replays the reply's ids
    follow = [*messages, ("user", "What is the passkey?")]
    stored = json.loads((directory / f"{key}.json").read_text())["note"]["reply_ids"]
    forged = [5, 6, 7]
    assert tok.decode(torch.tensor(forged)) != messages[1][1]
    # written by whoever can write the directory (no mac of the store's key): refused as such
    (directory / f"{key}.json").write_text(json.dumps({"key": key, "note": {"reply_ids": forged}}))
    engine = Engine(model, tok, KV, _store(model, directory))
    with caplog.at_level(logging.WARNING):
        unsigned = _turn(engine, follow)
    assert "carries no mac" in caplog.text and not (directory / f"{key}.json").exists()
    # signed with the store's key (a bug of the writer, not an attack): the decode check still refuses them
    caplog.clear()
    _write_signed_note(directory, key, {"reply_ids": forged})
    engine = Engine(model, tok, KV, _store(model, directory))
    with caplog.at_level(logging.WARNING):
        result = _turn(engine, follow)
    assert "do not give its text" in caplog.text and not (directory / f"{key}.json").exists()
    assert unsigned.reply_ids == result.reply_ids
    # as a store that never had the ids: the reply re-tokenised from its text
    plain = Engine(model, tok, KV, _store(model, max_bytes=0))
    assert result.reply_ids == _turn(plain, follow).reply_ids
    # the true ids are used (no warning): the answer of a replay of what was generated
    caplog.clear()
    _write_signed_note(directory, key, {"reply_ids": stored})
    (directory / f"{key}.safetensors").unlink(missing_ok=True)
    engine = Engine(model, tok, KV, _store(model, directory))
    with caplog.at_level(logging.WARNING):
        replayed = _turn(engine, follow)
    assert "do not give its text" not in caplog.text
    assert stored != plain.text_ids(messages[1][1]) and replayed.prompt_tokens != result.prompt_tokens


def test_block_store_refuses_another_documents_relabelled_piece(
    model_and_tok: tuple, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, _ = model_and_tok
    plan = ChunkPlan.of(KVCacheConfig(policy="dense", cache_length=64, chunk_size=8))
    x = torch.arange(3, 19)
    y = torch.arange(40, 56)
    writer = BlockStore(1 << 30, tmp_path / "blocks")
    expected = writer.get(model, x, plan)
    writer.get(model, y, plan)
    seed = BlockStore.seed(model, model.lm_head.weight.dtype, plan)
    bounds = plan.bounds(x.numel())
    x_keys, y_keys = BlockStore.piece_keys(seed, x, bounds), BlockStore.piece_keys(seed, y, bounds)
    for xk, yk in zip(x_keys, y_keys, strict=True):
        forge_entry(tmp_path / "blocks" / f"{yk}.safetensors", tmp_path / "blocks" / f"{xk}.safetensors", key=xk)
    reader = BlockStore(1 << 30, tmp_path / "blocks")
    with caplog.at_level(logging.WARNING):
        got = reader.get(model, x, plan)
    assert "taken over other token ids" in caplog.text and reader.hits == 0
    for a, b in zip(got.keys, expected.keys, strict=True):
        torch.testing.assert_close(a, b)


def test_entry_records_its_token_ids_inside_the_checksum(model_and_tok: tuple, tmp_path: Path) -> None:
    model, tok = model_and_tok
    directory = tmp_path / "states"
    writer = Engine(model, tok, KV, _store(model, directory))
    _, key = _first_turn(writer, "The quick brown fox")
    path = directory / f"{key}.safetensors"
    state, entry = CacheState.load_entry(path)
    assert isinstance(entry, dict) and entry["key"] == key and len(entry["ids_sha256"]) == 64
    assert entry["tokens"] == int(state.last_pos.max()) + 1
    shutil.copy(path, tmp_path / "copy.safetensors")
    with safe_open(str(path), framework="pt") as f:
        assert "litkv_entry" not in (f.metadata() or {})  # no label outside the checksum
