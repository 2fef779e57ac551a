"""A CLI that starts at once: `import litkv`, `litkv --help`, `litkv COMMAND --help` and `litkv --version`
import neither torch nor LitGPT, Lightning or transformers, and the stored help texts they print are the
live parsers' help (`scripts/update_help.py` rewrites them). Startup times: `scripts/startup_time.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from litkv.__main__ import HELP_DIR, commands, main, render_help

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "litgpt", "lightning", "transformers", "jsonargparse")


def _modules_after(code: str) -> tuple[str, set[str]]:
    """Run `code` in a fresh interpreter; its stdout and which of `HEAVY` it imported."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out, _, last = proc.stdout.rstrip("\n").rpartition("\n")
    return out, set(json.loads(last))


def test_import_litkv_imports_nothing_heavy() -> None:
    out, heavy = _modules_after("import litkv\nprint(litkv.__version__)")
    assert heavy == set() and out == version("litkv")


def test_a_public_name_is_imported_on_first_use() -> None:
    import litkv
    from litkv.modeling.model import GPT

    assert litkv.GPT is GPT and "GPT" in dir(litkv) and "load" in litkv.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = litkv.nope


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "-h"], ["--version"]])
def test_help_and_version_import_nothing_heavy(argv: list[str]) -> None:
    code = f"from litkv.__main__ import main\nmain({argv!r})"
    out, heavy = _modules_after(code)
    assert heavy == set()
    if argv == ["--version"]:
        assert out == f"litkv {version('litkv')}"
    else:
        key = "litkv" if argv == ["--help"] else argv[0]
        assert out + "\n" == (HELP_DIR / f"{key}.txt").read_text(encoding="utf-8")


@pytest.mark.parametrize("key", ["litkv", *commands()])
def test_stored_help_is_the_live_help(key: str) -> None:
    """A changed signature or docstring without `python scripts/update_help.py` fails here."""
    stored = (HELP_DIR / f"{key}.txt").read_text(encoding="utf-8")
    assert stored == render_help(key), f"run `python scripts/update_help.py`: the stored {key} help is stale"
    assert "usage: litkv" in stored and "/work/" not in stored and "/root/" not in stored


def test_help_with_other_options_uses_the_live_parser(capsys: pytest.CaptureFixture[str]) -> None:
    """Only a bare `--help` is answered from the stored text; with a config file the parser answers."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--config", str(REPO / "configs" / "generate.yaml"), "--help"])
    assert exc.value.code == 0 and "--kv_cache.policy" in capsys.readouterr().out
