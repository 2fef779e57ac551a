"""Subprocesses that start when the test session starts, long before their test runs.

A self-contained subprocess (a script run to its end, whose output a test then checks) spends most of its
time importing and computing on one core; started when its test's turn comes, the suite waits for it. A
test module can name such processes in `EARLY_START` (test function name -> a function of a fresh
working directory that starts the process, or returns None where the test will skip): tests/conftest.py
starts those of the selected tests when collection finishes, so they run beside the rest of the suite
(which runs one thread: `_torch_threads`), and the test takes its process with the `early_process`
fixture (tests/conftest.py). Under pytest-xdist (the default: `addopts` in pyproject.toml) nothing starts
early: a worker does not know which of the collected tests it will run, so each test starts its process when
its turn comes, while the other workers go on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pytest

Starter = Callable[[Path], "subprocess.Popen | None"]

_started: dict[str, tuple[subprocess.Popen | None, Path]] = {}


def starter_of(item: pytest.Item) -> Starter | None:
    """The `EARLY_START` entry of `item`'s test function, if its module has one."""
    module = getattr(item, "module", None)
    return getattr(module, "EARLY_START", {}).get(getattr(item, "originalname", None))


def start(starter: Starter) -> tuple[subprocess.Popen | None, Path]:
    """Run `starter` in a new temporary directory: (its process or None, the directory)."""
    work = Path(tempfile.mkdtemp(prefix="litkv-early-"))
    return starter(work), work


def start_selected(items: Iterable[pytest.Item]) -> None:
    """Start the `EARLY_START` processes of `items` (the selected tests), one per test id."""
    for item in items:
        starter = starter_of(item)
        if starter is not None and item.nodeid not in _started:
            _started[item.nodeid] = start(starter)


def take(item: pytest.Item) -> tuple[subprocess.Popen | None, Path]:
    """`item`'s process and directory: the one started with the session, or one started now."""
    started = _started.pop(item.nodeid, None)
    if started is not None:
        return started
    starter = starter_of(item)
    if starter is None:
        raise LookupError(f"{item.nodeid}: its module's EARLY_START names no process for it")
    return start(starter)


def finish(proc: subprocess.Popen | None, work: Path) -> None:
    """Kill `proc` if it still runs, wait for it and remove its directory."""
    if proc is not None:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=30)
    shutil.rmtree(work, ignore_errors=True)


def run_script(work: Path, script: Path, args: Sequence[Path]) -> subprocess.Popen:
    """Start `python script args...` in `work`: one torch thread, this checkout importable, not a rank of an
    outer launcher (no `LOCAL_RANK`); its output in `work/stdout.txt` and `work/stderr.txt`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("LOCAL_RANK", None)
    with (work / "stdout.txt").open("wb") as out, (work / "stderr.txt").open("wb") as err:
        argv = [sys.executable, str(script), *map(str, args)]
        return subprocess.Popen(argv, env=env, cwd=work, stdout=out, stderr=err)


def output_of(proc: subprocess.Popen, work: Path, timeout: float) -> str:
    """Wait for a `run_script` process; its stdout. AssertionError with both outputs' tails unless it exited 0."""
    proc.wait(timeout=timeout)
    stdout, stderr = (work / "stdout.txt").read_text(), (work / "stderr.txt").read_text()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return stdout


def stop_all() -> None:
    """At the end of the session: the processes of tests that did not run (deselected late, `-x`, Ctrl-C)."""
    while _started:
        finish(*_started.popitem()[1])
