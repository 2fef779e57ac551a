"""`c_build`: a library named by its source and the headers beside it, reused while neither changes; loaded once
with its functions' signatures, or None with one warning."""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import pytest

from litkv.core.c_build import build, find_compiler, load


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
def test_a_header_beside_the_source_is_part_of_the_librarys_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LITKV_HOME", str(tmp_path / "home"))
    source = tmp_path / "src" / "answer.c"
    source.parent.mkdir()
    source.write_text('#include "value.h"\nint answer(void) { return VALUE; }\n')
    header = source.with_name("value.h")
    header.write_text("#define VALUE 41\n")
    first = build(source, (), "answer")
    assert build(source, (), "answer") == first  # reused
    header.write_text("#define VALUE 42\n")
    second = build(source, (), "answer")
    assert second != first and first.is_file()
    assert ctypes.CDLL(str(first)).answer() == 41 and ctypes.CDLL(str(second)).answer() == 42


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
def test_load_gives_the_signatures_or_none_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITKV_HOME", str(tmp_path / "home"))
    good = tmp_path / "good.c"
    good.write_text("double half(double x) { return x / 2; }\n")
    lib = load(good, (), "good", {"half": ([ctypes.c_double], ctypes.c_double)}, "unused")
    assert lib is not None and lib.half(3) == 1.5
    assert load(good, (), "good", {}, "unused") is lib  # loaded once per process
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with pytest.warns(RuntimeWarning, match=r"(?s)bad\.c -DX=1 could not be built.*; they take the slow path"):
        assert load(bad, ("-DX=1",), "bad", {}, "they take the slow path") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(bad, ("-DX=1",), "bad", {}, "they take the slow path") is None  # no second warning
