"""The conversation engine of `litkv serve`: messages in, reply text out, through stored cache states.

A conversation is a list of `(role, content)` messages, made into tokens and fed by the conversation
engine that `litkv chat` uses too (`litkv.conversation`): with the checkpoint's chat template when it
has one (`litkv.chat_template`), else each message is `content + "\\n"` (BOS only at the very start).
Prompt text is fed in chunks from its segment's first token; an assistant message generated here is the
reply's exact token ids (all of them, the stop token included), fed one token per call, as decode fed
them; one the server never produced is its text, tokenized.

A request's messages are matched against stored states at message boundaries: the longest prefix
that ends with an assistant message and has a state is restored, and only the messages after it are
run. After the reply the state is stored under the prefix that includes the reply. So a turn's tokens
are the same whether its state came from memory, from disk, or was recomputed from scratch: the
recomputation replays the same per-segment schedule.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from litkv.chat_template import ChatTemplateError, Format, Message, RawFormat, TemplateFormat
from litkv.config import KVCacheConfig
from litkv.conversation import Conversation, Pending
from litkv.fingerprint import model_fingerprint
from litkv.generate import sample
from litkv.model import GPT
from litkv.serve.store import StateStore
from litkv.state import restore, snapshot

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

__all__ = ["ROLES", "Engine", "RequestError", "TurnRequest", "TurnResult", "count_prompt_tokens", "message_keys"]

ROLES = ("system", "user", "assistant")


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


@dataclass
class TurnResult:
    """What a finished turn produced."""

    content: str = ""
    reply_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    reused_tokens: int = 0
    finish_reason: str = "stop"
    stored: bool = False


def message_keys(root: str, messages: Sequence[Message]) -> list[str]:
    """Digest of each prefix: `keys[k]` covers `messages[:k]` (`keys[0]` is `root`)."""
    keys = [root]
    for role, content in messages:
        text = json.dumps([keys[-1], role, content], ensure_ascii=False)
        keys.append(hashlib.sha256(text.encode()).hexdigest())
    return keys


def check_messages(messages: Sequence[Message]) -> None:
    """RequestError unless the roles are known, the last message is the user's, and no system or user
    content is empty (an assistant reply may be: a reply can end at once)."""
    if not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    for i, (role, content) in enumerate(messages):
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}", param="messages")
        if not isinstance(content, str) or (not content and role != "assistant"):
            raise RequestError(f"messages[{i}].content must be a non-empty string", param="messages")
    if messages[-1][0] != "user":
        raise RequestError(f"the last message must be the user's, got {messages[-1][0]!r}", param="messages")


class Engine:
    """Runs turns of conversations on one model (batch of one), restoring and storing cache states; the
    conversation itself (formatting, feeding, the reply loop) is a `litkv.conversation.Conversation`.

    Args:
        model: the GPT.
        tokenizer: the checkpoint's tokenizer.
        kv_cache: the cache config of every layer.
        store: where conversation states live.
        top_k: sample among the k most likely tokens (as `litkv chat`'s `--top_k`).
        stop_at_newline: end a reply at its first newline (as `litkv chat`); default: only for raw text.
        default_seed: sampler seed of a request without `seed`.
        fmt: how messages become tokens (`litkv.chat_template.load_format`); default raw text.
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        kv_cache: KVCacheConfig,
        store: StateStore,
        top_k: int | None = 50,
        stop_at_newline: bool | None = None,
        default_seed: int = 1234,
        fmt: Format | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv_cache = kv_cache
        self.store = store
        self.top_k = top_k
        self.format = fmt or RawFormat(tokenizer)
        self.stop_at_newline = self.format.name == "raw" if stop_at_newline is None else stop_at_newline
        self.default_seed = default_seed
        self.conversation = Conversation(model, self.format, kv_cache)
        identity = [model_fingerprint(model), repr(kv_cache)]
        if isinstance(self.format, TemplateFormat):  # another format: other tokens, other states
            identity.append(self.format.template.source)
        self.root = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        self.limit = kv_cache.policy_class.max_tokens(kv_cache)
        self.device = model.lm_head.weight.device

    # -- tokens ---------------------------------------------------------------------------------

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int:
        """Tokens of the whole conversation (assistant replies re-tokenised: an estimate for limits)."""
        return count_prompt_tokens(self.format, messages)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(torch.tensor(ids, dtype=torch.long)) if ids else ""

    # -- caches ---------------------------------------------------------------------------------

    @property
    def next_pos(self) -> int:
        return self.conversation.next_pos

    def _replies(self, keys: list[str], messages: Sequence[Message]) -> list[list[int] | None]:
        """The stored token ids of each assistant message generated here (else `None`)."""
        return [
            self.store.reply_ids(keys[i + 1]) if role == "assistant" else None for i, (role, _) in enumerate(messages)
        ]

    def _restore_longest(self, keys: list[str], messages: Sequence[Message], replies: list[list[int] | None]) -> int:
        """Restore the longest stored prefix ending with an assistant message; how many messages it covers."""
        for k in range(len(messages) - 1, 0, -1):
            if messages[k - 1][0] != "assistant" or replies[k - 1] is None:
                continue
            state = self.store.get(keys[k])
            if state is None:
                continue
            try:
                restore(self.model, state)
            except ValueError:  # taken from another model: never restored
                continue
            if self.conversation.adopt(messages[:k], replies[:k]):
                return k
        self.conversation.reset()
        return 0

    def _check_room(self, pending: Pending, max_tokens: int) -> None:
        if self.limit is None:
            return
        filled = 0 if pending.restart else max(int(c.num_filled) for c in self.model.kv_caches)
        needed = pending.num_tokens + max_tokens
        if filled + needed > self.limit:
            raise RequestError(
                f"the conversation needs {filled + needed} tokens, more than the {self.kv_cache.policy} cache's "
                f"{self.limit} slots; use an evicting policy (--kv-cache h2o) or a larger --kv_cache.cache_length",
                code="context_length_exceeded",
                param="messages",
            )

    # -- a turn ---------------------------------------------------------------------------------

    def run(self, req: TurnRequest, result: TurnResult, cancelled: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Run a turn; yields the reply's text as it comes and fills `result`. The state after the reply
        is stored only when the turn ends normally (not when `cancelled()` turns true)."""
        check_messages(req.messages)
        keys = message_keys(self.root, req.messages)
        replies = self._replies(keys, req.messages)
        self._restore_longest(keys, req.messages, replies)
        conv = self.conversation
        try:
            pending = conv.prepare(req.messages, replies)
        except ChatTemplateError as err:  # the chat template refuses this conversation
            raise RequestError(err.reason, param="messages") from None
        result.reused_tokens = 0 if pending.restart else conv.next_pos
        result.prompt_tokens = result.reused_tokens + pending.num_tokens
        self._check_room(pending, req.max_tokens)
        hidden = conv.feed(pending, req.messages, replies)
        if (yield from self._reply(hidden, req, result, cancelled)):
            self._store(keys[-1], result)

    def _reply(
        self, hidden: torch.Tensor, req: TurnRequest, result: TurnResult, cancelled: Callable[[], bool]
    ) -> Generator[str, None, bool]:
        """The reply loop after `hidden` `(1, T, n_embd)`: yields text, fills `result`; False when cancelled."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.default_seed if req.seed is None else req.seed)
        stream = _StopScanner(req.stop + (["\n"] if self.stop_at_newline else []))

        def pick(logits: torch.Tensor) -> torch.Tensor:
            return sample(logits, req.temperature, self.top_k, req.top_p, generator)

        tokens = self.conversation.reply(hidden, req.max_tokens, pick)
        ended = False
        while not ended:
            if cancelled():
                tokens.close()
                self.conversation.end_reply(self._decode(result.reply_ids))
                return False
            token = next(tokens, None)
            if token is None:
                break
            result.reply_ids.append(token)
            stop = token in self.format.stop_ids
            delta, done = stream.update(self._decode(result.reply_ids[:-1] if stop else result.reply_ids), final=stop)
            if delta:
                yield delta
            ended = done or stop
        if not ended:
            result.finish_reason = "length"
            delta, _ = stream.update(self._decode(result.reply_ids), final=True)
            if delta:
                yield delta
        tokens.close()
        result.content = stream.content
        self.conversation.end_reply(result.content)
        return True

    def _store(self, last_key: str, result: TurnResult) -> None:
        key = message_keys(last_key, [("assistant", result.content)])[-1]
        state = snapshot(self.model, device="cpu")
        self.store.put(key, state, result.reply_ids)
        result.stored = True


def count_prompt_tokens(fmt: Format, messages: Sequence[Message]) -> int:
    """Tokens of a request's messages in `fmt` with the generation prompt (assistant replies re-tokenised
    from their text: an estimate for limits, made before the stored reply ids are looked up)."""
    try:
        segments = fmt.segments(messages, [None] * len(messages), True, True)
    except ChatTemplateError as err:  # the chat template refuses this conversation (raise_exception, ...)
        raise RequestError(err.reason, param="messages") from None
    return sum(len(s.ids) for s in segments)


class _StopScanner:
    """Cuts a reply's text at its first stop string; gives the text safe to send so far."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sent = 0
        self.content = ""

    def update(self, text: str, final: bool = False) -> tuple[str, bool]:
        """`(new text to send, stopped)` for the reply's whole text so far."""
        if text.endswith("\ufffd") and not final:
            return "", False
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.content = text[: min(cuts)]
            return self._advance(len(self.content)), True
        self.content = text
        return self._advance(len(text) if final else max(len(text) - self.hold, self.sent)), False

    def _advance(self, upto: int) -> str:
        delta = self.content[self.sent : upto]
        self.sent = max(self.sent, upto)
        return delta
