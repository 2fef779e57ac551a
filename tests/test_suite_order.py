"""`suite_order.LONGEST_FIRST` (tests/conftest.py applies it): its files exist, and a collection runs them first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from suite_order import LONGEST_FIRST

TESTS = Path(__file__).parent


def test_longest_first_names_existing_test_files_once() -> None:
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    missing = [name for name in LONGEST_FIRST if not (TESTS / name).is_file()]
    assert not missing, f"LONGEST_FIRST names files that are gone: {missing}"


def test_collection_runs_the_longest_files_first() -> None:
    """`--collect-only` of two listed files and an unlisted one, given in the opposite order: the listed files come
    first, in `LONGEST_FIRST`'s order, each file's tests together."""
    listed = [LONGEST_FIRST[1], LONGEST_FIRST[0]]
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-n", "0", "test_suite_order.py", *listed]
    out = subprocess.run(argv, cwd=TESTS, capture_output=True, text=True, timeout=300, check=True).stdout
    files = [line.split("::")[0].removeprefix("tests/") for line in out.splitlines() if "::" in line]
    order = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert order == [LONGEST_FIRST[0], LONGEST_FIRST[1], "test_suite_order.py"], out[-2000:]
