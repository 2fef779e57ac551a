"""Checks of user input shared by every module: one wording for every "must be an int >= 1" error.

Messages name the option, what is expected and what was given, on one line. A bool is never taken
for an int (`True` is not a batch size).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "FieldError",
    "check_bool",
    "check_float",
    "check_int",
    "is_int",
    "is_number",
    "one_line",
    "require_file",
    "require_finite_logits",
    "require_int",
]


class FieldError(ValueError):
    """A ValueError about fields of a config dataclass, whose message names them as the API does.

    `fields` lists the field names the message mentions; `as_flags(prefix)` gives the same message with
    each of them written as the command-line flag that sets it (``chunk_size`` -> ``--kv_cache.chunk_size``).
    """

    def __init__(self, message: str, fields: Sequence[str]) -> None:
        super().__init__(message)
        self.fields = tuple(fields)

    def as_flags(self, prefix: str) -> str:
        """The message with each field name (not already part of a longer name) prefixed by `prefix`."""
        message = str(self)
        for name in self.fields:
            message = re.sub(rf"(?<![\w.-]){re.escape(name)}\b", prefix + name, message)
        return message


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_int(name: str, value: object, minimum: int, maximum: int | None = None, note: str = "") -> int:
    """`value` if it is an int in `[minimum, maximum]`, else ValueError naming `name`, the range and `value`.

    Args:
        name: the option as the user knows it.
        value: what was given.
        minimum: smallest allowed value.
        maximum: largest allowed value, or `None`.
        note: words appended to the expectation, e.g. ``" (calls kept)"``.
    """
    if is_int(value) and value >= minimum and (maximum is None or value <= maximum):
        return value  # type: ignore[return-value]
    expected = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    raise ValueError(f"{name} must be an int {expected}{note}, got {value!r}")


def check_int(name: str, value: object, minimum: int) -> None:
    """TypeError unless `value` is an int (not a bool), ValueError if it is below `minimum`."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:  # type: ignore[operator]
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_float(name: str, value: object, minimum: float | None = None, maximum: float | None = None) -> None:
    """TypeError unless `value` is a finite real number, ValueError outside `[minimum, maximum]`."""
    if not is_number(value) or value != value or abs(value) == float("inf"):  # type: ignore[arg-type]
        raise TypeError(f"{name} must be a finite number, got {type(value).__name__} {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):  # type: ignore[operator]
        raise ValueError(f"{name} must be {_range_words(minimum, maximum)}, got {value}")


def _range_words(minimum: float | None, maximum: float | None) -> str:
    """`">= 0.0"`, `"<= 1.0"` or `"in [0.0, 1.0]"`: the range, without a bound that is not there."""
    if maximum is None:
        return f">= {minimum}"
    if minimum is None:
        return f"<= {maximum}"
    return f"in [{minimum}, {maximum}]"


def check_bool(name: str, value: object) -> None:
    """TypeError unless `value` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def require_file(option: str, path: str | Path) -> Path:
    """`path` if it is a file; else FileNotFoundError (missing) or ValueError (a directory or another
    kind), naming the option the user passed it with."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"{option} {str(path)!r} does not exist")
    kind = "a directory" if path.is_dir() else "not a regular file"
    raise ValueError(f"{option} {str(path)!r} is {kind}; it must be a file")


def read_text_file(option: str, path: str | Path) -> str:
    """The UTF-8 text of the file `path` (`require_file`'s errors), or a ValueError naming the option, the
    file and where it stops being UTF-8 (a binary file)."""
    path = require_file(option, path)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{option} {str(path)!r} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
            "give a text file"
        ) from None


def one_line(err: BaseException) -> str:
    """An exception's message on one line (a KeyError's key without quotes); its type name when empty."""
    text = str(err) if not isinstance(err, KeyError) or not err.args else str(err.args[0])
    return " ".join(part.strip() for part in text.strip().splitlines() if part.strip()) or type(err).__name__


def require_finite_logits(finite: bool, step: int) -> None:
    """ValueError when a decode step's logits held NaN/inf (`finite`: all of them finite, read by the
    caller); in a float16 model, an overflow. No token of such a step may be handed out."""
    if not finite:
        raise ValueError(
            f"the model produced NaN/inf logits by decode step {step} (a float16 overflow?); use "
            "--precision bf16-true or 32-true"
        )
