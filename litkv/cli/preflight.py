"""Argument checks that answer before torch is imported: a typo costs a fraction of a second, not the import.

`check(args)` reads the command's options and their types from its stored help text (`litkv/assets/help/`,
kept equal to the live parser's help by `tests/cli/test_startup.py`) and refuses, each in one line naming
what the user gave:

- an option the command does not have (with the closest names, `difflib`);
- a number option given something that is not a number of its type, or a value outside the range the
  command itself would refuse (`NUMBER_RANGES`: the same bounds as the command's own checks);
- a policy name that is neither registered (`litkv/assets/help/policies.txt`) nor a `module:Class` path;
- an input file (`--prompt_file`, `--block_file`) that is missing or not a file;
- a checkpoint that is neither an existing path nor a known model name (with the closest known names).

Anything it does not know it leaves to the command (whose own checks stay the reference): it only ever
refuses what the command would refuse later.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from litkv.core.validation import require_file

__all__ = ["NUMBER_RANGES", "check", "command_options", "known_policy_names"]

HELP_DIR = Path(__file__).resolve().parent.parent / "assets" / "help"
POLICIES_FILE = HELP_DIR / "policies.txt"
_NULLS = ("null", "none", "None", "~", "Null", "NULL")
_YAML_FLOATS = (
    {  # YAML's spellings of the special floats (jsonargparse reads values as YAML)
        f"{sign}.{word}": f"{sign}{word[:3]}" for sign in ("", "+", "-") for word in ("inf", "Inf", "INF")
    }
    | {".nan": "nan", ".NaN": "nan", ".NAN": "nan"}
)

#: option (without `--`) -> (minimum, maximum, minimum excluded, what it is): the bounds the commands check
#: themselves (`litkv.inference.sampling`, `litkv.kvcache.config`, `litkv.cli.serve_cmd`, ...).
NUMBER_RANGES: dict[str, tuple[float | None, float | None, bool, str]] = {
    "max_new_tokens": (0, None, False, "an int >= 0"),
    "temperature": (0, None, False, "a finite float >= 0 (0: greedy)"),
    "top_k": (1, None, False, "an int >= 1 or null"),
    "top_p": (0, 1, True, "a float in (0, 1] or null"),
    "num_threads": (1, None, False, "an int >= 1"),
    "recompute": (0, 1, False, "a fraction in [0, 1] (0: pure splice)"),
    "kv_cache.cache_length": (1, None, False, ">= 1"),
    "kv_cache.chunk_size": (1, None, False, ">= 1"),
    "kv_cache.prefill_length": (1, None, False, ">= 1"),
    "kv_cache.quant_group_size": (1, None, False, ">= 1"),
    "max_batch": (1, None, False, "an int >= 1"),
    "max_tokens": (1, None, False, "an int >= 1"),
    "default_max_tokens": (1, None, False, "an int >= 1"),
    "max_prompt_tokens": (1, None, False, "an int >= 1"),
}
#: (command, option) -> the values it takes.
CHOICES: dict[tuple[str, str], tuple[str, ...]] = {("generate", "--output"): ("text", "jsonl")}
#: Options whose value is a file the command reads -> what its errors call it (as the command's own do).
INPUT_FILES = {"--prompt_file": "prompt file", "--block_file": "block file"}


@functools.cache
def command_options(command: str) -> dict[str, str]:
    """`--name` -> its type as the stored help prints it (`"int | None"`; `""` when it shows none), for every
    option of `command`'s stored help text; empty when there is no stored text."""
    path = HELP_DIR / f"{command}.txt"
    if not path.is_file():
        return {}
    options: dict[str, str] = {}
    names: list[str] = []
    body: list[str] = []

    def close() -> None:
        found = re.search(r"\(type: (.*?), default:", " ".join(" ".join(body).split()))
        for name in names:
            options[name.rstrip("+")] = found.group(1) if found else ""

    for line in path.read_text(encoding="utf-8").splitlines():
        if re.match(r"  -", line):  # an option's own line: its names, then maybe the start of its text
            close()
            head, _, rest = line.strip().partition("  ")
            names, body = re.findall(r"--[\w.+-]+", head), [rest]
        elif line.startswith("   ") and names:
            body.append(line)
        else:
            close()
            names, body = [], []
    close()
    return options


@functools.cache
def known_policy_names() -> tuple[str, ...]:
    """The registered policy names, as `scripts/update_help.py` stored them (`litkv.kvcache.known_policies()`)."""
    if not POLICIES_FILE.is_file():
        return ()
    return tuple(line.strip() for line in POLICIES_FILE.read_text(encoding="utf-8").splitlines() if line.strip())


def did_you_mean(given: str, known: Sequence[str]) -> str:
    """`"; did you mean X?"` (the closest of `known`, `difflib`), or `""`."""
    from litkv.checkpoints.known import did_you_mean as closest

    return closest(given, known)


def check(args: Sequence[str]) -> None:
    """Refuse (ValueError, FileNotFoundError) what the command `args[0]` would refuse, without importing it.

    `args`: the command line after `litkv.__main__.normalize_argv` (the command first, options with
    underscores, repeated options gathered into one JSON list, the checkpoint as `--checkpoint_dir`).
    """
    if not args:
        return
    options = command_options(args[0])
    if not options:
        return
    for given, value in _pairs(args[1:]):
        if given in ("-h", "--help") or given.startswith("--print_config"):
            continue
        name = _resolve(args[0], given.rstrip("+"), options)
        if name is None or value is None:
            continue
        choices = CHOICES.get((args[0], name))
        if choices is not None and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}{did_you_mean(value, choices)}")
        _check_value(name, options[name], value)


def _resolve(command: str, name: str, options: dict[str, str]) -> str | None:
    """The option `name` stands for: itself, or the one option it abbreviates (as argparse allows); None for a
    key inside a dict or group option (`--kv_cache.options.sinks`, `--policy_options.h2o.recent`), left to the
    command. ValueError for a name that is none of these, or that abbreviates several options."""
    if name in options:
        return name
    if any(name.startswith(f"{option}.") for option in options):
        return None
    starting = [option for option in options if option.startswith(name)]
    if len(starting) == 1:
        return starting[0]
    if starting:
        raise ValueError(f"litkv {command}: {name} is ambiguous; it could be {', '.join(starting)}")
    known = [option for option in options if option != "--help"]
    raise ValueError(
        f"litkv {command} has no option {name}{did_you_mean(name, known)} (`litkv {command} --help` lists them)"
    )


def _pairs(tokens: Sequence[str]) -> list[tuple[str, str | None]]:
    """The options of `tokens` as (name, value or None); positional tokens and all after `--` are skipped."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            break
        if not token.startswith("-"):
            continue
        name, eq, value = token.partition("=")
        if eq:
            pairs.append((name, value))
        elif i < len(tokens) and not tokens[i].startswith("--"):
            pairs.append((name, tokens[i]))
            i += 1
        else:
            pairs.append((name, None))
    return pairs


def _check_value(name: str, kind: str, value: str) -> None:
    """ValueError/FileNotFoundError for `value` of option `name` (whose help shows type `kind`)."""
    optional = "None" in kind or "Optional" in kind
    if value in _NULLS and optional:
        return
    if name == "--kv_cache.policy":
        _check_policy(value)
    elif name in INPUT_FILES:
        for path in _listed(value):
            require_file(INPUT_FILES[name], path)
    elif name == "--checkpoint_dir":
        _check_checkpoint(value)
    base = re.sub(r"\bOptional\[(.*)\]", r"\1", kind).replace("| None", "").strip()
    if base in ("int", "float"):
        _check_number(name, base, value)


def _listed(value: str) -> list[str]:
    """A repeated option's values (a JSON list after `normalize_argv`), or the one value."""
    if value.startswith("["):
        try:
            items = json.loads(value)
        except ValueError:
            return []
        return [str(item) for item in items] if isinstance(items, list) else []
    return [value]


def _check_number(name: str, base: str, value: str) -> None:
    text = _YAML_FLOATS.get(value, value) if base == "float" else value
    try:
        number: float = int(value.replace("_", "")) if base == "int" else float(text)
    except ValueError:
        raise ValueError(f"{name} takes {'an int' if base == 'int' else 'a number'}, got {value!r}") from None
    bounds = NUMBER_RANGES.get(name[2:])
    if bounds is None:
        return
    low, high, low_excluded, expected = bounds
    too_low = low is not None and (number <= low if low_excluded else number < low)
    if not math.isfinite(number) or too_low or (high is not None and number > high):
        shown = _YAML_FLOATS.get(value, value) if base == "float" else value
        raise ValueError(f"{name} must be {expected}, got {shown}")


def _check_policy(value: str) -> None:
    known = known_policy_names()
    if known and ":" not in value and value not in known:
        raise ValueError(
            f"unknown KV cache policy {value!r}; known policies: {', '.join(known)}{did_you_mean(value, known)}"
        )


def _check_checkpoint(value: str) -> None:
    from litkv.checkpoints.known import MODELS, unknown_checkpoint_message  # no torch

    if Path(value).exists() or value in MODELS:
        return
    raise FileNotFoundError(unknown_checkpoint_message(value))
