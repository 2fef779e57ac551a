"""Prefix reuse (litkv.states.prefix.PrefixCache, generate(..., prefix_cache=...), litkv generate --prompt_cache).

A row prefilled from a stored prefix continues exactly where a cold run of its prompt alone would be,
so its tokens are those of the prompt alone, whatever prefix length each row of a batch finds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import evicts_alone, forge_entry

from litkv import GPT, CacheState, KVCacheConfig, PrefixCache, generate
from litkv.kvcache import get_kv_cache_class, known_policies

POLICIES = [n for n in known_policies() if get_kv_cache_class(n).__module__.startswith("litkv.") and evicts_alone(n)]
NEW = 6


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(11, gates=True)


def _config(policy: str, chunk: int = 8) -> KVCacheConfig:
    return KVCacheConfig(policy, cache_length=96 if policy == "dense" else 24, chunk_size=chunk)


def _prompts(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A shared 27-token prefix and four prompts: two continuing it, one sharing 13 tokens, one unrelated."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 128, (27,), generator=gen)
    other = torch.randint(0, 128, (20,), generator=gen)
    return shared, [
        torch.cat((shared, torch.randint(0, 128, (5,), generator=gen))),
        torch.cat((shared, torch.randint(0, 128, (14,), generator=gen))),
        torch.cat((shared[:13], torch.randint(0, 128, (9,), generator=gen))),
        other,
    ]


def _alone(model: GPT, prompts: list[torch.Tensor], cfg: KVCacheConfig) -> list[list[int]]:
    return [generate(model, [p], NEW, cfg)[0].tolist() for p in prompts]


@pytest.mark.parametrize("policy", POLICIES)
def test_ragged_batch_with_different_prefix_hits_gives_the_tokens_of_each_prompt_alone(model: GPT, policy: str) -> None:
    """Store primed with the shared prefix; a ragged batch whose rows find 24, 24, 8 and 0 stored tokens
    (blocks of 8) decodes the tokens each prompt gets alone without a store, and so does a second call
    that finds everything stored (the last block of each row included)."""
    cfg = _config(policy)
    shared, prompts = _prompts()
    store = PrefixCache(10**9)
    assert generate(model, [shared], NEW, cfg, prefix_cache=store)[0].tolist() == _alone(model, [shared], cfg)[0]
    assert (store.hits, store.misses, store.reused_tokens) == (0, 1, 0) and len(store) == 3
    expected = _alone(model, prompts, cfg)
    got = generate(model, prompts, NEW, cfg, prefix_cache=store)
    assert [t.tolist() for t in got] == expected
    assert (store.hits, store.reused_tokens) == (3, 24 + 24 + 8)
    again = generate(model, prompts, NEW, cfg, prefix_cache=store)
    assert [t.tolist() for t in again] == expected
    assert store.reused_tokens == 56 + 32 + 40 + 16 + 16


@pytest.mark.parametrize("policy", POLICIES)
def test_token_by_token_store_equals_the_plain_batch(model: GPT, policy: str) -> None:
    """With chunks of one token (chunk boundaries play no role in a left-padded batch), generate with a
    store gives the tokens of generate without one, on the same ragged batch."""
    cfg = _config(policy, chunk=1)
    _, prompts = _prompts(seed=1)
    plain = [t.tolist() for t in generate(model, prompts, NEW, cfg)]
    store = PrefixCache(10**9)
    assert [t.tolist() for t in generate(model, prompts[:1], NEW, cfg, prefix_cache=store)] == plain[:1]
    assert [t.tolist() for t in generate(model, prompts, NEW, cfg, prefix_cache=store)] == plain
    assert store.reused_tokens == 32 + 27 + 13


def test_exact_logits_for_a_batch_of_one(model: GPT) -> None:
    """A hit gives bitwise the first-step logits of the cold run (h2o, evicting)."""
    cfg = _config("h2o")
    _, prompts = _prompts(seed=2)
    logits = []

    def keep(tokens: torch.Tensor) -> None:
        logits.append(tokens.clone())

    store = PrefixCache(10**9)
    for _ in range(3):
        generate(model, prompts[1:2], NEW, cfg, on_tokens=keep, prefix_cache=store if logits else None)
    assert torch.equal(torch.stack(logits[:NEW]), torch.stack(logits[NEW : 2 * NEW]))
    assert torch.equal(torch.stack(logits[:NEW]), torch.stack(logits[2 * NEW :]))
    assert store.hits == 1 and store.reused_tokens == 40


def test_store_is_bounded_by_bytes_lru(model: GPT) -> None:
    cfg = _config("h2o")
    _, prompts = _prompts(seed=3)
    probe = PrefixCache(10**9)
    generate(model, prompts[1:2], 1, cfg, prefix_cache=probe)
    one = max(s.nbytes() for s in probe._store.memory.states())
    store = PrefixCache(2 * one)
    generate(model, prompts[1:2], 1, cfg, prefix_cache=store)
    assert len(store) == 2 and store.nbytes() <= 2 * one
    # the two newest blocks are kept: the prompt's first block was evicted, the longest prefix still hits
    generate(model, prompts[1:2], 1, cfg, prefix_cache=store)
    assert store.hits == 1 and store.reused_tokens == 40


def test_store_on_disk_across_instances(model: GPT, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _config("snapkv")
    _, prompts = _prompts(seed=4)
    expected = _alone(model, prompts[:2], cfg)
    first = PrefixCache(10**9, tmp_path / "store")
    assert [t.tolist() for t in generate(model, prompts[:2], NEW, cfg, prefix_cache=first)] == expected
    files = sorted((tmp_path / "store").iterdir())  # blocks of 8: 4 and 5, the first 3 shared
    assert len(files) == 4 + 2 and first.disk_bytes() == sum(f.stat().st_size for f in files)
    second = PrefixCache(10**9, tmp_path / "store")  # a new process, say
    assert [t.tolist() for t in generate(model, prompts[:2], NEW, cfg, prefix_cache=second)] == expected
    assert second.hits == 2 and second.reused_tokens == 32 + 40
    for f in files:  # corrupt files are skipped with a warning, and recomputed
        f.write_bytes(f.read_bytes()[:100])
    third = PrefixCache(10**9, tmp_path / "store")
    with caplog.at_level(logging.WARNING, logger="litkv.states.prefix"):
        assert [t.tolist() for t in generate(model, prompts[:2], NEW, cfg, prefix_cache=third)] == expected
    assert "ignoring and removing" in caplog.text
    assert third.hits == 1 and third.reused_tokens == 24  # row 1 finds what row 0 recomputed
    fourth = PrefixCache(10**9, tmp_path / "store")  # the files were written again
    generate(model, prompts[:2], NEW, cfg, prefix_cache=fourth)
    assert fourth.hits == 2 and fourth.reused_tokens == 32 + 40
    small = PrefixCache(1, tmp_path / "small")
    generate(model, prompts[:1], 1, cfg, prefix_cache=small)
    assert small.disk_bytes() <= 1 and len(small) == 0


def test_other_model_or_config_never_hits(model: GPT, tiny_model: Callable[..., GPT]) -> None:
    _, prompts = _prompts(seed=5)
    store = PrefixCache(10**9)
    generate(model, prompts[:1], 1, _config("h2o"), prefix_cache=store)
    generate(model, prompts[:1], 1, _config("tova"), prefix_cache=store)
    other = tiny_model(12)
    generate(other, prompts[:1], 1, _config("h2o"), prefix_cache=store)
    assert store.hits == 0 and store.misses == 3


def test_bad_arguments(model: GPT, tmp_path: Path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes must be an int >= 1"):
            PrefixCache(bad)  # type: ignore[arg-type]
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        PrefixCache(10, tmp_path / "file")
    with pytest.raises(TypeError, match="prefix_cache must be a litkv.PrefixCache"):
        generate(model, [torch.tensor([1, 2])], 1, _config("h2o"), prefix_cache={})  # type: ignore[arg-type]


def test_generate_cli_prompt_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from litkv.__main__ import main

    args = ["generate", "--prompt_cache", str(tmp_path / "pc"), "--temperature", "0", "--max_new_tokens", "4"]
    args += ["--kv_cache.chunk_size", "8", "--num_threads", "1", "--prompt", "And it came to pass, when the king"]
    main(args)
    first = capsys.readouterr()
    main(args)
    second = capsys.readouterr()
    assert first.out == second.out
    assert "prompt cache: 0 of" in first.err and "prompt cache: 8 of" in second.err
    assert any((tmp_path / "pc").iterdir())


def test_per_layer_configs(model: GPT) -> None:
    """One config per layer (h2o, then tova): the store keys on all of them and hits exactly."""
    configs = [_config("h2o"), _config("tova")]
    _, prompts = _prompts(seed=6)
    expected = [generate(model, [p], NEW, configs)[0].tolist() for p in prompts[:2]]
    store = PrefixCache(10**9)
    for _ in range(2):
        assert [t.tolist() for t in generate(model, prompts[:2], NEW, configs, prefix_cache=store)] == expected
    assert store.reused_tokens == 24 + 32 + 40 and store.misses == 1  # row 1 found row 0's blocks at once
    generate(model, prompts[:1], 1, configs[::-1], prefix_cache=store)  # other layer order: another chain
    assert store.misses == 2


# -- a store on disk that others share, remove, or fill up --------------------------------------------


def _disk_store(model: GPT, directory: Path, cfg: KVCacheConfig, prompt: torch.Tensor) -> PrefixCache:
    store = PrefixCache(10**9, directory)
    generate(model, [prompt], 1, cfg, prefix_cache=store)
    return store


def test_an_entry_proves_its_key(model: GPT, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A valid entry copied over another key's file (same model, same config, checksum intact) is not
    trusted by its name: warned about, removed, recomputed; the output is that of a cold run."""
    cfg = _config("h2o")
    _, prompts = _prompts(seed=6)
    expected = _alone(model, prompts[:1], cfg)[0]
    _disk_store(model, tmp_path / "s", cfg, prompts[0])
    files = sorted((tmp_path / "s").glob("*.safetensors"), key=lambda f: f.stat().st_size)
    assert len(files) == 4  # 32 tokens: blocks of 8
    files[-1].write_bytes(files[0].read_bytes())  # the longest prefix's name now holds the first block's state
    store = PrefixCache(10**9, tmp_path / "s")
    with caplog.at_level(logging.WARNING, logger="litkv.states.prefix"):
        assert generate(model, [prompts[0]], NEW, cfg, prefix_cache=store)[0].tolist() == expected
    assert "does not prove key" in caplog.text and store.hits == 1 and store.reused_tokens == 24
    again = PrefixCache(10**9, tmp_path / "s")  # recomputed and written again under its own key
    assert generate(model, [prompts[0]], NEW, cfg, prefix_cache=again)[0].tolist() == expected
    assert again.reused_tokens == 32


def test_an_entry_of_other_caches_with_a_forged_proof_is_refused(
    model: GPT, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The state of a tova run (valid file, same model and tokens) put under the h2o run's key with a proof
    forged to match (key and tokens): refused from its header because its caches are not the run's, so
    the h2o run restores the shorter prefix and its output is that of a cold h2o run."""
    import json

    from safetensors import safe_open

    h2o, tova = _config("h2o"), _config("tova")
    _, prompts = _prompts(seed=6)
    expected = _alone(model, prompts[:1], h2o)[0]
    _disk_store(model, tmp_path / "h2o", h2o, prompts[0])
    _disk_store(model, tmp_path / "tova", tova, prompts[0])

    def covers(f: Path) -> int:
        with safe_open(str(f), framework="pt") as opened:
            return json.loads(opened.metadata()["litkv"])["entry"]["tokens"]

    longest = {d: max((tmp_path / d).glob("*.safetensors"), key=covers) for d in ("h2o", "tova")}
    forge_entry(longest["tova"], longest["h2o"], key=longest["h2o"].stem, tokens=32)
    store = PrefixCache(10**9, tmp_path / "h2o")
    with caplog.at_level(logging.WARNING):
        assert generate(model, [prompts[0]], NEW, h2o, prefix_cache=store)[0].tolist() == expected
    assert "layer 0 config.policy is tova, expected h2o" in caplog.text
    assert store.hits == 1 and store.reused_tokens == 24


def test_an_entry_removed_by_another_process_is_a_miss(
    model: GPT, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Between `is_file` and the read, another process removes the entry: a plain miss, no error, no warning."""
    from litkv.states import state as state_module

    cfg = _config("tova")
    _, prompts = _prompts(seed=7)
    expected = _alone(model, prompts[:1], cfg)[0]
    _disk_store(model, tmp_path / "s", cfg, prompts[0])
    load = state_module.CacheState.load_entry.__func__

    def load_after_removal(cls: type, path: Path, *args: object, **kwargs: object) -> object:
        Path(path).unlink()
        return load(cls, path, *args, **kwargs)

    monkeypatch.setattr(state_module.CacheState, "load_entry", classmethod(load_after_removal))
    store = PrefixCache(10**9, tmp_path / "s")
    with caplog.at_level(logging.WARNING, logger="litkv.states.prefix"):
        assert generate(model, [prompts[0]], NEW, cfg, prefix_cache=store)[0].tolist() == expected
    assert store.hits == 0 and store.misses == 1 and caplog.text == ""


def test_a_store_directory_removed_while_in_use_is_created_again(model: GPT, tmp_path: Path) -> None:
    import shutil

    cfg = _config("h2o")
    _, prompts = _prompts(seed=8)
    expected = _alone(model, prompts[:2], cfg)
    store = _disk_store(model, tmp_path / "s", cfg, prompts[0])
    store.clear()
    shutil.rmtree(tmp_path / "s")
    assert store.disk_bytes() == 0
    assert [t.tolist() for t in generate(model, prompts[:2], NEW, cfg, prefix_cache=store)] == expected
    assert len(list((tmp_path / "s").glob("*.safetensors"))) > 0 and store.disk_bytes() > 0


def test_a_store_that_cannot_write_serves_from_memory_with_one_warning(
    model: GPT, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from litkv.core.atomic import FileWriteError
    from litkv.states import state as state_module

    def full_disk(
        self: object, path: Path, extra_metadata: object = None, entry: object = None, key: object = None
    ) -> None:
        raise FileWriteError(errno.ENOSPC, f"cannot write {str(path)!r}: No space left on device")

    monkeypatch.setattr(state_module.CacheState, "save", full_disk)
    cfg = _config("h2o")
    _, prompts = _prompts(seed=9)
    expected = _alone(model, prompts[:2], cfg)
    store = PrefixCache(10**9, tmp_path / "s")
    with pytest.warns(UserWarning, match="going on in memory only") as record:
        assert [t.tolist() for t in generate(model, prompts[:2], NEW, cfg, prefix_cache=store)] == expected
        first = store.hits
        assert [t.tolist() for t in generate(model, prompts[:2], NEW, cfg, prefix_cache=store)] == expected
    assert len([w for w in record if "memory only" in str(w.message)]) == 1
    assert store.hits == first + 2 and store.disk_bytes() == 0


def test_leftover_temp_files_removed_at_open_live_ones_counted(model: GPT, tmp_path: Path) -> None:
    """Temporary files of a killed writer go when the store opens; those of a writer still running stay
    and count towards the byte bound."""
    import os
    import subprocess
    import sys

    from litkv.core.atomic import TMP_PREFIX

    directory = tmp_path / "s"
    directory.mkdir()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    stale = directory / f"{TMP_PREFIX}abc.safetensors.{dead}-0123abcd"
    legacy = directory / ".abc.safetensors.tmp99"
    live = directory / f"{TMP_PREFIX}def.safetensors.{os.getppid()}-0123abcd"
    for path in (stale, legacy, live):
        path.write_bytes(b"\0" * 5000)
    store = PrefixCache(6000, directory)
    assert not stale.exists() and not legacy.exists() and live.exists()
    assert store.disk_bytes() == 5000
    cfg = _config("h2o")
    _, prompts = _prompts(seed=10)
    generate(model, prompts[:1], 1, cfg, prefix_cache=store)
    assert store.disk_bytes() <= 6000 and live.exists()  # the live write's bytes left ~1 kB for entries


def test_a_write_whose_temp_file_vanished_is_skipped_quietly(
    model: GPT, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """Another process's cleanup removed this writer's temporary file (its rename fails): that entry is not
    written, no warning, and the store keeps writing the others."""
    from litkv.states import state as state_module

    save = state_module.CacheState.save
    calls = []

    def first_fails(
        self: CacheState,
        path: Path,
        extra_metadata: dict[str, str] | None = None,
        entry: dict | None = None,
        key: bytes | None = None,
    ) -> None:
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        save(self, path, extra_metadata, entry, key)

    monkeypatch.setattr(state_module.CacheState, "save", first_fails)
    _, prompts = _prompts(seed=11)
    store = _disk_store(model, tmp_path / "s", _config("h2o"), prompts[0])
    files = list((tmp_path / "s").glob("*.safetensors"))
    assert len(calls) == 4 and len(files) == 3 and store.disk_bytes() > 0
    assert not [w for w in recwarn if "memory only" in str(w.message)]
