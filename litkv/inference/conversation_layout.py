"""A conversation's layout as JSON data: what a session file holds besides the token history (the format's
name, whether a prefix without messages comes first, the fed segments' lengths and kinds, the messages,
the documents of each user message), written by `dump_layout` and read back, checked against the
history, by `parse_layout` (`litkv.inference.conversation.Conversation.layout` and `.resume`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from litkv.inference.chat_template import Message, TurnSegment

__all__ = ["Layout", "dump_layout", "parse_layout"]

DocumentIds = dict[int, tuple[tuple[int, ...], ...]]


@dataclass(frozen=True)
class Layout:
    """A layout read back over a token history: the segments the caches hold (in order), whether the first is
    a prefix without messages, the messages, each assistant message's reply ids (None for the others) and
    the documents' ids of each user message (by message index)."""

    fed: list[TurnSegment]
    prefix: bool
    messages: list[Message]
    replies: list[list[int] | None]
    documents: DocumentIds


def dump_layout(
    format_name: str, prefix: bool, fed: Sequence[TurnSegment], messages: Sequence[Message], documents: DocumentIds
) -> dict[str, object]:
    """The layout of a conversation as JSON data (`parse_layout` reads it back)."""
    return {
        "format": format_name,
        "prefix": prefix,
        "segments": [[len(seg.ids), seg.reply, *([True] if seg.block else [])] for seg in fed],
        "messages": [list(m) for m in messages],
        "documents": [[i, [list(d) for d in docs]] for i, docs in sorted(documents.items())],
    }


def parse_layout(history: Sequence[int], layout: dict[str, object] | None) -> Layout:
    """`layout` (from `dump_layout`) over the token `history`; `None`: one prefix without messages.

    Raises:
        ValueError/TypeError: the layout does not cover the history or does not match its messages.
    """
    if layout is None:
        layout = {"prefix": bool(history), "segments": [[len(history), False]] if history else [], "messages": []}
    segments, messages, prefix = layout.get("segments"), layout.get("messages"), layout.get("prefix")
    if not isinstance(segments, list) or not isinstance(messages, list) or type(prefix) is not bool:
        raise TypeError("a layout's segments and messages are lists, its prefix a bool")
    fed, at = [], 0
    for entry in segments:
        n, reply, *block = entry
        if type(n) is not int or n < 0 or type(reply) is not bool or block not in ([], [True]):
            raise TypeError("a segment is [length, reply] or [length, false, true] (a document)")
        fed.append(TurnSegment(tuple(history[at : at + n]), reply, bool(block)))
        at += n
    documents = _read_documents(layout.get("documents", []))
    msgs = [(str(role), str(content)) for role, content in messages]
    if at != len(history) or (prefix and (not fed or fed[0].reply)):
        raise ValueError(f"the layout's segments cover {at} tokens of {len(history)}")
    reply_ids = iter([list(s.ids) for s in fed if s.reply])
    if sum(s.reply for s in fed) != sum(role == "assistant" for role, _ in msgs):
        raise ValueError("a layout has one reply segment per assistant message")
    if sorted(d for docs in documents.values() for d in docs) != sorted(s.ids for s in fed if s.block):
        raise ValueError("a layout's documents are not its document segments")
    replies = [next(reply_ids) if role == "assistant" else None for role, _ in msgs]
    return Layout(fed, prefix, msgs, replies, documents)


def _read_documents(raw: object) -> DocumentIds:
    """A layout's documents `[[message index, [[ids], ...]], ...]`; TypeError when malformed."""
    out = {}
    if not isinstance(raw, list):
        raise TypeError("a layout's documents are a list of [message index, [[token ids], ...]]")
    for entry in raw:
        shape_ok = isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
        if not shape_ok or not isinstance(entry[1], list):
            raise TypeError("a layout's documents are a list of [message index, [[token ids], ...]]")
        docs = entry[1]
        if not all(isinstance(d, list) and d and all(type(t) is int for t in d) for d in docs):
            raise TypeError("a document is a non-empty list of token ids")
        out[entry[0]] = tuple(tuple(d) for d in docs)
    return out
