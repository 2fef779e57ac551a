"""The benchmarks' arithmetic and tables: bytes per step, bandwidth bound, unavailable peers, policy rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from litkv import bench
from litkv.bandwidth import bound_tokens_per_s, bytes_per_step, kv_bytes_per_token, measure_bandwidth, weight_bytes
from litkv.bench import BenchResult, format_table

ROOT = Path(__file__).resolve().parents[1]


def _load_bench_policies():
    spec = importlib.util.spec_from_file_location("bench_policies", ROOT / "scripts" / "bench_policies.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_policies"] = module
    spec.loader.exec_module(module)
    return module


# -- litkv.bandwidth ------------------------------------------------------------------------------


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


# -- litkv.bench ----------------------------------------------------------------------------------


def _result(peer: str, tok_s: float, tokens: list[int], **extra) -> BenchResult:
    return BenchResult(peer, 512, 8, 1.0, tok_s, 1000.0, 400.0, tokens, **extra)


def test_table_shows_bound_fraction_and_unavailable_peer() -> None:
    rows = [
        _result("litkv", 20.0, [1, 2], step_bytes=5e8, bandwidth=2e10),  # bound 40 tok/s
        BenchResult("litkv-compile", 512, 0, 0.0, 0.0, 0.0, 0.0, [], note="not available: no compile option"),
        _result("hf", 10.0, [1, 3], step_bytes=5e8, bandwidth=2e10, compile_s=12.5),
    ]
    lines = format_table(rows).splitlines()
    assert len(lines) == 5 and all(line.count("|") == 15 for line in lines)
    ours, missing, peer = (line.split(" | ") for line in lines[2:])
    assert ours[5:8] == ["500", "40.0", "50%"]  # MB/step, bound tok/s, of bound
    assert "not available: no compile option" in missing[2] and "20" not in "".join(missing[3:])
    assert peer[3] == "12.5" and peer[10] == "2.00" and peer[-1] == "no |"  # compile s, litkv/peer, same tokens


def test_litkv_compile_reports_not_available(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bench, "_litkv_compile_available", lambda: False)
    r = bench.run_peer("litkv-compile", "SmolLM2-135M", tmp_path, tmp_path, 16, 4, 16, 0)
    assert not r.available and r.note.startswith("not available") and r.decode_tok_s == 0.0


def test_compile_seconds_subtract_the_same_work() -> None:
    warm = bench._Warmup([0.0, 30.0, 31.0, 32.0])  # prefill + 2 steps took 32 s in the warm-up call
    assert bench._compile_seconds([warm], prefill=5.0, step=0.5) == pytest.approx(32.0 - 6.0)
    assert bench._compile_seconds([], prefill=5.0, step=0.5) is None


def test_bench_refuses_unknown_peer() -> None:
    with pytest.raises(ValueError, match="peers must be among .* got 'vllm'"):
        bench._resolve_peers(["vllm"], quick=False)
    assert bench._resolve_peers(None, quick=True) == ["litkv", "hf", "litgpt"]


# -- scripts/bench_policies.py --------------------------------------------------------------------


def test_bench_policies_quick_rows_and_byte_bound(capsys: pytest.CaptureFixture) -> None:
    module = _load_bench_policies()
    argv = ["--quick", "--configs", "1x80", "--new-tokens", "3", "--policies", "dense,last-recent,h2o,qh2o"]
    runs = module.main(argv)["1x80"]
    out = capsys.readouterr().out
    assert [r.policy for r in runs] == ["dense", "last-recent", "h2o", "qh2o"]
    dense, recent, h2o, qh2o = runs
    # dense reads 80 + 1.5 cached tokens per step, the others their 64 slots; int4 reads fewer bytes
    assert dense.step_bytes > recent.step_bytes == h2o.step_bytes > qh2o.step_bytes
    assert dense.cache_bytes / (80 + 3) == recent.cache_bytes / 64
    assert "h2o / last-recent decode:" in out and "qh2o / h2o decode:" in out
    assert f"{dense.step_bytes / h2o.step_bytes:.2f}x" in out.splitlines()[-4]  # h2o's byte bound


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--configs", "1x"], "BATCHxPROMPT like 1x4096, got '1x'"),
        (["--policies", "dense,lru"], "unknown policies ['lru']"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    ],
)
def test_bench_policies_refuses_bad_options(argv: list[str], named: str) -> None:
    module = _load_bench_policies()
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        module.resolve(module.parse_args(argv))


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
