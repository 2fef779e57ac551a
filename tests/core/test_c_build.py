"""`c_build.build`: a library named by its source and the headers beside it, reused while neither changes."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from litkv.core.c_build import build, find_compiler


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
