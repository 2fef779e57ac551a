"""A turn of `litkv serve`: the checked request, what it produced, and the error that refuses one."""

from __future__ import annotations

from dataclasses import dataclass, field

from litkv.inference.chat_template import Message

__all__ = ["RequestError", "TurnRequest", "TurnResult"]


class RequestError(ValueError):
    """A request the server refuses (HTTP 4xx): `status` and an OpenAI-style `code`."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass
class TurnRequest:
    """One chat completion request, checked."""

    messages: list[Message]
    max_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    documents: list[str] = field(default_factory=list)  # of the last user message, spliced as KV blocks


@dataclass
class TurnResult:
    """What a finished turn produced."""

    content: str = ""
    reply_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    reused_tokens: int = 0
    finish_reason: str = "stop"
    stored: bool = False
    generated: int = 0
    block_tokens: int = 0  # documents' tokens restored from the block store
