"""scripts/setup_time.sh (re-makes the README's set-up time figure; a real run takes about 12 min, so only its
argument handling and its dry run are tested): the README's command and its steps, caches of its own that
must be empty, one-line refusals with exit status 2, and a dry run that makes nothing."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "setup_time.sh"


def run(*args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SETUP_TIME_HOME"}
    if home is not None:
        env["SETUP_TIME_HOME"] = str(home)
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_dry_run_prints_the_readme_command_its_steps_and_own_caches(tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = run("--dry-run", str(work))
    assert proc.returncode == 0, proc.stderr
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = next(b.strip() for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "pip install" in b)
    lines = proc.stdout.splitlines()
    assert f"command: {first}" in lines
    steps = [line.split(": ", 1)[1] for line in lines if line.startswith("step ")]
    assert " && ".join(steps) == first and len(steps) >= 3 and steps[0].startswith("pip install torch")
    assert f"LITKV_HOME: {work}/litkv-home" in lines and f"PIP_CACHE_DIR: {work}/pip-cache" in lines
    assert "runs: cold, warm" in lines and lines[-1] == "dry run: nothing was made"
    assert not work.exists()  # nothing made
    assert "runs: cold" in run("--dry-run", "--cold-only", str(work)).stdout.splitlines()


def test_the_model_cache_comes_from_setup_time_home_and_must_be_empty(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = run("--dry-run", str(tmp_path / "w"), home=home)
    assert proc.returncode == 0 and f"LITKV_HOME: {home}" in proc.stdout.splitlines()
    home.mkdir()
    (home / "checkpoints").mkdir()  # someone's cache: never used, filled or wiped
    proc = run("--dry-run", home=home)
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr.strip()
        == f"setup_time: SETUP_TIME_HOME {home} is not empty (the cold run needs an empty model cache)"
    )
    assert (home / "checkpoints").is_dir()


def test_usage_errors_are_one_line_with_status_2(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("")
    for args, message in [
        (["--bogus"], "setup_time: unknown option --bogus (see --help)"),
        (["a", "b"], "setup_time: one WORKDIR at most, got 'a' and 'b'"),
        ([str(tmp_path)], f"setup_time: WORKDIR {tmp_path} is not empty"),
    ]:
        proc = run(*args)
        assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (2, message, ""), args
    proc = run("--help")
    assert proc.returncode == 0 and "--dry-run" in proc.stdout and "SETUP_TIME_HOME" in proc.stdout
    assert "set -euo" not in proc.stdout  # the header only
