"""The `litkv` command line: `litkv <command> [options]` (also `python -m litkv ...`).

Commands are plain functions whose typed signatures and docstrings jsonargparse turns into options
(`--config file.yaml` works for each). Each command's module is imported only when it is used, so
one command that cannot be imported does not break the others.

`litkv --help` and `litkv COMMAND --help` print the help text stored in `litkv/assets/help/` (written by
`scripts/update_help.py` from the live parsers; `tests/cli/test_startup.py` checks that they match), so
they import neither torch nor any command; `litkv --version` likewise.

Errors in the input (`ValueError`, `TypeError`, `FileNotFoundError` from litkv's checks) are printed
as one line `error: ...` on stderr, without a traceback, and the exit status is 1. Set the
environment variable `LITKV_DEBUG=1` to see the traceback instead.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["COMMANDS", "HELP_DIR", "main", "normalize_argv", "render_help"]

COMMANDS: dict[str, str] = {
    "generate": "litkv.cli.generate_cmd:generate",
    "finetune": "litkv.finetune.cli:finetune",
    "convert": "litkv.cli.convert_cmd:convert",
    "evaluate": "litkv.cli.evaluate_cmd:evaluate",
    "bench": "litkv.cli.bench_cmd:bench",
    "chat": "litkv.cli.chat_cmd:chat",
    "serve": "litkv.cli.serve_cmd:serve",
    "download": "litkv.cli.download_cmd:download",
}

# Commands whose optional first positional argument is `--checkpoint_dir` (as in `litgpt generate DIR`).
CHECKPOINT_POSITIONAL = ("generate", "evaluate", "finetune", "chat", "serve")
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


# Boolean options that may be given bare, as a switch (`--compile` is `--compile true`).
FLAGS = ("--compile",)
REPEATED = ("--prompt", "--block_file")  # options given several times, gathered into one list


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Rewrite command-line shortcuts into what jsonargparse understands.

    - option names may use dashes: `--max-new-tokens` is `--max_new_tokens`;
    - `--kv-cache NAME` / `--kv_cache NAME` is `--kv_cache.policy NAME` (a YAML/JSON value stays);
    - `--kv_cache.OPTION` (not a `KVCacheConfig` field) is the policy option `--kv_cache.options.OPTION`;
    - `--prompt A --prompt B` (repeated) becomes one list `--prompt '["A", "B"]'` (`--block_file` likewise);
    - `litkv generate DIR ...` (and `evaluate`, `finetune`) is `litkv generate --checkpoint_dir DIR ...`;
    - a bare flag in `FLAGS` (`--compile` not followed by a value) is `--compile true`.
    """
    argv = list(argv)
    positional: list[str] = []
    if len(argv) >= 2 and argv[0] in CHECKPOINT_POSITIONAL and not argv[1].startswith("-"):
        positional = ["--checkpoint_dir", argv.pop(1)]  # goes last, so that no --config overrides it
    elif argv and argv[0] in CHECKPOINT_POSITIONAL and _stray_last(argv):
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
        if argv and argv[0] == "evaluate" and name.startswith("--kv_cache.options"):
            option = name.rsplit(".", 1)[-1]
            raise ValueError(
                f"evaluate compares several policies, so a policy option goes to one of them: use "
                f"--policy_options.POLICY.{option} VALUE (e.g. --policy_options.keydiff.{option}), got {token}"
            )
        if name in FLAGS and value is None and (i == len(argv) or argv[i].startswith("-")):
            value = "true"
        if value is None and i < len(argv) and _is_negative_number(argv[i]):
            value, i = argv[i], i + 1  # `--kv_cache.threshold -1e30`: argparse takes -1e30 for an option
        if name in ("--kv_cache", *REPEATED) and value is None and i < len(argv):
            value, i = argv[i], i + 1
        if name in REPEATED and value is not None:
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


def _is_negative_number(token: str) -> bool:
    """Whether `token` is a negative number (`-1e30`, `-inf`, `-.5`) rather than an option."""
    if not token.startswith("-") or token.startswith("--"):
        return False
    try:
        float(token)
    except ValueError:
        return False
    return True


def _stray_last(argv: Sequence[str]) -> bool:
    """Whether the last token of `argv` (command first) stands where an option was expected: a checkpoint
    directory given after the options. `--name value` pairs, `--name=value` and bare `FLAGS` are options."""
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-"):
            return token != "--" and i == len(argv) - 1
        bare_flag = _option_name(token)[0] in FLAGS and (i + 1 == len(argv) or argv[i + 1] not in ("true", "false"))
        i += 1 if "=" in token or bare_flag or not token.startswith("--") else 2
    return False


def _policy_option_name(name: str) -> str:
    """`--kv_cache.sinks` -> `--kv_cache.options.sinks`: a name that is not a `KVCacheConfig` field is a
    policy option (validated by the policy's `Options` dataclass when the config is built)."""
    prefix = "--kv_cache."
    if not name.startswith(prefix):
        return name
    from dataclasses import fields

    from litkv.modeling.config import KVCacheConfig

    head = name[len(prefix) :].split(".", 1)[0]
    if head in {f.name for f in fields(KVCacheConfig)}:
        return name
    return f"{prefix}options.{name[len(prefix) :]}"


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
    module_name, _, attr = COMMANDS[name].partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr)


def _load_components(selected: str | None) -> dict[str, Callable[..., object]]:
    """The chosen command only, or every importable command (for `litkv --help`)."""
    if selected is not None:
        try:
            return {selected: _load_command(selected)}
        except (ImportError, AttributeError) as err:
            raise ImportError(f"command {selected!r} is not available: {err}") from err
    components = {}
    for name in COMMANDS:
        try:
            components[name] = _load_command(name)
        except (ImportError, AttributeError) as err:
            print(f"warning: command {name!r} is not available: {err}", file=sys.stderr)
    return components


def _help_key(argv: Sequence[str]) -> str | None:
    """`"litkv"` for `litkv --help`, `"COMMAND"` for `litkv COMMAND --help`, None for anything else."""
    if len(argv) == 1 and argv[0] in _HELP_FLAGS:
        return "litkv"
    if len(argv) == 2 and argv[0] in COMMANDS and argv[1] in _HELP_FLAGS:
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
    return out.getvalue()


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


def _main(argv: Sequence[str] | None) -> None:
    from jsonargparse import CLI

    debug = os.environ.get("LITKV_DEBUG", "") not in ("", "0")
    try:
        args = normalize_argv(sys.argv[1:] if argv is None else argv)
        selected = args[0] if args and args[0] in COMMANDS else None
        components = _load_components(selected)
        CLI(components, args=args, prog="litkv", description=DESCRIPTION)
    except (*USER_ERRORS, ImportError) as err:
        if debug:
            raise
        print(f"error: {_message(err)}", file=sys.stderr)
        sys.exit(1)


def _message(err: BaseException) -> str:
    """The error on one line; a `FieldError` of the KV-cache config worded with the flags that set its
    fields (every command takes the config as ``--kv_cache``)."""
    from litkv.core.validation import FieldError, one_line

    return " ".join(err.as_flags("--kv_cache.").split()) if isinstance(err, FieldError) else one_line(err)


if __name__ == "__main__":
    main()
