"""Size errors of the KV-cache config name the flags a command-line user types (issue 46 item 4).

From Python the message names the dataclass fields; from `litkv COMMAND` the same message names
`--kv_cache.FIELD`, and says which value was the default. A fine-tuning run given only a small
`--kv_cache.cache_length` takes a chunk that fits it instead of failing on a default it never set.
"""

from __future__ import annotations

import pytest
from test_cli import main_error

from litkv import KVCacheConfig
from litkv.core.validation import FieldError


def test_python_api_names_the_fields() -> None:
    with pytest.raises(FieldError, match=r"^chunk_size must be <= cache_length, got chunk_size=32 and cache_length=16"):
        KVCacheConfig("h2o", cache_length=16, chunk_size=32)
    with pytest.raises(ValueError, match=r"^prefill_length must be <= cache_length"):
        KVCacheConfig("h2o", cache_length=16, prefill_length=17)
    with pytest.raises(ValueError, match=r"^cache_length must be >= 1, got 0"):
        KVCacheConfig("h2o", cache_length=0)


def test_as_flags_rewrites_whole_names_only() -> None:
    err = FieldError(
        "chunk_size must be <= cache_length, got chunk_size=3 (my_chunk_size, --x.cache_length)",
        ("chunk_size", "cache_length"),
    )
    assert err.as_flags("--kv_cache.") == (
        "--kv_cache.chunk_size must be <= --kv_cache.cache_length, got --kv_cache.chunk_size=3 "
        "(my_chunk_size, --x.cache_length)"
    )


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ("--kv_cache.cache_length", "16", "--kv_cache.chunk_size", "32"),
            "--kv_cache.chunk_size must be <= --kv_cache.cache_length",
        ),
        (("--kv_cache.cache_length", "16", "--kv_cache.prefill_length", "20"), "--kv_cache.prefill_length must be <="),
        (("--kv_cache.cache_length", "0"), "--kv_cache.cache_length must be >= 1, got 0"),
    ],
)
def test_generate_names_the_flags(capsys: pytest.CaptureFixture, flags: tuple[str, ...], expected: str) -> None:
    line = main_error(capsys, "generate", "--kv-cache", "h2o", *flags, "--prompt", "hi")
    assert expected in line, line


def test_finetune_chunk_follows_a_small_cache(capsys: pytest.CaptureFixture, tmp_path) -> None:
    # Only the cache length given: the run gets as far as asking for data, with no word about a chunk size.
    line = main_error(capsys, "finetune", "--kv_cache.cache_length", "64", "--out_dir", str(tmp_path / "out"))
    assert "chunk" not in line and "--data.path" in line, line
    # A chunk the user did give, too large for the cache, is named as the flag.
    line = main_error(
        capsys,
        "finetune",
        "--kv_cache.cache_length",
        "64",
        "--kv_cache.chunk_size",
        "128",
        "--out_dir",
        str(tmp_path / "o2"),
    )
    assert "--kv_cache.chunk_size must be <= --kv_cache.cache_length" in line, line
