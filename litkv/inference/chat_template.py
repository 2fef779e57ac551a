"""Messages -> token segments: the checkpoint's own chat template (sandboxed Jinja), or raw text.

A conversation is a list of `(role, content)` messages; what the model sees of it is a list of
`TurnSegment`s: prompt text (fed in chunks) and replies (a reply's exact token ids, fed one per call as
decoding fed them). Two formats build them:

- `TemplateFormat`: the template of `tokenizer_config.json` (key ``chat_template``: a string, or Hugging
  Face's list of ``{name, template}``, of which ``default`` is used; or a ``chat_template.jinja`` file),
  rendered only in `jinja2.sandbox.ImmutableSandboxedEnvironment`, as transformers renders it
  (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``bos_token``/``eos_token``,
  ``add_generation_prompt``). A reply whose ids are known is rendered as a marker and replaced by its ids,
  so the tokens already in the cache are never re-encoded; the end-of-turn token the reply ended with is
  not fed twice. The rendered text is tokenized as transformers' ``apply_chat_template`` does (no special
  tokens added).
- `RawFormat`: `litkv chat`'s text: each message is ``content + "\\n"``, BOS only at the very start.

**Documents** (KV blocks, docs/blocks.md): `segments(..., documents={i: [ids, ...]})` puts each document of
message `i` (a user message) at the start of its content, in order, as a `block` segment of its own ids
(each document tokenized alone); the message's text follows them. A template renders a marker per
document, replaced by its ids as a known reply is; raw text gives BOS (at the start), the documents,
then ``content + "\\n"``.

A template is data from a file: it never runs code; an error or a sandbox violation is a ValueError
naming the file.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from litkv.core.tokens import encode_plain, encode_text
from litkv.inference.template_sandbox import Budget
from litkv.inference.template_worker import TemplateFailed, TemplateRefused, compile_template, render_in_worker

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "Format",
    "Message",
    "RawFormat",
    "TurnSegment",
    "TemplateFormat",
    "load_format",
]

Message = tuple[str, str]
Replies = Sequence[Sequence[int] | None]
Documents = Mapping[int, Sequence[Sequence[int]]]  # message index -> each document's token ids
RENDER_CACHE = 16  # renders a ChatTemplate keeps (a conversation is rendered to count it, then to feed it)


class ChatTemplateError(ValueError):
    """A template that fails on a conversation: the message names the file, `reason` does not."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class TurnSegment:
    """Tokens fed together: prompt text (`reply=False`, chunked), a reply (`reply=True`, one per call) or a
    document (`block=True`: its KV computed alone and spliced, `litkv.inference.blocks`)."""

    ids: tuple[int, ...]
    reply: bool
    block: bool = False


class Format(Protocol):
    """How messages become segments, and which tokens end a reply."""

    name: str
    stop_ids: frozenset[int]

    def segments(
        self,
        messages: Sequence[Message],
        replies: Replies,
        first: bool,
        add_generation_prompt: bool,
        documents: Documents | None = None,
    ) -> list[TurnSegment]:
        """Segments of `messages`; `replies[i]`: the token ids of assistant message `i` when known (else
        `None`); `first`: the conversation starts at position 0 (BOS); a generation prompt at the end;
        `documents[i]`: block segments at the start of user message `i` (module docstring)."""
        ...


class RawFormat:
    """`litkv chat`'s text: a message is ``content + "\\n"``; an assistant message with unknown ids is
    its text tokenized as a reply would end; BOS (per the tokenizer) at the conversation's start only."""

    name = "raw"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = frozenset() if tokenizer.eos_id is None else frozenset({int(tokenizer.eos_id)})

    def segments(
        self,
        messages: Sequence[Message],
        replies: Replies,
        first: bool,
        add_generation_prompt: bool,
        documents: Documents | None = None,
    ) -> list[TurnSegment]:
        out = []
        for i, (role, content) in enumerate(messages):
            known = replies[i] if role == "assistant" else None
            if known is not None:
                out.append(TurnSegment(tuple(int(t) for t in known), True))
                continue
            docs = _documents_of(documents, i, role)
            bos_id = getattr(self.tokenizer, "bos_id", None)
            use_bos = first and i == 0 and getattr(self.tokenizer, "use_bos", False) and bos_id is not None
            bos = [int(bos_id)] if use_bos else []  # type: ignore[arg-type]
            if docs and bos:
                out.append(TurnSegment(tuple(bos), False))
            out += [TurnSegment(doc, False, block=True) for doc in docs]
            ids = ([] if docs else bos) + encode_text(self.tokenizer, content + "\n")  # content is text
            out.append(TurnSegment(tuple(ids), role == "assistant"))
        return out


class ChatTemplate:
    """A chat template compiled in `ImmutableSandboxedEnvironment`.

    Args:
        source: the Jinja text.
        path: the file it came from (named in errors).
        bos_token, eos_token: the template's `bos_token` / `eos_token` variables.
    """

    def __init__(self, source: str, path: Path, bos_token: str | None = None, eos_token: str | None = None) -> None:
        from jinja2 import TemplateError

        self.source = source
        self.path = Path(path)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.budget = Budget()
        try:
            compile_template(source)  # refused here when it does not compile; rendered in the worker
        except (TemplateError, RecursionError) as err:
            raise ValueError(f"{self.path}: the chat template does not compile: {_one_line(err)}") from None
        # a template that reads the clock renders differently from call to call: never cached
        self._cache: OrderedDict[tuple[tuple[Message, ...], bool], str] | None = (
            None if "strftime_now" in source else OrderedDict()
        )

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The text of `messages`, rendered under `self.budget` (`litkv.inference.template_sandbox`: work and
        size bounded) in a worker process with hard memory and time limits
        (`litkv.inference.template_worker`); the last `RENDER_CACHE` renders are kept, so a conversation
        rendered again (counted, then fed) costs one render. ValueError naming the file for any template
        error, sandbox violation or a template over its budget or limits."""
        key = (tuple((str(r), str(c)) for r, c in messages), bool(add_generation_prompt))
        if self._cache is not None and key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        msgs = [{"role": role, "content": content} for role, content in messages]
        budget = Budget(self.budget.max_steps, self.budget.max_chars, self.budget.max_seconds)
        variables = {"messages": msgs, "add_generation_prompt": add_generation_prompt}
        variables.update(bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        try:
            text = render_in_worker(self.source, variables, budget)
        except TemplateRefused as err:
            raise ChatTemplateError(self.path, f"refused: {err}") from None
        except TemplateFailed as err:
            raise ChatTemplateError(self.path, f"the chat template failed: {err}") from None
        if self._cache is not None:
            self._cache[key] = text
            if len(self._cache) > RENDER_CACHE:
                self._cache.popitem(last=False)
        return text

    @classmethod
    def load(cls, checkpoint_dir: Path) -> ChatTemplate | None:
        """The template of `checkpoint_dir` (`tokenizer_config.json`'s ``chat_template``, else
        ``chat_template.jinja``), or `None` when it has none."""
        path = Path(checkpoint_dir) / "tokenizer_config.json"
        config = _read_json(path) if path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ValueError(
                    f"{path}: chat_template is a list without a 'default' template: {sorted(map(str, named))}"
                )
            source = named["default"]
        jinja = Path(checkpoint_dir) / "chat_template.jinja"
        if source is None and jinja.is_file():
            source, path = jinja.read_text(encoding="utf-8"), jinja
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{path}: chat_template must be a string, got {type(source).__name__}")
        return cls(source, path, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


class TemplateFormat:
    """Messages rendered by the checkpoint's `ChatTemplate`; replies with known ids kept as they are.

    Args:
        template: the compiled template.
        tokenizer: the checkpoint's tokenizer.
        extra_stop_ids: other ids that end a reply (EOS, `generation_config.json`'s ``eos_token_id``).
    """

    name = "chat_template"

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer, extra_stop_ids: Sequence[int] = ()) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.special = _special_tokens(tokenizer)
        self.special_text = {i: s for s, i in self.special.items()}
        # markers stand for replies, documents and content in the rendered text: the same for the same
        # conversation (so a render is cached), unguessable by what a user writes
        self._nonce = uuid.uuid4().hex
        stops = {int(t) for t in extra_stop_ids}
        eot = self.end_of_turn()
        if eot is not None:
            stops.add(eot)
        self.stop_ids = frozenset(stops)

    def end_of_turn(self) -> int | None:
        """The special token the template writes right after an assistant message, if any (`<|im_end|>`)."""
        marker = f"<<litkv-{uuid.uuid4().hex}>>"
        try:
            text = self.template.render([("user", "hi"), ("assistant", marker)], add_generation_prompt=False)
        except ValueError:  # a template that wants another conversation shape: no end-of-turn token known
            return None
        after = text.split(marker, 1)[1] if marker in text else ""
        found = [(len(s), i) for s, i in self.special.items() if after.startswith(s)]
        return max(found)[1] if found else None

    def segments(
        self,
        messages: Sequence[Message],
        replies: Replies,
        first: bool,
        add_generation_prompt: bool,
        documents: Documents | None = None,
    ) -> list[TurnSegment]:
        markers: list[tuple[int, str, TurnSegment]] = []  # in the order the template writes them
        shown = []
        for i, (role, content) in enumerate(messages):
            if role == "assistant" and replies[i] is not None:
                marker = f"<<litkv-reply-{i}-{self._nonce}>>"
                markers.append((i, marker, TurnSegment(tuple(int(t) for t in replies[i]), True)))  # type: ignore[union-attr]
                shown.append((role, marker))
                continue
            docs = [(f"<<litkv-document-{i}-{k}-{self._nonce}>>", doc)
                    for k, doc in enumerate(_documents_of(documents, i, role))]  # fmt: skip
            markers += [(i, marker, TurnSegment(doc, False, block=True)) for marker, doc in docs]
            if any(s in content for s in self.special):  # control strings in content are text, not control
                marker = f"<<litkv-content-{i}-{self._nonce}>>"
                markers.append((i, marker, TurnSegment(tuple(encode_text(self.tokenizer, content)), False)))
                content = marker
            shown.append((role, "".join(marker for marker, _ in docs) + content))
        text = self.template.render(shown, add_generation_prompt)
        out: list[TurnSegment] = []
        start = 0
        for i, marker, seg in markers:
            at = text.find(marker, start)
            if at < 0 or text.count(marker) != 1:
                what = "assistant message {} once and verbatim; litkv cannot keep its reply's tokens"
                if seg.block:
                    what = "the documents of message {} once and verbatim; litkv cannot splice them"
                elif not seg.reply:
                    what = "the content of message {} once and verbatim; litkv cannot keep its control strings text"
                raise ChatTemplateError(
                    self.template.path, f"the chat template does not write {what.format(i)} (use --chat_template false)"
                )
            self._add_text(out, text[start:at])
            out.append(seg)
            start = at + len(marker)
            if not seg.reply:
                continue
            reply = seg.ids
            if reply and reply[-1] in self.stop_ids:  # the end-of-turn token is in the reply: not again
                written = self.special_text.get(reply[-1])
                if written and text.startswith(written, start):
                    start += len(written)
        self._add_text(out, text[start:])
        return out

    def _add_text(self, out: list[TurnSegment], text: str) -> None:
        ids = encode_plain(self.tokenizer, text) if text else []
        if ids:
            out.append(TurnSegment(tuple(ids), False))


def _documents_of(documents: Documents | None, index: int, role: str) -> list[tuple[int, ...]]:
    """The documents of message `index` as id tuples; ValueError for an empty one or a non-user message."""
    docs = [] if documents is None else list(documents.get(index, ()))
    if docs and role != "user":
        raise ValueError(f"documents belong to a user message, message {index} is the {role}'s")
    for k, doc in enumerate(docs):
        if len(doc) == 0:
            raise ValueError(f"document {k} of message {index} encodes to no tokens: give a non-empty document")
    return [tuple(int(t) for t in doc) for doc in docs]


def load_format(checkpoint_dir: Path, tokenizer: Tokenizer, chat_template: bool | None = None) -> Format:
    """The format of `checkpoint_dir`: its chat template when it has one (`chat_template` None or True),
    else raw text; `chat_template=True` without a template is a ValueError."""
    if chat_template is not None and not isinstance(chat_template, bool):
        raise TypeError(f"chat_template must be true, false or None (auto), got {chat_template!r}")
    template = None if chat_template is False else ChatTemplate.load(checkpoint_dir)
    if template is None:
        if chat_template:
            raise ValueError(
                f"--chat_template true, but {str(checkpoint_dir)!r} has no chat template "
                "(tokenizer_config.json key 'chat_template'); use --chat_template false"
            )
        return RawFormat(tokenizer)
    return TemplateFormat(template, tokenizer, _eos_ids(checkpoint_dir, tokenizer))


def _eos_ids(checkpoint_dir: Path, tokenizer: Tokenizer) -> list[int]:
    """EOS and `generation_config.json`'s ``eos_token_id`` (an int or a list of ints)."""
    ids = [] if tokenizer.eos_id is None else [int(tokenizer.eos_id)]
    path = Path(checkpoint_dir) / "generation_config.json"
    if path.is_file():
        value = _read_json(path).get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        ids += [v for v in values if type(v) is int and v >= 0]
    return ids


def _special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """The vocabulary's special (added) tokens: text -> id."""
    if tokenizer.backend != "huggingface":
        return {}
    return {tok.content: int(i) for i, tok in tokenizer.processor.get_added_tokens_decoder().items() if tok.special}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({_one_line(err)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__
