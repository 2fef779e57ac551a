"""scripts/bench_learned_decode.py: the rounds alternate which policy starts, each prints both decode
speeds and their ratio, and the last line the median and pooled ratios against the target; a checkpoint
without gates gets random ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import load_script
from tiny_checkpoint import make_tiny_checkpoint


def _load():
    return load_script("bench_learned_decode")


@pytest.mark.parametrize("gates", [True, False])
def test_rounds_alternate_and_report_the_ratio(tmp_path: Path, capsys: pytest.CaptureFixture, gates: bool) -> None:
    bench = _load()
    make_tiny_checkpoint(tmp_path / "ckpt", gates_seed=3 if gates else None)
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--prompt", "48", "--new", "4", "--cache_length", "16",
            "--chunk_size", "8", "--rounds", "3"]  # fmt: skip
    median = bench.main(argv)
    out = capsys.readouterr().out
    assert ("random gates" in out) != gates and "(real weights)" in out
    rounds = re.findall(
        r"round (\d) \((\S+) first\): learned ([\d.]+) tok/s, last-recent ([\d.]+) tok/s, ratio ([\d.]+)", out
    )
    assert [(r[0], r[1]) for r in rounds] == [("1", "learned"), ("2", "last-recent"), ("3", "learned")]
    ratios = sorted(float(r[2]) / float(r[3]) for r in rounds)
    assert median == pytest.approx(ratios[1], rel=0.01)  # the printed speeds are rounded
    assert re.search(rf"median of 3 rounds {median:.3f}, pooled [\d.]+ \(target >= 0.95: (met|missed)\)", out)
