"""`scripts/ruler_slice.py --summarize`: the table of answers a (stopped) run appended, over several files."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import load_script


def _load():
    return load_script("ruler_slice")


def _write(path: Path, rows: list[tuple[str, int, str, int, float, float]]) -> None:
    lines = [
        {"task": t, "sample": i, "row": r, "budget": b, "prediction": "x", "score": s, "wall_s": 2 * c, "cpu_s": c}
        for t, i, r, b, s, c in rows
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_summarize_means_counts_times_and_common_prompts(tmp_path: Path) -> None:
    summarize = _load().summarize
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(a, [("t1", 0, "dense", 64, 1.0, 10), ("t1", 0, "kvzip", 16, 1.0, 50), ("t2", 0, "dense", 64, 0.5, 20)])
    _write(b, [("t1", 1, "dense", 64, 0.0, 30), ("t1", 1, "kvzip", 16, 0.0, 70), ("t2", 0, "kvzip", 16, 0.25, 60)])
    table = summarize([a, b]).splitlines()
    assert "| dense | 64 | 0.50 (2) | 0.50 (1) | 0.50 |" in table
    assert "| kvzip | 16 | 0.50 (2) | 0.25 (1) | 0.38 |" in table
    assert "| dense | 3 | 20 (10-30) | 40 |" in table  # CPU s per sample: mean (min-max), then wall
    assert summarize([a, b], common=True) == summarize([a, b])  # every row answered all three prompts
    _write(b, [("t1", 1, "dense", 64, 0.0, 30), ("t2", 0, "kvzip", 16, 0.5, 60)])  # kvzip stopped before t1/1
    common = summarize([a, b], common=True).splitlines()
    assert "| dense | 64 | 1.00 (1) | 0.50 (1) | 0.75 |" in common
    assert "| kvzip | 16 | 1.00 (1) | 0.50 (1) | 0.75 |" in common
    assert "| dense | 64 | 0.50 (2) | 0.50 (1) | 0.50 |" in summarize([a, b]).splitlines()
