"""The Jinja environment chat templates render in: transformers' sandbox with a budget on work and size.

A chat template is data from a checkpoint someone downloaded, rendered every turn by `generate`, `chat` and
`serve`; Jinja's sandbox stops it reaching Python's internals but not from looping `range(100000)` inside
`range(100000)` or doubling a string forty times. `render_bounded` renders under a `Budget`:

- **Steps**: every loop iteration, call (functions, macros, methods, filters), attribute or item lookup
  costs one; a render may take `max_steps`, and `max_seconds` of wall time (checked at each step).
- **Size**: the output, every string or list a call, a filter, an operator or a lookup returns, and
  every integer argument (a width, a count) are at most `max_chars`; `*`, `+` and `**` are checked before
  they compute, and a format width of seven digits or more is refused before it pads.

Going over raises `BudgetExceeded` (a `jinja2.TemplateError`), which `ChatTemplate` reports in one line
naming the template's file. The budget is per render (a `ContextVar`), so threads rendering at once do
not share it.
"""

from __future__ import annotations

import contextvars
import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

__all__ = ["Budget", "BudgetExceeded", "compile_bounded", "make_sandbox", "render_bounded"]

_LOOP = "litkv_counted_loop"  # the global every `for` loop's iterable is wrapped in
_WIDTH = re.compile(r"[{%][^{}%]*?\d{7,}")  # a format width or precision of 7+ digits
_CURRENT: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("litkv_template_budget", default=None)


class BudgetExceeded(TemplateError):
    """A template that went over its `Budget`."""


@dataclass
class Budget:
    """What one render may take (module docstring); `steps` and `start` are its running count."""

    max_steps: int = 1_000_000
    max_chars: int = 1 << 24
    max_seconds: float = 5.0
    steps: int = 0
    start: float = field(default_factory=time.monotonic)

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise BudgetExceeded(f"the chat template took more than {self.max_steps} steps (loop iterations, calls)")
        if self.steps % 1024 == 0 and time.monotonic() - self.start > self.max_seconds:
            raise BudgetExceeded(f"the chat template ran longer than {self.max_seconds:g} s")

    def size(self, value: Any, what: str) -> Any:
        if isinstance(value, str | list | tuple | dict) and len(value) > self.max_chars:
            raise BudgetExceeded(f"{what} of {len(value)} items is over the chat template's limit of {self.max_chars}")
        return value

    def argument(self, value: Any, what: str) -> None:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.max_chars:
            raise BudgetExceeded(f"{what} was given {value}, over the chat template's limit of {self.max_chars}")
        self.size(value, what)


def _budget() -> Budget:
    budget = _CURRENT.get()
    return budget if budget is not None else Budget()  # outside render_bounded: a fresh default budget


def _counted(iterable: Any) -> Iterable[Any]:
    return _CountedLoop(iterable, _budget())


class _CountedLoop:
    """An iterable that costs one step per item (`len` kept for `loop.length`)."""

    def __init__(self, iterable: Any, budget: Budget) -> None:
        self._iterable, self._budget = iterable, budget

    def __len__(self) -> int:
        return len(self._iterable)

    def __iter__(self) -> Iterator[Any]:
        for item in self._iterable:
            self._budget.step()
            yield item


def _check_size_of_binop(operator: str, left: Any, right: Any) -> None:
    budget = _budget()
    budget.step()
    sized = (str, list, tuple)
    if operator == "*":
        seq, count = (left, right) if isinstance(left, sized) else (right, left)
        if isinstance(seq, sized) and isinstance(count, int) and len(seq) * max(count, 0) > budget.max_chars:
            raise BudgetExceeded(f"repeating {len(seq)} items {count} times is over the limit of {budget.max_chars}")
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        budget.size(left, "an operand of +")
        budget.size(right, "an operand of +")
    elif operator == "**" and isinstance(right, int | float) and abs(right) > 1024:
        raise BudgetExceeded(f"an exponent of {right} is over the chat template's limit of 1024")
    elif operator == "%" and isinstance(left, str) and _WIDTH.search(left):
        raise BudgetExceeded("a format width of seven or more digits is over the chat template's limit")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox (`trim_blocks`, `lstrip_blocks`), metered by the current `Budget`; reaching for
    an unsafe attribute fails at once (jinja's sandbox would render it as empty text)."""

    intercepted_binops = frozenset(["*", "+", "**", "%"])

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_size_of_binop(operator, left, right)
        return _budget().size(super().call_binop(context, operator, left, right), f"the result of {operator}")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().step()
        return _budget().size(super().getattr(obj, attribute), f"attribute {attribute!r}")

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().step()
        return _budget().size(super().getitem(obj, argument), "an item")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.step()
        name = getattr(__obj, "__name__", type(__obj).__name__)
        for value in (*args, *kwargs.values()):
            budget.argument(value, f"{name}()")
        if name == "replace" and isinstance(getattr(__obj, "__self__", None), str) and len(args) >= 2:
            text, old, new = __obj.__self__, str(args[0]), str(args[1])
            grown = (text.count(old) if old else len(text) + 1) * max(len(new) - len(old), 0)
            if len(text) + grown > budget.max_chars:
                raise BudgetExceeded(f"replace() would make {len(text) + grown} characters, over {budget.max_chars}")
        return budget.size(super().call(__context, __obj, *args, **kwargs), f"the result of {name}()")

    def wrap_str_format(self, value: Any) -> Any:
        text = getattr(value, "__self__", None)
        if isinstance(text, str) and getattr(value, "__name__", "") in ("format", "format_map") and _WIDTH.search(text):
            raise BudgetExceeded("a format width of seven or more digits is over the chat template's limit")
        return super().wrap_str_format(value)


def _metered_filter(func: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(func)  # keeps jinja's pass_context / pass_eval_context marks
    def metered(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        for value in (*args, *kwargs.values()):
            budget.argument(value, f"filter {name!r}")
        return budget.size(func(*args, **kwargs), f"the result of filter {name!r}")

    return metered


def make_sandbox() -> BoundedSandbox:
    """The environment, its filters metered and `for` loops counted (`compile_bounded`)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.filters = {name: _metered_filter(f, name) for name, f in env.filters.items()}
    env.globals[_LOOP] = _counted
    return env


def compile_bounded(env: BoundedSandbox, source: str) -> Any:
    """`source` compiled with every `for` loop's iterable wrapped in a step-counting one."""
    tree = env.parse(source)
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Call(nodes.Name(_LOOP, "load"), [loop.iter], [], None, None, lineno=loop.lineno)
    return env.from_string(tree)


def render_bounded(template: Any, budget: Budget, **variables: Any) -> str:
    """`template` rendered with `variables` under `budget` (the output's length checked as it is made)."""
    token = _CURRENT.set(budget)
    try:
        out, length = [], 0
        for piece in template.generate(**variables):
            length += len(piece)
            if length > budget.max_chars:
                raise BudgetExceeded(f"the chat template wrote more than {budget.max_chars} characters")
            budget.step()
            out.append(piece)
        return "".join(out)
    finally:
        _CURRENT.reset(token)
