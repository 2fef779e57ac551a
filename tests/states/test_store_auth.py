"""Store entries nobody can forge by writing the directory (issue 61, item 1).

The round's attack, in all three stores: whoever can write a store directory copies one entry's
tensors under another key, pastes that key's whole entry (key, token count, digest of the token ids)
and recomputes the unkeyed checksum. The prefix store then answered A's prompt from B's state, serve's
`--state_dir` X's turn from Y's context, `--block_dir` a question on d0 from d1. Every file now carries
an HMAC-SHA256 under a key the directory does not hold (the user's secret in `$LITKV_HOME`, or the
store's own key) and the token ids it covers: the forged entry is refused (one logged line), removed,
and the answer is the recomputed one, equal to a cold run's.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import forge_entry
from tiny_checkpoint import make_tiny_checkpoint

from litkv import GPT, KVCacheConfig, PrefixCache, generate
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.core import secret
from litkv.core.secret import check_key, user_secret
from litkv.kvcache.config import ChunkPlan
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult
from litkv.serve.engine import message_keys
from litkv.states.block_store import BlockStore
from litkv.states.state import CacheState

NEW = 6
KV = KVCacheConfig(policy="h2o", cache_length=32, chunk_size=8)


@pytest.fixture(autouse=True)
def private_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh `$LITKV_HOME` (and no cached secret) for each test."""
    home = tmp_path / "home"
    monkeypatch.setenv("LITKV_HOME", str(home))
    monkeypatch.setattr(secret, "_cached", {})
    return home


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(11, gates=True)


def _entry(path: Path) -> dict:
    return CacheState.load_entry(path)[1]  # type: ignore[return-value]


def _forge_all(directory: Path, sources: list[str], targets: list[str], **kwargs: object) -> None:
    """Each target's file replaced by its source's tensors under the target's whole entry, checksum
    recomputed (the attack of the issue)."""
    for src, dst in zip(sources, targets, strict=True):
        target = directory / f"{dst}.safetensors"
        forge_entry(directory / f"{src}.safetensors", target, **{**_entry(target), **kwargs})


def test_prefix_store_refuses_another_prompts_state_under_a_pasted_entry(
    model: GPT, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = KVCacheConfig("h2o", cache_length=24, chunk_size=8)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 128, (20,), generator=gen), torch.randint(0, 128, (20,), generator=gen)
    cold_a = generate(model, [a], NEW, cfg)[0].tolist()
    cold_b = generate(model, [b], NEW, cfg)[0].tolist()
    assert cold_a != cold_b
    directory = tmp_path / "prefix"
    writer = PrefixCache(10**9, directory)
    generate(model, [a], NEW, cfg, prefix_cache=writer)
    generate(model, [b], NEW, cfg, prefix_cache=writer)
    seed = PrefixCache.namespace(model, [cfg] * model.config.n_layer, model.lm_head.weight.dtype)
    bounds = ChunkPlan.of(cfg).bounds(20)[:2]
    a_keys, b_keys = PrefixCache.block_keys(seed, a, bounds), PrefixCache.block_keys(seed, b, bounds)
    _forge_all(directory, b_keys, a_keys)

    reader = PrefixCache(10**9, directory)
    with caplog.at_level(logging.WARNING):
        got = generate(model, [a], NEW, cfg, prefix_cache=reader)[0].tolist()
    assert got == cold_a and reader.hits == 0
    # each forged file refused once (then removed and written again by the recomputation)
    assert caplog.text.count("carries no mac") == 2 and caplog.text.count("ignoring and removing") == 2
    caplog.clear()
    again = PrefixCache(10**9, directory)
    with caplog.at_level(logging.WARNING):
        assert generate(model, [a], NEW, cfg, prefix_cache=again)[0].tolist() == cold_a
    assert again.hits == 1 and again.reused_tokens == 16 and "ignoring" not in caplog.text


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    out = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(out)
    return load_model(out), load_tokenizer(out)


def _turn(engine: Engine, messages: list[tuple[str, str]]) -> TurnResult:
    result = TurnResult()
    "".join(engine.run(TurnRequest(list(messages), 8, temperature=0.0), result))
    return result


def test_state_dir_refuses_another_conversation_under_a_pasted_entry(
    model_and_tok: tuple, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, tok = model_and_tok
    directory = tmp_path / "states"

    def store(path: Path | None = directory) -> ConversationStore:
        return ConversationStore(1 << 30, path, model=model, kv_cache=KV)

    writer = Engine(model, tok, KV, store())
    keys, follows = [], []
    for text in ("vault zero is ALPHA", "vault zero is BRAVO"):
        reply = _turn(writer, [("user", text)]).content
        messages = [("user", text), ("assistant", reply)]
        keys.append(message_keys(writer.root, messages)[-1])
        follows.append([*messages, ("user", "What is vault zero?")])
    x_key, y_key = keys
    x_file, y_file = directory / f"{x_key}.safetensors", directory / f"{y_key}.safetensors"
    # the two states cover as many tokens: only the entry tells them apart
    assert _entry(x_file)["tokens"] == _entry(y_file)["tokens"]
    memory = Engine(model, tok, KV, store(None))
    _turn(memory, follows[0][:1])
    expected = _turn(memory, follows[0]).reply_ids  # X's own state, held in memory

    forge_entry(y_file, x_file, **_entry(x_file))  # Y's tensors, X's whole entry, checksum recomputed
    engine = Engine(model, tok, KV, store())
    with caplog.at_level(logging.WARNING):
        result = _turn(engine, follows[0])
    assert caplog.text.count("carries no mac") == 1 and engine.store.hits["disk"] == 0
    assert result.reply_ids == expected and result.reused_tokens == 0


def test_block_dir_refuses_another_documents_pieces_under_pasted_entries(
    model_and_tok: tuple, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, _ = model_and_tok
    plan = ChunkPlan.of(KVCacheConfig(policy="dense", cache_length=64, chunk_size=8))
    d0, d1 = torch.arange(3, 19), torch.arange(40, 56)
    directory = tmp_path / "blocks"
    writer = BlockStore(1 << 30, directory)
    expected = writer.get(model, d0, plan)
    other = writer.get(model, d1, plan)
    seed = BlockStore.seed(model, model.lm_head.weight.dtype, plan)
    bounds = plan.bounds(d0.numel())
    _forge_all(directory, BlockStore.piece_keys(seed, d1, bounds), BlockStore.piece_keys(seed, d0, bounds))
    reader = BlockStore(1 << 30, directory)
    with caplog.at_level(logging.WARNING):
        got = reader.get(model, d0, plan)
    assert "carries no mac" in caplog.text and reader.hits == 0
    assert caplog.text.count("ignoring and removing") == 1  # the first piece refused: the rest recomputed
    for a, b, c in zip(got.keys, expected.keys, other.keys, strict=True):
        torch.testing.assert_close(a, b)
        assert not torch.equal(a, c)


def test_a_signed_entry_whose_own_token_ids_are_another_prompts_is_refused(
    model: GPT, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Even a writer holding the key (or a bug of ours) cannot make B's state answer A: the file's own
    token ids are compared with the request's."""
    cfg = KVCacheConfig("h2o", cache_length=24, chunk_size=8)
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 128, (12,), generator=gen), torch.randint(0, 128, (12,), generator=gen)
    directory = tmp_path / "prefix"
    writer = PrefixCache(10**9, directory)
    generate(model, [a], NEW, cfg, prefix_cache=writer)
    generate(model, [b], NEW, cfg, prefix_cache=writer)
    seed = PrefixCache.namespace(model, [cfg] * model.config.n_layer, model.lm_head.weight.dtype)
    (a_key,), (b_key,) = PrefixCache.block_keys(seed, a, [(0, 8)]), PrefixCache.block_keys(seed, b, [(0, 8)])
    assert CacheState.load(directory / f"{b_key}.safetensors").token_ids == [b[:8].tolist()]
    _forge_all(directory, [b_key], [a_key], sign=user_secret())  # signed; B's own ids kept
    reader = PrefixCache(10**9, directory)
    with caplog.at_level(logging.WARNING):
        got = generate(model, [a], NEW, cfg, prefix_cache=reader)[0].tolist()
    assert "own token ids are not the request's" in caplog.text and reader.hits == 0
    assert got == generate(model, [a], NEW, cfg)[0].tolist()


def test_a_store_key_given_by_the_user(model: GPT, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = KVCacheConfig("h2o", cache_length=24, chunk_size=8)
    a = torch.arange(5, 17)
    directory = tmp_path / "shared"
    generate(model, [a], NEW, cfg, prefix_cache=PrefixCache(10**9, directory, key=b"k" * 32))
    same = PrefixCache(10**9, directory, key=b"k" * 32)
    generate(model, [a], NEW, cfg, prefix_cache=same)
    assert same.hits == 1
    other = PrefixCache(10**9, directory, key=b"j" * 32)  # another key (or the user's secret): refused
    with caplog.at_level(logging.WARNING):
        generate(model, [a], NEW, cfg, prefix_cache=other)
    assert other.hits == 0 and "a mac this store's key did not make" in caplog.text
    with pytest.raises(ValueError, match="a store's key must be at least 32 random bytes, got 5 bytes"):
        PrefixCache(10**9, directory, key=b"short")
    with pytest.raises(ValueError, match="got str"):
        check_key("k" * 40)


def test_the_users_secret_is_private_and_refused_when_others_can_read_it(private_home: Path) -> None:
    key = user_secret()
    path = private_home / "secret.key"
    assert len(key) == 32 and path.read_bytes() == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    secret._cached.clear()
    assert user_secret() == key  # read back, not replaced
    secret._cached.clear()
    path.chmod(0o644)
    with pytest.raises(ValueError, match="secret.key' has mode 644: others may read or write it"):
        user_secret()
    secret._cached.clear()
    path.unlink()
    other = private_home / "elsewhere"
    other.write_bytes(b"x" * 32)
    os.chmod(other, 0o600)
    path.symlink_to(other)
    with pytest.raises(ValueError, match="cannot be read \\(a symlink is refused\\)"):
        user_secret()
    secret._cached.clear()
    path.unlink()
    path.write_bytes(b"short")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="at least 32 random bytes, got 5 bytes"):
        user_secret()
