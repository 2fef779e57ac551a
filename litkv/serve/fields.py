"""The fields of an OpenAI chat request that `litkv serve` does not implement: each is refused (400,
naming the field) unless it asks for what the server does anyway, never silently ignored.

A field is accepted when absent, null, or set to its no-op value (a penalty of 0, `response_format`
`{"type": "text"}`, `logprobs: false`, ...). `user` and `stream_options` are accepted (the last
streamed chunk always carries the usage). Any other field OpenAI's API has and litkv does not, and any
unknown field, is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

__all__ = ["IGNORED", "NO_OP", "unsupported_field"]


def _value(value: Any) -> Any:
    """A pydantic model or enum as plain data (`{"type": "text"}`, `"auto"`)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    return value.value if isinstance(value, Enum) else value


#: Fields litkv does not implement, with the test of the value that asks for nothing.
NO_OP: Mapping[str, Callable[[Any], bool]] = {
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "logit_bias": lambda v: not v,
    "logprobs": lambda v: v is False,
    "top_logprobs": lambda v: v == 0,
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "tool_choice": lambda v: v in ("auto", "none"),
    "function_call": lambda v: v in ("auto", "none"),
    "parallel_tool_calls": lambda v: False,
    "response_format": lambda v: v == {"type": "text"},
    "reasoning_effort": lambda v: False,
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: False,
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
}
#: Fields accepted whatever their value (no effect on the reply, or what the server does anyway).
IGNORED = frozenset({"user", "stream_options", "store", "service_tier"})


def unsupported_field(given: Mapping[str, Any]) -> str | None:
    """The first field of `given` (the fields a client set, with their values) that asks for something
    litkv does not do, or None."""
    for name, value in given.items():
        if name in IGNORED or value is None:
            continue
        test = NO_OP.get(name)
        if test is None or not test(_value(value)):
            return name
    return None
