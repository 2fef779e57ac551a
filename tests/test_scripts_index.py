"""scripts/README.md indexes every script in scripts/ exactly once, under one of its three kinds."""

from __future__ import annotations

import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
KINDS = ("Benchmarks", "Experiments", "Tools")


def test_every_script_is_indexed_once_under_a_kind() -> None:
    text = (SCRIPTS / "README.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert [s.split("\n", 1)[0].strip() for s in sections] == list(KINDS)
    listed = [name for s in sections for name in re.findall(r"^- `([^`]+)`: \S", s, re.M)]
    on_disk = sorted(p.name for p in SCRIPTS.iterdir() if p.is_file() and p.name != "README.md")
    assert sorted(listed) == on_disk, set(listed) ^ set(on_disk)
    assert len(listed) == len(set(listed))
