"""Commands declared once: each command module's literal `COMMAND` (name, function, argv shortcuts) is read
from its source without importing it, and a new command is one module plus its line in `COMMAND_MODULES`."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import litkv.__main__ as cli_main
from litkv.__main__ import COMMAND_MODULES, CommandSpec, commands, main, normalize_argv

REPO = Path(__file__).resolve().parents[2]

TOY = '''"""A toy command."""

import json
from pathlib import Path

__all__ = ["toy"]

COMMAND = {
    "name": "toy",
    "function": "toy",
    "checkpoint_positional": True,
    "flags": ["--loud"],
    "repeated": ["--word"],
    "refused": {"--kv_cache.options": "toy has no {option} (got {token})"},
}


def toy(checkpoint_dir: Path | None = None, word: list[str] | None = None, loud: bool = False) -> None:
    """Print the arguments.

    Args:
        checkpoint_dir: A directory.
        word: Words.
        loud: Shout.
    """
    print(json.dumps({"checkpoint_dir": str(checkpoint_dir), "word": word, "loud": loud}))
'''


@pytest.fixture()
def fresh_commands() -> Iterator[None]:
    commands.cache_clear()
    yield
    commands.cache_clear()


def test_every_command_module_is_listed_and_declares_an_existing_function() -> None:
    modules = {f"litkv.cli.{path.stem}" for path in (REPO / "litkv" / "cli").glob("*_cmd.py")}
    assert modules <= set(COMMAND_MODULES), "a litkv/cli/*_cmd.py module missing from COMMAND_MODULES"
    specs = commands()
    assert [spec.module for spec in specs.values()] == list(COMMAND_MODULES)  # names unique, order kept
    for name, spec in specs.items():
        assert callable(getattr(importlib.import_module(spec.module), spec.function)), name
    assert specs["generate"].flags == ("--compile",) and specs["evaluate"].refused
    assert not specs["convert"].checkpoint_positional and specs["serve"].checkpoint_positional
    with pytest.raises(ValueError, match=r"use --policy_options.POLICY.sinks VALUE .*got --kv-cache.sinks"):
        normalize_argv(["evaluate", "--kv-cache.sinks", "4"])  # evaluate's declared refusal
    assert normalize_argv(["generate", "--kv-cache.sinks", "4"]) == ["generate", "--kv_cache.options.sinks", "4"]


def test_a_new_command_is_one_module_and_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_commands: None, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "toypkg").mkdir()
    (tmp_path / "toypkg" / "__init__.py").write_text("")
    (tmp_path / "toypkg" / "toy_cmd.py").write_text(TOY)
    monkeypatch.setattr(cli_main, "_SOURCE_ROOT", tmp_path)
    monkeypatch.setattr(cli_main, "COMMAND_MODULES", ("toypkg.toy_cmd",))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "toypkg.toy_cmd" not in sys.modules
    assert list(commands()) == ["toy"] and "toypkg.toy_cmd" not in sys.modules  # declared, not imported
    main(["toy", "--word", "a", "--loud", "--word=b", "DIR"])
    assert json.loads(capsys.readouterr().out) == {"checkpoint_dir": "DIR", "word": ["a", "b"], "loud": True}
    with pytest.raises(ValueError, match=r"toy has no sinks \(got --kv-cache.sinks\)"):
        normalize_argv(["toy", "--kv-cache.sinks", "2"])
    assert normalize_argv(["generate", "--compile"]) == ["generate", "--compile"]  # not toy's: no shortcut


def test_a_bad_declaration_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_main, "_SOURCE_ROOT", tmp_path)
    (tmp_path / "none_cmd.py").write_text('"""No declaration."""\n\nNAME = "x"\n')
    with pytest.raises(ImportError, match=r"none_cmd.py declares no `COMMAND"):
        CommandSpec.read("none_cmd")
    (tmp_path / "odd_cmd.py").write_text(
        'COMMAND = {\n    "name": "odd",\n    "function": "odd",\n    "alias": "o",\n}\n'
    )
    with pytest.raises(ImportError, match=r"odd_cmd.py: COMMAND must be a dict with keys among"):
        CommandSpec.read("odd_cmd")
    (tmp_path / "call_cmd.py").write_text('COMMAND = dict(name="call", function="call")\n')
    with pytest.raises(ValueError, match="malformed"):  # a call is not a literal: never evaluated
        CommandSpec.read("call_cmd")
