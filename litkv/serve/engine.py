"""The conversation engine of `litkv serve`: messages in, reply text out, through stored cache states.

A conversation is a list of `(role, content)` messages. Each message is one segment of tokens, as in
`litkv chat`: a `system`/`user` message is `content + "\\n"` (BOS only at the very start), fed in
chunks of `chunk_size` from the segment's first token; an `assistant` message is the reply's exact
token ids (all of them, the stop token included), fed one token per call, as decode fed them.

A request's messages are matched against stored states at message boundaries: the longest prefix
that ends with an assistant message and has a state is restored, and only the messages after it are
run. After the reply the state is stored under the prefix that includes the reply. So a turn's tokens
are the same whether its state came from memory, from disk, or was recomputed from scratch: the
recomputation replays the same per-segment schedule.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from litkv.config import KVCacheConfig
from litkv.fingerprint import model_fingerprint
from litkv.generate import sample
from litkv.model import GPT
from litkv.serve.store import StateStore
from litkv.state import restore, snapshot

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

__all__ = ["ROLES", "Engine", "RequestError", "TurnRequest", "TurnResult", "message_keys"]

ROLES = ("system", "user", "assistant")
Message = tuple[str, str]


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
    """Runs turns of conversations on one model (batch of one), restoring and storing cache states.

    Args:
        model: the GPT.
        tokenizer: the checkpoint's tokenizer.
        kv_cache: the cache config of every layer.
        store: where conversation states live.
        top_k: sample among the k most likely tokens (as `litkv chat`'s `--top_k`).
        stop_at_newline: end a reply at its first newline (as `litkv chat`).
        default_seed: sampler seed of a request without `seed`.
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        kv_cache: KVCacheConfig,
        store: StateStore,
        top_k: int | None = 50,
        stop_at_newline: bool = True,
        default_seed: int = 1234,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv_cache = kv_cache
        self.store = store
        self.top_k = top_k
        self.stop_at_newline = stop_at_newline
        self.default_seed = default_seed
        fingerprint = json.dumps([model_fingerprint(model), repr(kv_cache)], sort_keys=True)
        self.root = hashlib.sha256(fingerprint.encode()).hexdigest()
        self.limit = kv_cache.policy_class.max_tokens(kv_cache)
        self.device = model.lm_head.weight.device

    # -- tokens ---------------------------------------------------------------------------------

    def encode(self, content: str, first: bool) -> list[int]:
        """A system/user segment's ids, as `litkv chat` encodes a line."""
        return self.tokenizer.encode(content + "\n", bos=None if first else False).tolist()

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int:
        """Tokens of the whole conversation (assistant replies re-tokenised: an estimate for limits)."""
        return sum(len(self.encode(content, i == 0)) for i, (_, content) in enumerate(messages))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(torch.tensor(ids, dtype=torch.long)) if ids else ""

    # -- caches ---------------------------------------------------------------------------------

    @property
    def next_pos(self) -> int:
        last = self.model.last_pos
        return 0 if last is None else int(last[0]) + 1

    def _fresh(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model.set_kv_caches(self.model.build_kv_caches(self.kv_cache, 1))

    def _feed(self, ids: list[int], step: int) -> torch.Tensor:
        """Run `ids` through the caches in calls of `step` tokens; hidden states of the last call."""
        hidden = None
        for s in range(0, len(ids), step):
            part = torch.tensor([ids[s : s + step]], device=self.device)
            start = self.next_pos
            pos = torch.arange(start, start + part.shape[1], device=self.device)[None]
            hidden = self.model(part, pos, lm_head=False)
        assert hidden is not None
        return hidden

    def _restore_longest(self, keys: list[str], messages: Sequence[Message]) -> int:
        """Restore the longest stored prefix ending with an assistant message; how many messages it covers."""
        for k in range(len(messages) - 1, 0, -1):
            if messages[k - 1][0] != "assistant":
                continue
            state = self.store.get(keys[k])
            if state is None:
                continue
            try:
                restore(self.model, state)
            except ValueError:  # taken from another model: never restored
                continue
            return k
        self._fresh()
        return 0

    def _segments(self, keys: list[str], messages: Sequence[Message], start: int) -> list[tuple[list[int], int]]:
        """(ids, call size) of each message from `start` on."""
        segments = []
        for i in range(start, len(messages)):
            role, content = messages[i]
            if role == "assistant":
                ids = self.store.reply_ids(keys[i + 1])
                if ids is None:  # never generated here: its text, as a reply would end
                    ids = self.tokenizer.encode(content + "\n", bos=False).tolist()
                segments.append((ids, 1))
            else:
                segments.append((self.encode(content, i == 0), self.kv_cache.chunk_length))
        return segments

    def _check_room(self, needed: int) -> None:
        if self.limit is None:
            return
        filled = max(int(c.num_filled) for c in self.model.kv_caches)
        if filled + needed > self.limit:
            raise RequestError(
                f"the conversation needs {filled + needed} tokens, more than the {self.kv_cache.policy} cache's "
                f"{self.limit} slots; use an evicting policy (--kv-cache h2o) or a larger --kv_cache.cache_length",
                code="context_length_exceeded",
                param="messages",
            )

    # -- a turn ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, req: TurnRequest, result: TurnResult, cancelled: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Run a turn; yields the reply's text as it comes and fills `result`. The state after the reply
        is stored only when the turn ends normally (not when `cancelled()` turns true)."""
        check_messages(req.messages)
        keys = message_keys(self.root, req.messages)
        start = self._restore_longest(keys, req.messages)
        segments = self._segments(keys, req.messages, start)
        new_tokens = sum(len(ids) for ids, _ in segments)
        result.reused_tokens = self.next_pos
        result.prompt_tokens = result.reused_tokens + new_tokens
        self._check_room(new_tokens + req.max_tokens)
        hidden = None
        for ids, step in segments:
            hidden = self._feed(ids, step)
        assert hidden is not None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.default_seed if req.seed is None else req.seed)
        stream = _StopScanner(req.stop + (["\n"] if self.stop_at_newline else []))
        eos = self.tokenizer.eos_id
        while len(result.reply_ids) < req.max_tokens:
            if cancelled():
                return
            logits = self.model.logits(hidden[:, -1])
            token = int(sample(logits, req.temperature, self.top_k, req.top_p, generator)[0])
            result.reply_ids.append(token)
            hidden = self._feed([token], 1)
            shown = result.reply_ids[:-1] if token == eos else result.reply_ids
            delta, done = stream.update(self._decode(shown), final=token == eos)
            if delta:
                yield delta
            if done or token == eos:
                break
        else:
            result.finish_reason = "length"
            delta, _ = stream.update(self._decode(result.reply_ids), final=True)
            if delta:
                yield delta
        result.content = stream.content
        self._store(keys[-1], req.messages, result)

    def _store(self, last_key: str, messages: Sequence[Message], result: TurnResult) -> None:
        key = message_keys(last_key, [("assistant", result.content)])[-1]
        state = snapshot(self.model, device="cpu")
        self.store.put(key, state, result.reply_ids)
        result.stored = True


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
