"""scripts/bench_weight_layout.py: one table row per distinct linear shape of the preset at each row count, the
ratios printed as the speeds' quotients (the C product's where it applies)."""

from __future__ import annotations

import re

import pytest
from helpers import load_script


def test_every_linear_shape_at_both_row_counts(capsys: pytest.CaptureFixture) -> None:
    bench = load_script("bench_weight_layout")
    shapes = bench.linear_shapes("SmolLM2-135M")  # qkv, attention proj, MLP in and out, LM head
    assert shapes == [(576, 576), (576, 1536), (960, 576), (1536, 576), (49152, 576)]
    bench.main(["--model", "SmolLM2-135M", "--repeats", "1", "--mbytes", "1", "--rows", "8"])
    out = capsys.readouterr().out
    cells = r"\| (\d+) \| \((\d+), (\d+)\) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x" + r" \| ([^|]+)" * 4 + r" \|"
    rows = re.findall(cells, out)
    assert [(int(r[0]), (int(r[1]), int(r[2]))) for r in rows] == [(n, s) for n in (1, 8) for s in shapes]
    for row in rows:
        assert float(row[5]) == pytest.approx(float(row[3]) / float(row[4]), rel=0.05, abs=0.01)  # times rounded
        assert (row[6] == "-") == (row[0] == "8")  # bytes per second only where one row streams the weight
        # the C product (RowLinear's) at up to 8 rows wherever a compiler builds it: its ratio is the two times'
        if row[7] != "-":
            assert float(row[8].rstrip("x")) == pytest.approx(float(row[4]) / float(row[7]), rel=0.05, abs=0.01)
