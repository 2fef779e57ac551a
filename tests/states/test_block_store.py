"""The block store (litkv.states.block_store): keyed by token ids and weights, pieces shared along a token
trie, entries that prove their keys; a bad entry is recomputed, never spliced.

The reference for every restored block is the same block computed in a fresh store (bitwise).
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import random_tokens
from tiny_checkpoint import make_tiny_checkpoint

from litkv import GPT, KVCacheConfig
from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.inference.blocks import Segment
from litkv.inference.generate import generate
from litkv.kvcache.config import ChunkPlan
from litkv.states.block_store import BlockKV, BlockStore

PLAN = ChunkPlan(8, 8)
KV = KVCacheConfig(policy="dense", cache_length=128, chunk_size=8)


def _same(a: BlockKV, b: BlockKV) -> bool:
    left, right = [*a.keys, *a.values, a.last_hidden], [*b.keys, *b.values, b.last_hidden]
    return torch.equal(a.ids, b.ids) and all(torch.equal(x, y) for x, y in zip(left, right, strict=True))


def _fresh(model: GPT, ids: torch.Tensor) -> BlockKV:
    return BlockStore(0).get(model, ids, PLAN)


def test_same_text_other_token_ids_never_hits(tmp_path: Path) -> None:
    """'the cat…' tokenized whole and as 't' + 'he cat…': one text, two id sequences, two entries."""
    model = make_tiny_checkpoint(tmp_path / "ckpt")
    tok = load_tokenizer(tmp_path / "ckpt")
    text = "the cat sat on the mat"
    whole = tok.encode(text, bos=False, eos=False).long()
    split = torch.cat([tok.encode(text[:1], bos=False, eos=False), tok.encode(text[1:], bos=False, eos=False)]).long()
    assert tok.decode(whole) == tok.decode(split) == text and not torch.equal(whole, split)
    store = BlockStore(1 << 24, tmp_path / "blocks")
    with torch.inference_mode():
        store.get(model, whole, PLAN)
        hits = store.hits
        got = store.get(model, split, PLAN)
    assert store.hits == hits  # nothing found for the other ids
    assert _same(got, _fresh(model, split))
    reopened = BlockStore(1 << 24, tmp_path / "blocks")  # from the files alone
    with torch.inference_mode():
        assert _same(reopened.get(model, split, PLAN), got)
    assert reopened.hits == 2 and reopened.misses == 0


@torch.inference_mode()
def test_blocks_sharing_a_prefix_share_its_pieces(tiny_model: Callable[..., GPT]) -> None:
    model = tiny_model(seed=1)
    shared = random_tokens(1, 16, seed=2)[0]  # two full pieces
    a = torch.cat((shared, random_tokens(1, 5, seed=3)[0]))
    b = torch.cat((shared, random_tokens(1, 11, seed=4)[0]))
    store = BlockStore(1 << 24)
    store.get(model, a, PLAN)
    before = store.nbytes()
    got = store.get(model, b, PLAN)
    assert store.hits == 2 and store.reused_tokens == 16  # b's first two pieces came from a
    alone = {}
    for name, ids in (("a", a), ("b", b), ("shared", shared)):
        one = BlockStore(1 << 24)
        one.get(model, ids, PLAN)
        alone[name] = one.nbytes()
    assert before == alone["a"]
    assert store.nbytes() == alone["a"] + alone["b"] - alone["shared"]  # the shared pieces are held once
    assert _same(got, _fresh(model, b))  # continuing from restored pieces: bitwise the block alone


def _pieces(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


@torch.inference_mode()
@pytest.mark.parametrize("damage", ["truncate", "corrupt", "foreign", "swap"])
def test_bad_entries_are_recomputed_never_spliced(
    tiny_model: Callable[..., GPT], tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model(seed=5)
    ids = random_tokens(1, 20, seed=6)[0]
    directory = tmp_path / "blocks"
    expected = BlockStore(1 << 24, directory).get(model, ids, PLAN)
    files = _pieces(directory)
    assert len(files) == 3
    target = files[1]
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif damage == "corrupt":
        data = bytearray(target.read_bytes())
        data[-10] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "foreign":  # an entry of other weights copied under this key
        other = tiny_model(seed=99)
        BlockStore(1 << 24, tmp_path / "other").get(other, ids, PLAN)
        by_name = {p.name: p for p in _pieces(tmp_path / "other")}
        assert target.name not in by_name  # other weights: other keys
        shutil.copy(sorted(by_name.values())[0], target)
    else:  # another piece's file under this key: it proves another key
        shutil.copy(files[0] if files[0] != target else files[2], target)
    store = BlockStore(1 << 24, directory)
    with caplog.at_level(logging.WARNING):
        got = store.get(model, ids, PLAN)
    assert _same(got, expected)
    assert store.misses >= 1
    assert any("ignoring and removing" in r.getMessage() for r in caplog.records)
    assert len(_pieces(directory)) == 3  # written again: nothing lost


@torch.inference_mode()
def test_other_weights_never_hit(tiny_model: Callable[..., GPT], tmp_path: Path) -> None:
    a, b = tiny_model(seed=7), tiny_model(seed=8)
    ids = random_tokens(1, 12, seed=9)[0]
    store = BlockStore(1 << 24, tmp_path)
    store.get(a, ids, PLAN)
    got = store.get(b, ids, PLAN)
    assert store.hits == 0
    assert _same(got, _fresh(b, ids))
    other_plan = store.get(a, ids, ChunkPlan(4, 4))  # another chunking: other keys too
    assert store.hits == 0 and other_plan.length == 12


@torch.inference_mode()
def test_block_store_bounded_and_generation_unchanged_by_a_store(tiny_model: Callable[..., GPT]) -> None:
    model = tiny_model(seed=10)
    segments = [Segment(random_tokens(1, 6, seed=11)[0]), Segment(random_tokens(1, 30, seed=12)[0], True)]
    segments.append(Segment(random_tokens(1, 4, seed=13)[0]))
    small = BlockStore(1)  # holds nothing
    plain = generate(model, [segments], 6, KV, block_store=small)[0]
    assert small.nbytes() == 0
    store = BlockStore(1 << 24)
    for _ in range(2):
        assert torch.equal(generate(model, [segments], 6, KV, block_store=store)[0], plain)
    assert store.hits == 4
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0"):
        BlockStore(-1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        store.get(model, torch.tensor([1, 100000]), PLAN)


@torch.inference_mode()
def test_two_writers_of_one_block_leave_valid_entries(tiny_model: Callable[..., GPT], tmp_path: Path) -> None:
    """Two stores on one directory compute and write the same pieces at once (atomic writes): a third
    store restores every piece from the files, bitwise the block alone."""
    model = tiny_model(seed=14)
    ids = random_tokens(1, 40, seed=15)[0]
    expected = _fresh(model, ids)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with torch.inference_mode():  # one model per writer (a model's caches are its own), same weights
                BlockStore(1 << 24, tmp_path).get(tiny_model(seed=14), ids, PLAN)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    reader = BlockStore(1 << 24, tmp_path)
    assert _same(reader.get(model, ids, PLAN), expected)
    assert reader.hits == 5 and reader.misses == 0
