"""The benchmarks' arithmetic and tables: bytes per step, bandwidth bound, unavailable peers, policy rows."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_script

from litkv.cli import bench_cmd
from litkv.cli.bench_cmd import format_table
from litkv.eval import peers
from litkv.eval.bandwidth import bound_tokens_per_s, bytes_per_step, kv_bytes_per_token, measure_bandwidth, weight_bytes
from litkv.eval.peers import BenchResult


def _load_bench_policies():
    return load_script("bench_policies")


def _load_report():
    """`scripts/policy_report.py`, the report functions of bench_policies (imported by it)."""
    _load_bench_policies()
    return sys.modules["policy_report"]


# -- litkv.eval.bandwidth ------------------------------------------------------------------------------


def test_kv_bytes_per_token_of_smollm2_135m() -> None:
    # 30 layers x (keys + values) x 3 KV heads x 64 x 4 bytes: the 46,080 bytes per token
    assert kv_bytes_per_token(30, 3, 64, 4) == 46_080


def test_bytes_per_step_and_bound() -> None:
    assert bytes_per_step(1000, 10, 50, batch=4) == 1000 + 4 * 10 * 50
    assert bound_tokens_per_s(2000.0, 1000.0, batch=4) == 8.0


def test_weight_bytes_counts_a_tied_weight_once() -> None:
    emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    assert weight_bytes(model) == 2 * 10 * 4 * 4
    head.weight = emb.weight
    assert weight_bytes(model) == 10 * 4 * 4


def test_measure_bandwidth_restores_threads() -> None:
    before = torch.get_num_threads()
    assert measure_bandwidth(2**20, repeats=2, threads=1) > 1e6  # any machine reads 1 MB/s
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: measure_bandwidth(0), "nbytes must be an int >= 1, got 0"),
        (lambda: measure_bandwidth(2**20, threads=0), "threads must be an int >= 1, got 0"),
        (lambda: bytes_per_step(-1, 1, 1), "got -1"),
        (lambda: bound_tokens_per_s(0.0, 1.0), "bandwidth and step_bytes must be > 0, got 0.0"),
        (lambda: kv_bytes_per_token(30, 3, 64, 0), "element_size must be an int >= 1, got 0"),
    ],
)
def test_bandwidth_helpers_refuse_bad_values(call, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        call()


# -- litkv bench ----------------------------------------------------------------------------------


def _result(peer: str, tok_s: float, tokens: list[int], **extra) -> BenchResult:
    return BenchResult(peer, 512, 8, 1.0, tok_s, 1000.0, 400.0, tokens, **extra)


def test_table_shows_bound_fraction_and_unavailable_peer() -> None:
    rows = [
        _result("litkv", 20.0, [1, 2], step_bytes=5e8, bandwidth=2e10),  # bound 40 tok/s
        BenchResult("litkv-compile", 512, 0, 0.0, 0.0, 0.0, 0.0, [], note="not available: no compile option"),
        _result("hf", 10.0, [1, 3], step_bytes=5e8, bandwidth=2e10, compile_s=12.5),
    ]
    lines = format_table(rows).splitlines()
    assert len(lines) == 5 and all(line.count("|") == 17 for line in lines)
    ours, missing, peer = (line.split(" | ") for line in lines[2:])
    assert ours[5:8] == ["500", "40.0", "50%"]  # MB/step, bound tok/s, of bound
    assert "not available: no compile option" in missing[2] and "20" not in "".join(missing[3:])
    assert peer[3] == "12.5" and peer[10] == "2.00" and peer[-1] == "no |"  # compile s, litkv/peer, same tokens
    # end to end: prefill 1 s + 7 steps; the peer's over litkv's
    assert ours[13:15] == ["1.35", "1.00"] and peer[13:15] == ["1.70", "1.26"]


def test_each_row_is_its_median_round() -> None:
    """Rounds of one (prompt, peer) reduce to the round of median decode speed, with that round's other figures;
    an even count takes the slower middle round."""
    rounds = [_result("litkv", speed, [i]) for i, speed in enumerate((10.0, 30.0, 20.0))]
    rounds += [_result("hf", speed, [i]) for i, speed in enumerate((12.0, 8.0))]
    ours, theirs = bench_cmd._median_of(rounds)
    assert (ours.decode_tok_s, ours.tokens) == (20.0, [2]) and (theirs.decode_tok_s, theirs.tokens) == (8.0, [1])


def test_litkv_compile_reports_not_available(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(peers, "_litkv_compile_available", lambda: False)
    r = peers.run_peer("litkv-compile", "SmolLM2-135M", tmp_path, tmp_path, 16, 4, 16, 0)
    assert not r.available and r.note.startswith("not available") and r.decode_tok_s == 0.0


def test_compile_seconds_subtract_the_same_work() -> None:
    warm = peers._Warmup([0.0, 30.0, 31.0, 32.0])  # prefill + 2 steps took 32 s in the warm-up call
    assert peers._compile_seconds([warm], prefill=5.0, step=0.5) == pytest.approx(32.0 - 6.0)
    assert peers._compile_seconds([], prefill=5.0, step=0.5) is None


def test_bench_refuses_unknown_peer() -> None:
    with pytest.raises(ValueError, match="peers must be among .* got 'vllm'"):
        bench_cmd._resolve_peers(["vllm"], quick=False)
    assert bench_cmd._resolve_peers(None, quick=True) == ["litkv", "hf", "litgpt"]


# -- scripts/bench_policies.py --------------------------------------------------------------------


@pytest.mark.slow
def test_bench_policies_quick_rows_and_byte_bound(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    report = _load_report()
    module = _load_bench_policies()
    argv = ["--quick", "--configs", "1x80", "--new-tokens", "3", "--policies", "dense,last-recent,h2o,qh2o"]
    runs = module.main([*argv, "--modes", "eager", "--json-out", str(tmp_path / "out.json")])["1x80"]
    out = capsys.readouterr().out
    assert [(r.policy, r.mode) for r in runs] == [
        *((p, "eager") for p in ("dense", "last-recent", "h2o", "qh2o")),
        ("hf-dynamic", "eager"),  # transformers on the same weights
    ]
    dense, recent, h2o, qh2o, hf = runs
    # dense reads 80 + 1.5 cached tokens per step, the others their 64 slots; int4 reads fewer bytes
    assert dense.step_bytes > recent.step_bytes == h2o.step_bytes > qh2o.step_bytes
    assert dense.cache_bytes / (80 + 3) == recent.cache_bytes / 64
    assert (hf.step_bytes, hf.cache_bytes) == (dense.step_bytes, dense.cache_bytes)
    h2o_row = next(line for line in out.splitlines() if line.startswith("| h2o "))
    assert f"{dense.step_bytes / h2o.step_bytes:.2f}x" in h2o_row  # h2o's byte bound
    assert "end-to-end 1x80+3: dense (eager)" in out
    assert "- h2o >= 0.97x last-recent: eager " in out and "- int4 qh2o >= 0.95x float h2o: eager " in out
    saved = json.loads((tmp_path / "out.json").read_text())
    assert [r["policy"] for r in saved["configs"]["1x80"]][-1] == "hf-dynamic"
    assert saved["plan"] == {"eager": ["dense", "last-recent", "h2o", "qh2o"]}
    assert {t["label"] for t in saved["targets"]} == {t.label for t in report.TARGETS}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--configs", "1x"], "BATCHxPROMPT like 1x4096, got '1x'"),
        (["--policies", "dense,lru"], "--policies: unknown policies ['lru']"),
        (["--compiled-policies", "h3o"], "--compiled-policies: unknown policies ['h3o']"),
        (["--modes", "eager,jit"], "--modes must be distinct entries among ['eager', 'compiled'], got 'eager,jit'"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--layers", "0"], "--layers must be >= 1, got 0"),
        (["--new-tokens", "1"], "--new-tokens must be >= 2"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    ],
)
def test_bench_policies_refuses_bad_options(argv: list[str], named: str) -> None:
    module = _load_bench_policies()
    with pytest.raises(ValueError, match=re.escape(named)):
        module.resolve(module.parse_args(argv))


def test_bench_policies_plan_of_modes() -> None:
    module = _load_bench_policies()
    _, plan = module.resolve(module.parse_args(["--policies", "dense,h2o,h2o-int8"]))
    assert plan == {"eager": ["dense", "h2o", "h2o-int8"], "compiled": ["dense", "h2o", "h2o-int8"]}
    _, plan = module.resolve(module.parse_args(["--quick", "--policies", "dense,h2o,tova"]))
    assert plan == {"eager": ["dense", "h2o", "tova"], "compiled": ["dense", "h2o"]}  # quick compiles few
    _, plan = module.resolve(module.parse_args(["--modes", "compiled", "--compiled-policies", "h2o"]))
    assert plan == {"compiled": ["h2o"]}


def _run(policy: str, mode: str, tok_s: float, step_mb: float, **extra):
    report = _load_report()
    spec = dict(batch=1, prompt=2048, new_tokens=64, prefill_s=2.0, decode_s=63 / tok_s)
    spec.update(extra)
    return report.PolicyRun(policy, mode, decode_tok_s=tok_s, cache_bytes=2**20, step_bytes=step_mb * 1e6, **spec)


def test_repeated_rounds_give_each_rows_median_round_and_each_rounds_ratios() -> None:
    """Three rounds of last-recent, h2o (eager) and dense (compiled, no last-recent there): each round's speeds
    scaled by last-recent's median over its own, then each row's median round (the lower middle of an even count),
    so that h2o's ratio to last-recent is the median of its rounds' ratios; a mode without last-recent unscaled.
    Each round's ratio to last-recent and their median in one line per policy."""
    report = _load_report()
    speeds = [(10.0, 9.0, 5.0), (12.0, 12.0, 4.0), (8.0, 7.6, 6.0)]  # (last-recent, h2o, dense) per round
    rounds = [
        [_run("last-recent", "eager", a, 400), _run("h2o", "eager", b, 400), _run("dense", "compiled", c, 500)]
        for a, b, c in speeds
    ]
    median = report.median_rounds(rounds)
    assert [r.decode_tok_s for r in median] == pytest.approx([10.0, 9.5, 5.0])
    assert median[1].decode_s == pytest.approx(63 / 9.5)  # the third round's, scaled with its speed
    assert [r.decode_tok_s for r in report.median_rounds(rounds[:2])] == pytest.approx([10.0, 9.0, 4.0])
    assert report.round_ratio_lines(rounds) == [
        "- h2o (eager) vs last-recent, each round: 0.900x, 1.000x, 0.950x (median 0.950x)"
    ]


def _synthetic_config(**hf_extra) -> list:
    """dense and h2o in both modes, last-recent eager only, the transformers row; bound 100 tok/s at 500 MB."""
    runs = [
        _run("dense", "eager", 10.0, 500),
        _run("last-recent", "eager", 12.0, 400),
        _run("h2o", "eager", 11.4, 400),
        _run("dense", "compiled", 20.0, 500),
        _run("h2o", "compiled", 19.0, 400),
        _run("hf-dynamic", "eager", 9.0, 500, **hf_extra),
    ]
    for r in runs:
        r.bound_tok_s = 5e10 / r.step_bytes
    return runs


def test_bench_policies_table_puts_modes_side_by_side() -> None:
    report = _load_report()
    _load_bench_policies()
    rows = {row[0]: row for row in report.table_rows(_synthetic_config())}
    head = report.header(["eager", "compiled"])
    assert len(head) == 16 and all(len(row) == 16 for row in rows.values())
    assert head[6::5] == ["eager tok/s", "compiled tok/s"] and head[7] == head[12] == "vs last-recent"
    # policy, prefill tok/s, byte bound, MB/step, bound tok/s, cache MiB
    assert rows["h2o"][:6] == ["h2o", "1024", "1.25x", "400", "125.0", "1.00"]
    # eager: 11.4 tok/s, 0.95x last-recent, 1.14x dense = 91% of the 1.25x bound, 9% of 125 tok/s
    assert rows["h2o"][6:11] == ["11.40", "0.95x", "1.14x", "91%", "9%"]
    assert rows["h2o"][11:] == ["19.00", "-", "0.95x", "76%", "15%"]  # no compiled last-recent
    assert rows["last-recent"][11:] == ["-"] * 5
    assert rows["hf-dynamic"][6:9] == ["9.00", "0.75x", "0.90x"] and rows["hf-dynamic"][11:] == ["-"] * 5
    table = report.format_table(_synthetic_config()).splitlines()
    assert len(table) == 2 + 4 and {line.count("|") for line in table} == {17}


def test_bench_policies_e2e_lines_against_transformers() -> None:
    report = _load_report()
    _load_bench_policies()
    runs = _synthetic_config(prefill_s=4.0)  # transformers: 512 prefill tok/s, 4 + 7 s end to end
    lines = report.e2e_lines(runs)
    assert lines[0] == (
        "end-to-end 1x2048+64: dense (eager) 8.30 s, HF dynamic 11.00 s: 1.33x HF; prefill 1024 vs 512 tok/s: 2.00x HF"
    )
    assert lines[1].startswith("end-to-end 1x2048+64: dense (compiled) 5.15 s, HF dynamic 11.00 s: 2.14x HF")
    assert report.e2e_lines([r for r in runs if r.policy != "hf-dynamic"]) == []


def test_bench_policies_targets_met_and_missed() -> None:
    report = _load_report()
    _load_bench_policies()
    other = [report.PolicyRun(**{**vars(r), "prompt": 4096}) for r in _synthetic_config(prefill_s=1.0)]
    results = report.evaluate_targets({"1x2048": _synthetic_config(), "1x4096": other})
    lines = {line.split(":")[0]: line for line in report.format_targets(results)}
    assert len(lines) == len(report.TARGETS)
    # h2o / last-recent = 0.95 in both configurations; no compiled last-recent
    assert lines["h2o >= 0.97x last-recent"] == (
        "h2o >= 0.97x last-recent: eager missed (1x2048 0.950x, 1x4096 0.950x); compiled not measured"
    )
    assert lines["int8 h2o (h2o-int8) >= 0.97x float h2o"].endswith("eager not measured; compiled not measured")
    assert (
        "last-recent vs dense >= 95% of its byte bound: eager met (1x2048 96.0%, 1x4096 96.0%)"
        in lines["last-recent vs dense >= 95% of its byte bound"]
    )
    # end-to-end at 1x2048 only (dense 8.3 s, transformers 9 s), prefill at 4096 only (2048 vs 4096 tok/s)
    e2e = lines["dense end-to-end (1x2048+64) >= 1.00x HF dynamic"]
    assert e2e.startswith("dense end-to-end (1x2048+64) >= 1.00x HF dynamic: eager met (1x2048 1.084x); compiled")
    prefill = lines["dense prefill tok/s (4096) >= HF dynamic's"]
    assert prefill == "dense prefill tok/s (4096) >= HF dynamic's: eager missed (1x4096 0.500x)"
    # a named configuration that was not run: every configuration counts, and the line says so
    only = report.format_targets(report.evaluate_targets({"1x2048": _synthetic_config()}))
    assert any(line.endswith("[not run there; from every configuration]") for line in only if "prefill" in line)
    assert all(r.met is None for r in report.evaluate_targets({}))


def test_bench_policies_interleaves_steps_and_propagates_errors() -> None:
    module = _load_bench_policies()
    log: list[tuple[int, int]] = []

    def runner(i: int, steps: int):
        def run(on_tokens) -> None:
            for k in range(steps):
                log.append((i, k))
                on_tokens(torch.tensor([k]))

        return run

    timings = module.interleaved([runner(0, 3), runner(1, 2), runner(2, 3)])
    # one streamed step of each in turn; a finished generation leaves the round
    assert log == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2), (2, 2)]
    assert [len(t.steps) for t in timings] == [2, 1, 2]  # the first token closes the prefill

    def broken(on_tokens) -> None:
        on_tokens(torch.tensor([0]))
        raise ValueError("policy failed")

    with pytest.raises(ValueError, match="policy failed"):
        module.interleaved([runner(0, 3), broken])
