"""The `litkv` command line: `litkv <command> [options]` (also `python -m litkv ...`).

Commands are plain functions whose typed signatures and docstrings jsonargparse turns into options
(`--config file.yaml` works for each). Each command's module declares itself in a literal `COMMAND`
dict (its name, its function and its argv shortcuts: `CommandSpec`), which is read from the module's
source, never by importing it; a command's module is imported only when it is used, so one command
that cannot be imported does not break the others. A new command: one module declaring `COMMAND` plus
its line in `COMMAND_MODULES`, then `python scripts/update_help.py`.

`litkv --help` and `litkv COMMAND --help` print the help text stored in `litkv/assets/help/` (written by
`scripts/update_help.py` from the live parsers; `tests/cli/test_startup.py` checks that they match), so
they import neither torch nor any command; `litkv --version` likewise.

Errors in the arguments that need no model (unknown options, numbers out of range, policy names, missing
input files, unknown checkpoint names) are answered before any command or torch is imported
(`litkv.cli.preflight`). Errors in the input (`ValueError`, `TypeError`, `FileNotFoundError` from litkv's
checks) are printed as one line `error: ...` on stderr, without a traceback, and the exit status is 1. Set the
environment variable `LITKV_DEBUG=1` to see the traceback instead.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import io
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = ["COMMAND_MODULES", "CommandSpec", "HELP_DIR", "commands", "main", "normalize_argv", "render_help"]

#: The command modules, in `litkv --help` order; each declares its `COMMAND` (one line here per command).
COMMAND_MODULES = (
    "litkv.cli.generate_cmd",
    "litkv.cli.finetune_cmd",
    "litkv.cli.convert_cmd",
    "litkv.cli.evaluate_cmd",
    "litkv.cli.bench_cmd",
    "litkv.cli.chat_cmd",
    "litkv.cli.serve_cmd",
    "litkv.cli.download_cmd",
)
_SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the directory holding the `litkv` package


@dataclass(frozen=True)
class CommandSpec:
    """A command as its module declares it: `COMMAND = {"name": ..., "function": ..., <shortcuts>}`.

    The shortcuts `normalize_argv` applies to this command's argv:
    - `checkpoint_positional`: `litkv NAME DIR ...` (or DIR last) is `--checkpoint_dir DIR`, as in LitGPT;
    - `flags`: boolean options that may be given bare (`--compile` is `--compile true`);
    - `repeated`: options given several times, gathered into one JSON list (`--prompt A --prompt B`);
    - `refused`: option-name prefix -> error message (`{option}`: the option's last dotted part,
      `{token}`: what the user typed), for options that parse but make no sense for this command.
    """

    name: str
    module: str
    function: str
    checkpoint_positional: bool = False
    flags: tuple[str, ...] = ()
    repeated: tuple[str, ...] = ()
    refused: Mapping[str, str] | None = None

    @classmethod
    def read(cls, module: str) -> CommandSpec:
        """The `COMMAND` literal of `module`'s source file (never imported: a literal, read by `ast`)."""
        path = _SOURCE_ROOT.joinpath(*module.split(".")).with_suffix(".py")
        lines = path.read_text(encoding="utf-8").splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("COMMAND = ")), None)
        if start is None:
            raise ImportError(f"{path.name} declares no `COMMAND = {{...}}` (litkv/__main__.py's CommandSpec)")
        for end in range(start + 1, len(lines) + 1):  # the shortest run of lines that parses
            try:
                statement = ast.parse("\n".join(lines[start:end])).body[0]
            except SyntaxError:
                continue
            declared = ast.literal_eval(statement.value)  # type: ignore[attr-defined]
            known = {f.name for f in fields(cls)} - {"module"}
            if not isinstance(declared, dict) or not set(declared) <= known:
                raise ImportError(f"{path.name}: COMMAND must be a dict with keys among {sorted(known)}")
            sequences = {key: tuple(declared[key]) for key in ("flags", "repeated") if key in declared}
            return cls(**{**declared, **sequences, "module": module})
        raise ImportError(f"{path.name}: COMMAND = ... does not parse")


@functools.cache
def commands() -> dict[str, CommandSpec]:
    """name -> `CommandSpec` of every module in `COMMAND_MODULES`, in order (read once per process)."""
    specs = [CommandSpec.read(module) for module in COMMAND_MODULES]
    return {spec.name: spec for spec in specs}


DESCRIPTION = (
    "litkv: a LitGPT-style GPT with a pluggable, evicting KV cache. Run `litkv COMMAND --help`; "
    "`litkv --version` prints the version."
)
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError)
_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
#: The stored `--help` texts: `litkv.txt` (the command list) and `COMMAND.txt`.
HELP_DIR = Path(__file__).resolve().parent / "assets" / "help"
HELP_COLUMNS = "100"  # the width the stored help texts are rendered at
_HELP_FLAGS = ("--help", "-h")


def _is_config_value(value: str) -> bool:
    """Whether a `--kv_cache` value is a config (inline mapping or `.yaml`/`.yml`/`.json` file), not a policy.

    Decided by the value alone, never by the files in the working directory: `--kv-cache h2o` is the
    policy `h2o` even where a file named `h2o` exists.
    """
    stripped = value.strip()
    return stripped.startswith("{") or stripped.lower().endswith(_CONFIG_SUFFIXES)


def _option_name(token: str) -> tuple[str, str | None]:
    """`"--kv-cache.cache-length=8"` -> `("--kv_cache.cache_length", "8")`; dashes become underscores."""
    name, eq, value = token.partition("=")
    name = "--" + name[2:].replace("-", "_")
    return name, (value if eq else None)


_NO_COMMAND = CommandSpec(name="", module="", function="")  # argv without a known command: no shortcuts


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Rewrite command-line shortcuts into what jsonargparse understands.

    For every command:
    - option names may use dashes: `--max-new-tokens` is `--max_new_tokens`;
    - `--kv-cache NAME` / `--kv_cache NAME` is `--kv_cache.policy NAME` (a YAML/JSON value stays);
    - `--kv_cache.OPTION` (not a `KVCacheConfig` field) is the policy option `--kv_cache.options.OPTION`.
    Those its module declares (`CommandSpec`): `litkv generate DIR ...` is `litkv generate --checkpoint_dir
    DIR ...`; `--prompt A --prompt B` becomes one list `--prompt '["A", "B"]'`; a bare `--compile` is
    `--compile true`; an option the command refuses is a ValueError.
    """
    argv = list(argv)
    spec = commands().get(argv[0], _NO_COMMAND) if argv else _NO_COMMAND
    positional: list[str] = []
    if len(argv) >= 2 and spec.checkpoint_positional and not argv[1].startswith("-"):
        positional = ["--checkpoint_dir", argv.pop(1)]  # goes last, so that no --config overrides it
    elif spec.checkpoint_positional and _stray_last(argv, spec.flags):
        positional = ["--checkpoint_dir", argv.pop()]  # `litkv generate --prompt hi DIR`
    out: list[str] = []
    repeated: dict[str, list[str]] = {}  # `--prompt` and `--block_file` values, in order
    repeated_at: dict[str, int] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            out.extend(argv[i - 1 :])
            break
        if not token.startswith("--") or len(token) == 2:
            out.append(token)
            continue
        name, value = _option_name(token)
        name = _policy_option_name(name)
        _check_not_refused(spec, name, token)
        if name in spec.flags and value is None and (i == len(argv) or argv[i].startswith("-")):
            value = "true"
        if value is None and i < len(argv) and _is_negative_number(argv[i]):
            value, i = argv[i], i + 1  # `--kv_cache.threshold -1e30`: argparse takes -1e30 for an option
        if name in ("--kv_cache", *spec.repeated) and value is None and i < len(argv):
            value, i = argv[i], i + 1
        if name.startswith("--kv_cache.options."):
            _check_option_literal(name, value if value is not None or i == len(argv) else argv[i])
        if name in spec.repeated and value is not None:
            repeated_at.setdefault(name, len(out))
            repeated.setdefault(name, []).append(value)
        elif name == "--kv_cache" and value is not None:
            out.extend([name, value] if _is_config_value(value) else ["--kv_cache.policy", value])
        else:
            out.append(name if value is None else f"{name}={value}")
    _check_utf8(repeated.get("--prompt", []))
    for name in sorted(repeated_at, key=repeated_at.__getitem__, reverse=True):  # later insertions first
        # ensure_ascii=False: non-BMP characters (emoji) stay as they are; escaped, they would become
        # surrogate pairs that jsonargparse's YAML loader refuses.
        out[repeated_at[name] : repeated_at[name]] = [name, json.dumps(repeated[name], ensure_ascii=False)]
    return out + positional


#: YAML 1.1 words jsonargparse reads as booleans where a policy option (typed `Any`) is parsed.
_YAML_BOOL_WORDS = frozenset({"yes", "no", "on", "off", "y", "n"})


def _check_option_literal(name: str, value: str | None) -> None:
    """ValueError for a policy option given a YAML 1.1 boolean word (`--kv_cache.across_layers yes`): it
    would arrive as `True` without a word; options take `true` / `false` (strict types)."""
    if value is not None and value.lower() in _YAML_BOOL_WORDS:
        option = name.rsplit(".", 1)[-1]
        raise ValueError(f"--kv_cache.{option} {value!r}: a policy option takes true or false, not {value!r}")


def _is_negative_number(token: str) -> bool:
    """Whether `token` is a negative number (`-1e30`, `-inf`, `-.5`) rather than an option."""
    if not token.startswith("-") or token.startswith("--"):
        return False
    try:
        float(token)
    except ValueError:
        return False
    return True


def _check_not_refused(spec: CommandSpec, name: str, token: str) -> None:
    """ValueError with the command's message when option `name` (typed as `token`) is one it refuses."""
    for prefix, message in (spec.refused or {}).items():
        if name.startswith(prefix):
            raise ValueError(message.format(option=name.rsplit(".", 1)[-1], token=token))


def _stray_last(argv: Sequence[str], flags: Sequence[str]) -> bool:
    """Whether the last token of `argv` (command first) stands where an option was expected: a checkpoint
    directory given after the options. `--name value` pairs, `--name=value` and bare `flags` are options."""
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-"):
            return token != "--" and i == len(argv) - 1
        bare_flag = _option_name(token)[0] in flags and (i + 1 == len(argv) or argv[i + 1] not in ("true", "false"))
        i += 1 if "=" in token or bare_flag or not token.startswith("--") else 2
    return False


def _policy_option_name(name: str) -> str:
    """`--kv_cache.sinks` -> `--kv_cache.options.sinks`: a name that is not a `KVCacheConfig` field is a
    policy option (validated by the policy's `Options` dataclass when the config is built)."""
    prefix = "--kv_cache."
    if not name.startswith(prefix):
        return name
    head = name[len(prefix) :].split(".", 1)[0]
    if head in _kv_cache_fields():
        return name
    return f"{prefix}options.{name[len(prefix) :]}"


@functools.cache
def _kv_cache_fields() -> frozenset[str]:
    """`KVCacheConfig`'s field names, from the stored help of `generate` (no torch import); from the class
    where no help is stored."""
    from litkv.cli.preflight import command_options

    prefix = "--kv_cache."
    stored = {name[len(prefix) :] for name in command_options("generate") if name.startswith(prefix)}
    if stored:
        return frozenset(stored)
    from litkv.modeling.config import KVCacheConfig

    return frozenset(f.name for f in fields(KVCacheConfig))


def _check_utf8(prompts: Sequence[str]) -> None:
    """ValueError for a prompt with bytes that are not UTF-8 (Python keeps them as lone surrogates)."""
    for i, text in enumerate(prompts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"--prompt {i} is not valid UTF-8 text (bad byte at character {err.start}: "
                f"{text[max(err.start - 10, 0) : err.start]!r}...); use --prompt_file for other encodings"
            ) from None


def _load_command(name: str) -> Callable[..., object]:
    spec = commands()[name]
    return getattr(importlib.import_module(spec.module), spec.function)


def _load_components(selected: str | None) -> dict[str, Callable[..., object]]:
    """The chosen command only, or every importable command (for `litkv --help`)."""
    if selected is not None:
        try:
            return {selected: _load_command(selected)}
        except (ImportError, AttributeError) as err:
            raise ImportError(f"command {selected!r} is not available: {err}") from err
    components = {}
    for name in commands():
        try:
            components[name] = _load_command(name)
        except (ImportError, AttributeError) as err:
            print(f"warning: command {name!r} is not available: {err}", file=sys.stderr)
    return components


def _help_key(argv: Sequence[str]) -> str | None:
    """`"litkv"` for `litkv --help`, `"COMMAND"` for `litkv COMMAND --help`, None for anything else."""
    if len(argv) == 1 and argv[0] in _HELP_FLAGS:
        return "litkv"
    if len(argv) == 2 and argv[0] in commands() and argv[1] in _HELP_FLAGS:
        return argv[0]
    return None


def render_help(key: str) -> str:
    """The live help text of `key` (`"litkv"` or a command), rendered by jsonargparse at `HELP_COLUMNS`
    columns: what `scripts/update_help.py` stores in `HELP_DIR`."""
    from jsonargparse import CLI

    selected = None if key == "litkv" else key
    args = ["--help"] if selected is None else [selected, "--help"]
    out = io.StringIO()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            CLI(_load_components(selected), args=args, prog="litkv", description=DESCRIPTION)
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    text = out.getvalue()
    return (
        text if selected is None or not commands()[selected].checkpoint_positional else _with_positional(text, selected)
    )


def _with_positional(text: str, name: str) -> str:
    """`name`'s help with the checkpoint positional in its usage (`litkv generate [CHECKPOINT] ...`) and a
    line saying what it is (`normalize_argv` turns it into `--checkpoint_dir`)."""
    head = f"usage: litkv [options] {name} "
    usage, _, rest = text.partition("\n\n")
    usage = usage.replace(head, f"{head}[CHECKPOINT] ", 1).replace(
        "\n ", "\n" + " " * (len("[CHECKPOINT] ") + 1), usage.count("\n")
    )
    note = (
        f"CHECKPOINT (first or last): a checkpoint directory or a known model name (smollm2-135m-instruct);\n"
        f"the same as --checkpoint_dir. E.g. `litkv {name} smollm2-135m-instruct ...`."
    )
    return f"{usage}\n\n{note}\n\n{rest}"


def _quick_answer(argv: Sequence[str]) -> bool:
    """Answer `--version` and a stored `--help` without importing any command; True when answered."""
    if list(argv) in (["--version"], ["-V"]):
        from litkv import __version__

        print(f"litkv {__version__}")
        return True
    key = _help_key(argv)
    path = HELP_DIR / f"{key}.txt"
    if key is None or not path.is_file():
        return False
    sys.stdout.write(path.read_text(encoding="utf-8"))
    return True


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `litkv` console script. Ctrl-C at any moment (imports included) exits with
    status 130 and no traceback."""
    try:
        if _quick_answer(sys.argv[1:] if argv is None else argv):
            return
        _main(argv)
    except KeyboardInterrupt:
        if os.environ.get("LITKV_DEBUG", "") not in ("", "0"):
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: object = None,
) -> None:
    """`warnings.showwarning` of the command line: one line `warning: MESSAGE` on stderr, without the category,
    the source file and its line (`LITKV_DEBUG=1` keeps Python's own format)."""
    print(f"warning: {' '.join(str(message).split())}", file=sys.stderr, flush=True)


def _main(argv: Sequence[str] | None) -> None:
    import warnings

    from litkv.cli import preflight

    debug = os.environ.get("LITKV_DEBUG", "") not in ("", "0")
    previous = warnings.showwarning
    if not debug:
        warnings.showwarning = show_warning  # for this command only: put back when it returns
    try:
        args = normalize_argv(sys.argv[1:] if argv is None else argv)
        selected = args[0] if args and args[0] in commands() else None
        if selected is not None:
            preflight.check(args)  # before jsonargparse, the command's module and torch are imported
        from jsonargparse import CLI

        components = _load_components(selected)
        CLI(components, args=args, prog="litkv", description=DESCRIPTION)
    except (*USER_ERRORS, ImportError) as err:
        if debug:
            raise
        print(f"error: {_message(err)}", file=sys.stderr)
        sys.exit(1)
    finally:
        warnings.showwarning = previous


def _message(err: BaseException) -> str:
    """The error on one line; a `FieldError` of the KV-cache config worded with the flags that set its
    fields (every command takes the config as ``--kv_cache``)."""
    from litkv.core.validation import FieldError, one_line

    return " ".join(err.as_flags("--kv_cache.").split()) if isinstance(err, FieldError) else one_line(err)


if __name__ == "__main__":
    main()
