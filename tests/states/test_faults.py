"""Fault injection: real `litkv chat --session` and `litkv finetune` processes killed with SIGKILL at a
fixed-seed schedule of points (after k completed units, plus a random delay: in a reply, in a save,
in a training step, in a checkpoint write, while starting). After each kill the session file or the
newest checkpoint loads and equals the reference run's after the same number of turns or steps;
nothing is lost beyond the unit in progress; the next process resumes from it; and the runs stitched
together equal the uninterrupted reference run exactly.

The processes are forked from a server that imported litkv once (`fork_server.py`), so a kill point
costs a fork, not Python's imports; each process is still the real CLI (`litkv.__main__.main`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tiny_checkpoint import TEXT

from litkv.core.atomic import is_temp_name
from litkv.finetune.checkpoint_dirs import check_resume_dir
from litkv.inference.chat_session import read_turns
from litkv.states.state import CacheState

TESTS = Path(__file__).resolve().parents[1]  # tests/, where fork_server.py lives
REPO = TESTS.parent
POINTS = 20  # kill points per schedule


class ForkServer:
    """Client of `fork_server.py`: start litkv processes, reap them."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "fork_server.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        assert self._read() == "ready"

    def _read(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def _send(self, job: dict) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def start(self, argv: list[str], stdin: Path, stdout: Path, stderr: Path) -> int:
        return int(self._send({"run": argv, "stdin": str(stdin), "stdout": str(stdout), "stderr": str(stderr)}))

    def wait(self, pid: int) -> int:
        return json.loads(self._send({"wait": pid}))["code"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    srv = ForkServer()
    yield srv
    srv.close()


def _running(pid: int) -> bool:
    """Whether the child runs (a finished child stays a zombie until the server reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _kill_when(pid: int, reached: Callable[[], bool], delay: float, timeout: float = 60.0) -> None:
    """SIGKILL `pid` `delay` seconds after `reached()` holds (or when it has finished by itself)."""
    end = time.monotonic() + timeout
    while not reached() and _running(pid):
        assert time.monotonic() < end, "the process made no progress"
        time.sleep(0.002)
    time.sleep(delay)
    if _running(pid):
        os.kill(pid, signal.SIGKILL)


# -- chat --------------------------------------------------------------------------------------------

TURNS = [f"{word} the fox {i}." for i, word in enumerate(("The quick", "In the beginning", "Remember") * 20)]


def _lines(path: Path) -> int:
    """Complete lines written to `path` so far (0 before the child opened it)."""
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def _writing(directory: Path) -> bool:
    return any(is_temp_name(p.name) for p in directory.iterdir())


def _chat_argv(ckpt: Path, session: Path) -> list[str]:
    return ["chat", str(ckpt), "--kv_cache", "h2o", "--kv_cache.cache_length", "24", "--kv_cache.chunk_size", "4",
            "--temperature", "0", "--max_new_tokens", "5", "--num_threads", "1", "--session", str(session)]  # fmt: skip


def _session_turns(path: Path) -> int:
    if not path.exists():
        return 0
    state = CacheState.load(path)
    turns = read_turns(path, len(state.token_ids[0]))
    assert sum(turns) == len(state.token_ids[0])
    return len(turns)


def _chat_reference(server: ForkServer, ckpt: Path, work: Path) -> tuple[list[str], list[Path]]:
    """The uninterrupted conversation: its replies and the session after each turn (`/save`)."""
    saves = [work / f"ref-{k + 1}.safetensors" for k in range(len(TURNS))]
    (work / "ref.in").write_text("".join(f"{t}\n/save {s}\n" for t, s in zip(TURNS, saves, strict=True)))
    pid = server.start(_chat_argv(ckpt, work / "ref.safetensors"), work / "ref.in", work / "ref.out", work / "ref.err")
    assert server.wait(pid) == 0, (work / "ref.err").read_text()
    lines = (work / "ref.out").read_text().split("\n")[:-1]  # not splitlines: a reply may hold \x1c or \x85
    replies = [line for i, line in enumerate(lines) if i % 2 == 0]
    assert len(replies) == len(TURNS) and all(line.startswith("saved") for line in lines[1::2])
    _same_session(work / "ref.safetensors", saves[-1])
    return replies, saves


def _same_session(a: Path, b: Path) -> None:
    """Bitwise the same session: every layer's tensors and counter, positions, token ids, turns."""
    sa, sb = CacheState.load(a), CacheState.load(b)
    assert sa.token_ids == sb.token_ids and torch.equal(sa.last_pos, sb.last_pos), (a, b)
    for la, lb in zip(sa.layers, sb.layers, strict=True):
        assert la.num_filled == lb.num_filled and la.config == lb.config
        fa, fb = la.full_tensors(), lb.full_tensors()
        assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa), (a, b)
    assert read_turns(a, len(sa.token_ids[0])) == read_turns(b, len(sb.token_ids[0]))


@pytest.mark.slow
def test_chat_killed_at_20_points_loses_at_most_the_turn_in_progress(
    server: ForkServer, ckpt: Path, tmp_path: Path
) -> None:
    replies, saves = _chat_reference(server, ckpt, tmp_path)
    rng = random.Random(20)
    session = tmp_path / "s.safetensors"
    stitched: list[str] = []
    kills, printed_unsaved, cut_writes = 0, 0, 0
    out = tmp_path / "out"
    for point in range(POINTS + 1):
        done = _session_turns(session)
        (tmp_path / "in").write_text("".join(f"{t}\n" for t in TURNS[done:]))
        out.unlink(missing_ok=True)  # a child killed before it opened its output leaves none
        pid = server.start(_chat_argv(ckpt, session), tmp_path / "in", out, tmp_path / "err")
        if point < POINTS:
            target = min(rng.randint(0, 2), len(TURNS) - done - 1)
            if rng.random() < 0.3:  # inside the save of a session file: while its temporary file exists
                _kill_when(pid, lambda n=target: _lines(out) >= n and _writing(tmp_path), 0.0)
            else:
                _kill_when(pid, lambda n=target: _lines(out) >= n, rng.uniform(0.0, 0.04))
        code = server.wait(pid)
        printed = _lines(out)
        saved = _session_turns(session)
        assert code in (0, -signal.SIGKILL), (tmp_path / "err").read_text()
        shown = (out.read_text() if out.exists() else "").split("\n")[:printed]
        assert shown == replies[done : done + printed], (point, done)
        lost = done + printed - saved
        kills += code == -signal.SIGKILL
        cut_writes += any(is_temp_name(p.name) for p in tmp_path.iterdir())
        printed_unsaved += lost == 1  # killed between a reply's last token and the end of its save
        assert lost in ((0, 1) if code else (0,)), (point, done, printed, saved)  # at most the turn in progress
        if saved:
            _same_session(session, saves[saved - 1])
        stitched += replies[done:saved]
        temps = [p for p in tmp_path.iterdir() if is_temp_name(p.name)]
        assert len(temps) <= 1, temps  # at most the write the kill cut; the next chat removes it
    assert done + printed == len(TURNS) and stitched == replies  # the last run went to the end
    assert temps == []
    print(f"chat: {kills} kills, {printed_unsaved} after a reply was shown, before its save; {cut_writes} in a write")
    assert kills >= POINTS - 2


# -- finetune ----------------------------------------------------------------------------------------

STEPS = 40


def _finetune_argv(ckpt: Path, data: Path, out: Path, resume: Path | None) -> list[str]:
    argv = ["finetune", str(ckpt), "--data.path", str(data), "--data.seq_length", "16", "--data.val_fraction", "0",
            "--kv_cache.policy", "h2o", "--kv_cache.cache_length", "8", "--kv_cache.chunk_size", "4",
            "--train.max_steps", str(STEPS), "--train.global_batch_size", "1", "--train.warmup_steps", "2",
            "--train.save_interval", "1", "--eval.interval", "1000", "--precision", "32-true",
            "--out_dir", str(out)]  # fmt: skip
    return argv + (["--overwrite", "true"] if resume is None else ["--resume", str(resume)])


def _steps(out: Path) -> list[Path]:
    """Complete step directories (a temporary name is never one)."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.name.startswith("step-") and p.is_dir())


def _same_checkpoint(a: Path, b: Path) -> None:
    """Same weights, adapters and training state (optimizer, step, RNG) byte for byte."""
    for name in ("model.safetensors", "lora.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), (a, name)
    sa, sb = (torch.load(p / "training_state.pt", weights_only=True) for p in (a, b))
    flat_a, flat_b = _flatten(sa), _flatten(sb)
    assert flat_a.keys() == flat_b.keys()
    for key, value in flat_a.items():
        other = flat_b[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (a, key)


def _flatten(obj: object, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flatten(val, f"{prefix}{key}.").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _flatten(val, f"{prefix}{i}.").items()}
    return {prefix: obj}


@pytest.mark.slow
def test_finetune_killed_at_20_points_resumes_to_the_uninterrupted_run(
    server: ForkServer, ckpt: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data.txt"
    data.write_text(TEXT[:1500])
    ref = tmp_path / "ref"
    pid = server.start(_finetune_argv(ckpt, data, ref, None), data, tmp_path / "ref.out", tmp_path / "ref.err")
    assert server.wait(pid) == 0, (tmp_path / "ref.err").read_text()
    assert len(_steps(ref)) == STEPS
    rng = random.Random(25)
    out = tmp_path / "out"
    kills, in_write = 0, 0
    for point in range(POINTS + 1):
        steps = _steps(out)
        resume = steps[-1] if steps else None
        argv = _finetune_argv(ckpt, data, out, resume)
        pid = server.start(argv, data, tmp_path / "out.log", tmp_path / "err.log")
        if point < POINTS:
            target = len(steps) + rng.randint(0, 2)
            _kill_when(pid, lambda n=target: len(_steps(out)) >= n, rng.uniform(0.0, 0.03))
        code = server.wait(pid)
        assert code in (0, -signal.SIGKILL), (tmp_path / "err.log").read_text()[-3000:]
        kills += code == -signal.SIGKILL
        in_write += any(is_temp_name(p.name) for p in out.iterdir()) if out.is_dir() else 0
        for step in _steps(out):  # every directory under a final name is complete
            check_resume_dir(step, "lora")
        if _steps(out):
            newest = _steps(out)[-1]
            _same_checkpoint(newest, ref / newest.name)
        if (out / "final").is_dir():
            break
    assert code == 0 and point >= POINTS, "the schedule ended early"
    print(f"finetune: {kills} kills, {in_write} inside a checkpoint write")
    assert kills >= POINTS - 2
    _same_checkpoint(out / "final", ref / "final")


# -- a prefix store shared by concurrent processes --------------------------------------------------


def _generate_argv(ckpt: Path, prompt: str, store: Path | None) -> list[str]:
    argv = ["generate", str(ckpt), "--prompt", prompt, "--kv_cache", "h2o", "--kv_cache.cache_length", "16",
            "--kv_cache.chunk_size", "4", "--temperature", "0", "--max_new_tokens", "4",
            "--num_threads", "1"]  # fmt: skip
    return argv + ([] if store is None else ["--prompt_cache", str(store)])


@pytest.mark.slow
def test_concurrent_processes_share_a_prefix_store(server: ForkServer, ckpt: Path, tmp_path: Path) -> None:
    """Four `litkv generate --prompt_cache DIR` processes at a time, three rounds, on prompts sharing
    prefixes (so they write the same entries at the same moment), while entries are being deleted
    under them: every process prints the tokens of a cold run, and every file left is a complete entry
    that proves the key it is named after."""
    from safetensors import safe_open

    base = TEXT[:160]
    prompts = [base[: 60 + 25 * i] for i in range(4)]
    cold = []
    for i, prompt in enumerate(prompts):
        pid = server.start(
            _generate_argv(ckpt, prompt, None), ckpt / "model_config.yaml", tmp_path / f"c{i}", tmp_path / "e"
        )
        assert server.wait(pid) == 0, (tmp_path / "e").read_text()
        cold.append((tmp_path / f"c{i}").read_text())
    store, rng = tmp_path / "store", random.Random(3)
    for round_ in range(3):
        pids = [
            server.start(
                _generate_argv(ckpt, p, store), ckpt / "model_config.yaml", tmp_path / f"o{i}", tmp_path / f"e{i}"
            )
            for i, p in enumerate(prompts)
        ]
        time.sleep(0.05 * round_)
        for f in sorted(store.glob("*.safetensors")) if store.is_dir() else []:
            if rng.random() < 0.3:
                f.unlink(missing_ok=True)  # another process's cleanup, say
        codes = [server.wait(pid) for pid in pids]
        assert codes == [0] * 4, [(tmp_path / f"e{i}").read_text()[-2000:] for i in range(4)]
        assert [(tmp_path / f"o{i}").read_text() for i in range(4)] == cold
    files = sorted(store.glob("*.safetensors"))
    assert files and not [p for p in store.iterdir() if is_temp_name(p.name)]
    for f in files:
        CacheState.load(f)
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            assert json.loads((handle.metadata() or {})["litkv"])["entry"]["key"] == f.name.removesuffix(".safetensors")
