"""scripts/bench_serve.py's long-run pieces: user messages drawn from the seed alone, requests carrying the
recorded history, TTFT percentiles by turn index, the replay comparison that must find a changed reply, the
state directory's bytes, and (slow) a whole small run on the tiny checkpoint whose replay on a fresh server
finds every reply equal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import load_script
from servers import free_port
from tiny_checkpoint import make_tiny_checkpoint


def _load():
    return load_script("bench_serve")


def test_user_messages_come_from_the_seed_alone() -> None:
    bench = _load()
    a = bench.user_messages(7, 5, 10, 12)
    assert a == bench.user_messages(7, 5, 10, 12)
    assert a != bench.user_messages(8, 5, 10, 12)
    assert len(a) == 5 and all(len(c) == 10 for c in a)
    assert len({m for c in a for m in c}) == 50  # no two turns alike
    assert all(len(m.split()) == 12 and m.endswith(".") and m[0].isupper() for c in a for m in c)


def test_a_turn_sends_the_recorded_history() -> None:
    bench = _load()
    record = bench.Record(["u0", "u1", "u2"], replies=["r0", "r1"])
    assert record.messages(0) == [{"role": "user", "content": "u0"}]
    assert [m["content"] for m in record.messages(2)] == ["u0", "r0", "u1", "r1", "u2"]
    assert [m["role"] for m in record.messages(2)] == ["user", "assistant", "user", "assistant", "user"]


def test_ttft_by_turn_index() -> None:
    bench = _load()
    records = [bench.Record(["a", "b"], ttfts=[float(i), 100.0 + i]) for i in range(21)]  # turn 1: 0..20
    assert bench.ttft_by_turn(records) == [(10.0, 19.0), (110.0, 119.0)]  # p95 of 21 values: the 20th
    assert bench.ttft_all_turns(records) == (20.0, 118.0)  # 42 values pooled: 0..20, 100..120
    assert bench.series([3.0, 1.0, 5.0, 2.0]) == (3.0, 5.0, 2.0, 5.0)


def test_replay_comparison_names_each_changed_reply() -> None:
    bench = _load()
    recorded = [bench.Record(["a", "b"], replies=["x", "y"]), bench.Record(["c", "d"], replies=["z", "w"])]
    same = [bench.Record(r.users, replies=list(r.replies)) for r in recorded]
    assert bench.mismatches(recorded, same) == []
    same[1].replies[0] = "z "  # one character more
    assert bench.mismatches(recorded, same) == [(1, 0)]
    with pytest.raises(ValueError):  # a replay that lost a conversation is not a match
        bench.mismatches(recorded, same[:1])


def test_state_dir_bytes(tmp_path: Path) -> None:
    bench = _load()
    assert bench.dir_bytes(None) == 0 and bench.dir_bytes(tmp_path / "missing") == 0
    (tmp_path / "a").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 24)
    assert bench.dir_bytes(tmp_path) == 1024


def test_counts_per_load_are_checked() -> None:
    bench = _load()
    args = bench.parse(["--clients", "1", "8", "--conversations", "3"])
    assert args.conversations == [3, 3] and args.litgpt_conversations == [3, 3]
    with pytest.raises(SystemExit):
        bench.parse(["--clients", "1", "8", "--conversations", "3", "4", "5"])


@pytest.mark.slow
def test_small_run_replays_equal(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two loads on the tiny checkpoint (litkv, h2o 64 slots so later turns evict), then a fresh server replays
    every conversation: all replies equal, RSS and state bytes sampled after every conversation."""
    bench = _load()
    make_tiny_checkpoint(tmp_path / "ckpt")
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--servers", "litkv", "--clients", "1", "3",
            "--conversations", "2", "4", "--turns", "4", "--max_tokens", "6", "--words", "12",
            "--cache_length", "64", "--replay_clients", "2", "--port", str(free_port())]  # fmt: skip
    out = bench.main(argv)
    loads = out["results"]["litkv"]
    assert [len(loads[n]["records"]) for n in (1, 3)] == [2, 4]
    assert all(len(r.replies) == 4 and all(r.replies) for load in loads.values() for r in load["records"])
    assert [len(loads[n]["samples"]) for n in (1, 3)] == [3, 5]  # at start, then after each conversation
    assert loads[3]["samples"][-1].state_dir_bytes > 0 and loads[3]["samples"][-1].rss_mib > 100
    assert out["replays"]["litkv"] == {1: [], 3: []}
    text = capsys.readouterr().out
    assert "litkv: 0 of 24 replies differ from a fresh server's replay" in text
    assert re.search(r"\| litkv \| 3 \| 4 \| [\d.]+ \|( [\d.]+ / [\d.]+ \|){4}$", text, re.M)
