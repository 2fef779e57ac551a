"""`litkv evaluate --tasks ... --devices N`: a RULER table cut into units (litkv/eval/answers.py), sharded over
Fabric processes (litkv/eval/parallel.py), answers written as they come and a stopped run resumed from them.

The reference is a one-process run and, for its rows, plain `generate` / `oneshot_answers` on each sample:
the answers of two processes, of a resumed run and of a run stopped after some units are those, file for file.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.eval import answers as answers_module
from litkv.eval.answers import Unit
from litkv.eval.parallel import shard
from litkv.eval.ruler import FALLBACK_WORDS, NiahFormat, generate_samples
from litkv.inference.generate import generate
from litkv.modeling.config import KVCacheConfig

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--tasks", "niah_single_1", "--policies", "[kvzip, h2o]", "--budgets", "[32, 64]", "--task_samples", "4"]
ARGS += ["--batch_size", "1", "--device", "cpu", "--num_threads", "1", "--kv_cache.chunk_size", "32"]


def _units(out: Path) -> dict[str, dict]:
    """The unit files of a run's `answers/` (run.json apart), by name."""
    return {p.name: json.loads(p.read_text()) for p in sorted((out / "answers").glob("*.json")) if p.name != "run.json"}


def _results(out: Path) -> list[dict]:
    return json.loads((out / "ruler.json").read_text())["results"]


@pytest.fixture(scope="module")
def one_process(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("one") / "out"
    main(["evaluate", str(ckpt), *ARGS, "--out_dir", str(out)])
    return out


def test_shard_is_a_partition_within_the_greedy_bound_of_the_best_split() -> None:
    costs = [7.0, 5.0, 4.0, 4.0, 3.0, 3.0, 2.0, 1.0, 1.0]
    units = [Unit("p", 8, "t", i, i + 1, c) for i, c in enumerate(costs)]
    for world in (1, 2, 3):
        parts = [shard(units, world, r) for r in range(world)]
        keys = [u.key for part in parts for u in part]
        assert sorted(keys) == sorted(u.key for u in units)  # every unit once
        assert all(part == [u for u in units if u in part] for part in parts)  # in the order given
        best = min(  # brute force: the best split's largest load
            max(sum(c for c, r in zip(costs, owners, strict=True) if r == k) for k in range(world))
            for owners in itertools.product(range(world), repeat=len(costs))
        )
        worst = max(sum(u.cost for u in part) for part in parts)
        assert worst <= best * (4 / 3 - 1 / (3 * world)) + 1e-9  # Graham's bound of longest-first
    with pytest.raises(ValueError, match="rank must be in"):
        shard(units, 2, 2)


def test_units_are_the_answers_of_generate_and_one_process_scores_them(ckpt: Path, one_process: Path) -> None:
    """Each dense and h2o unit holds `generate`'s greedy tokens for its sample alone (an independent run)."""
    tokenizer = load_tokenizer(ckpt)
    model = load_model(ckpt).eval()
    units = _units(one_process)
    assert len(units) == 4 * 4  # 4 samples x (dense, h2o@32, h2o@64, kvzip@all budgets)
    samples = generate_samples(["niah_single_1"], tokenizer, FALLBACK_WORDS, 256, 4, 0, NiahFormat())
    for i, s in enumerate(samples["niah_single_1"]):
        for policy, budget in (("dense", 256), ("h2o", 32)):
            cfg = KVCacheConfig(policy, cache_length=budget, chunk_size=32)
            want = generate(model, [torch.tensor(s.ids)], s.max_new_tokens, cfg)[0].tolist()
            got = units[f"niah_single_1.{i}-{i + 1}.{policy}.{budget}.json"]["answers"][str(budget)]
            assert got == [want]
        assert set(units[f"niah_single_1.{i}-{i + 1}.kvzip.all.json"]["answers"]) == {"32", "64"}
    assert [(r["policy"], r["cache_length"]) for r in _results(one_process)] == [
        ("dense", 256), ("kvzip", 32), ("kvzip", 64), ("h2o", 32), ("h2o", 64),
    ]  # fmt: skip


def _seed(one_process: Path, out: Path, keep: int) -> list[str]:
    """`out`: a stopped run's directory (marker, run.json and the first `keep` unit files of `one_process`)."""
    (out / "answers").mkdir(parents=True)
    shutil.copy(one_process / ".litkv-output.json", out)
    shutil.copy(one_process / "answers" / "run.json", out / "answers")
    names = sorted(_units(one_process))[:keep]
    for name in names:
        shutil.copy(one_process / "answers" / name, out / "answers")
    return names


def test_resume_reads_the_answers_there_and_equals_one_process(ckpt: Path, one_process: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    names = _seed(one_process, out, 5)
    marked = json.loads((out / "answers" / names[0]).read_text())
    marked["answers"] = {b: [[7] * len(outs[0])] for b, outs in marked["answers"].items()}  # not what it computes
    (out / "answers" / names[0]).write_text(json.dumps(marked))
    main(["evaluate", str(ckpt), *ARGS, "--out_dir", str(out), "--resume", "true"])
    got, want = _units(out), _units(one_process)
    assert got[names[0]] == marked  # read, not recomputed
    assert {k: v for k, v in got.items() if k != names[0]} == {k: v for k, v in want.items() if k != names[0]}


def test_a_run_stopped_after_some_units_resumes_to_one_process(
    ckpt: Path, one_process: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    real = answers_module.answer_unit
    calls = []

    def stop_after_three(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the run is stopped here
        calls.append(1)
        return real(*args)

    monkeypatch.setattr("litkv.eval.parallel.answer_unit", stop_after_three)
    with pytest.raises(SystemExit, match="130"):  # Ctrl-C's exit status
        main(["evaluate", str(ckpt), *ARGS, "--out_dir", str(out)])
    assert len(_units(out)) == 3 and not (out / "ruler.json").exists()
    monkeypatch.setattr("litkv.eval.parallel.answer_unit", real)
    main(["evaluate", str(ckpt), *ARGS, "--out_dir", str(out), "--resume", "true"])
    assert _units(out) == _units(one_process) and _results(out) == _results(one_process)


def test_resume_refuses_answers_of_other_settings(ckpt: Path, one_process: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    _seed(one_process, out, 2)
    other = [a if a != "[32, 64]" else "[16, 64]" for a in ARGS]
    with pytest.raises(SystemExit):
        main(["evaluate", str(ckpt), *other, "--out_dir", str(out), "--resume", "true"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: --resume: the answers in") and "differs in budgets" in line
    with pytest.raises(SystemExit):
        main(["evaluate", str(ckpt), "--devices", "2", "--out_dir", str(tmp_path / "ppl")])
    assert "apply to RULER tables (--tasks)" in capsys.readouterr().err


def _two_processes(ckpt: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "litkv", "evaluate", str(ckpt), *ARGS, "--out_dir", str(out), "--devices", "2"]
    return subprocess.Popen(
        [*cmd, *extra], env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, text=True,
    )  # fmt: skip


@pytest.mark.slow
def test_two_processes_equal_one_and_a_killed_run_resumes(ckpt: Path, one_process: Path, tmp_path: Path) -> None:
    """`--devices 2` (two CPU processes of one thread, gloo): the answers, file for file, and the table equal
    one process's; a two-process run killed after 4 units and resumed with two processes does too."""
    out = tmp_path / "two"
    proc = _two_processes(ckpt, out)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    assert json.loads((out / "ruler.json").read_text())["processes"] == 2
    assert _units(out) == _units(one_process) and _results(out) == _results(one_process)

    killed = tmp_path / "killed"
    proc = _two_processes(ckpt, killed)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if (killed / "answers").is_dir() and len(_units(killed)) >= 4:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # this run's processes, started in their own session
    proc.communicate()
    assert 4 <= len(_units(killed)) < 16 and not (killed / "ruler.json").exists()
    proc = _two_processes(ckpt, killed, "--resume", "true")
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    assert _units(killed) == _units(one_process) and _results(killed) == _results(one_process)
