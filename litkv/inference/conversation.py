"""The conversation engine of `litkv chat` and `litkv serve`: one conversation on a model's caches.

A `Conversation` owns the messages, the segments already fed (`chat_template.Segment`: what the caches
hold, in order), the feeding and the reply loop. A turn is planned from the whole conversation
(`plan`: the format renders every message, replies kept as their token ids), and only what the caches
do not hold yet is fed (`pending`); if the caches hold something else (another format, a template whose
earlier turns render differently), the conversation is recomputed from an empty cache, with a warning.

Feeding goes through the chunk runner (`litkv.modeling.runner.run_chunks`): a prompt segment is cut from its own
first token (the first segment of a conversation by `prefill_length`, then `chunk_size`; later segments
by `chunk_size`), a reply one token per call, as decoding fed it. So a conversation's tokens are the same
whether it ran uninterrupted, was saved and resumed (`litkv chat --session`) or restored from a stored
state and the rest recomputed (`litkv serve`).

**Documents** (KV blocks, docs/blocks.md): a user message may carry documents (`documents[i]`, each
document's ids tokenized alone, `litkv.inference.blocks.encode_document`); the format puts them at the start of the
message's content as block segments (`chat_template`'s module docstring). A block segment is not run:
its KV comes from the block store (`blocks`, computed alone once) and is spliced at its offset, with
`recompute` of its tokens recomputed together with the text after the documents (`litkv.inference.blocks.feed_blocks`).
Everything before the first document (the template's header, a system prompt) is ordinary prompt text,
fed as it is without documents.

`reply` is the decode loop, a generator of token ids (each is in the caches when it is yielded); it
ends at a stop token of the format (EOS, the template's end-of-turn token) or `max_new_tokens`, and the
caller may stop it earlier (a newline, a stop string, Ctrl-C, a client gone); `end_reply` then records
the reply as a turn.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from litkv.core.validation import require_finite_logits
from litkv.inference.blocks import feed_blocks
from litkv.inference.chat_template import Documents, Format, Message, Replies, Segment
from litkv.modeling.config import KVCacheConfig
from litkv.modeling.model import GPT
from litkv.modeling.runner import ChunkPlan, run_chunks
from litkv.states.block_store import BlockStore
from litkv.states.undo import keep_undo_log

__all__ = ["Conversation", "Pending", "Pick", "segment_plan"]

Pick = Callable[[torch.Tensor], torch.Tensor]  # logits (1, V) -> next token (1,)


@dataclass
class Pending:
    """The segments a turn still has to feed; `restart`: from an empty cache (the caches hold other tokens)."""

    segments: list[Segment]
    restart: bool

    @property
    def num_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)


def segment_plan(seg: Segment, next_pos: int, kv_cache: KVCacheConfig) -> ChunkPlan:
    """The calls of a segment fed at `next_pos`: a reply one token per call, the conversation's first
    segment by `prefill_length` then `chunk_size`, a later prompt segment by `chunk_size` (chat and serve)."""
    if seg.reply:
        return ChunkPlan(1, 1)
    if next_pos == 0:
        return ChunkPlan.of(kv_cache)
    return ChunkPlan(kv_cache.chunk_length, kv_cache.chunk_length)


class Conversation:
    """One conversation (batch of one) on `model`'s caches.

    Args:
        model: the GPT (caches are attached to it by `reset`).
        fmt: how messages become tokens (`chat_template.load_format`).
        kv_cache: the cache config of every layer.
        undo_depth: when set, an undo log of this many calls is kept (`litkv.states.undo.truncate`).
        blocks: where documents' KV is kept (default: a store that keeps nothing: computed at each use).
        recompute: the fraction of each spliced document's tokens recomputed in context (0: pure splice).
    """

    def __init__(
        self,
        model: GPT,
        fmt: Format,
        kv_cache: KVCacheConfig,
        undo_depth: int | None = None,
        blocks: BlockStore | None = None,
        recompute: float = 0.0,
    ) -> None:
        if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0.0 <= recompute <= 1.0:
            raise ValueError(f"recompute must be a fraction in [0, 1] (0: pure splice), got {recompute!r}")
        self.model = model
        self.blocks = BlockStore(0) if blocks is None else blocks
        self.recompute = float(recompute)
        self.documents: dict[int, tuple[tuple[int, ...], ...]] = {}
        self.undo_depth = undo_depth
        self.format = fmt
        self.kv_cache = kv_cache
        self.device = model.lm_head.weight.device
        self.messages: list[Message] = []
        self.replies: list[list[int] | None] = []
        self.fed: list[Segment] = []
        self.prefix: Segment | None = None  # tokens of a state without messages (kept before them)
        self._reply: list[int] = []
        self.reset()

    # -- state ----------------------------------------------------------------------------------

    @property
    def next_pos(self) -> int:
        last = self.model.last_pos
        return 0 if last is None else int(last[0]) + 1

    @property
    def history(self) -> list[int]:
        """Every token the caches have seen, in order."""
        return [t for seg in self.fed for t in seg.ids]

    def reset(self, keep_prefix: bool = False) -> None:
        """Empty caches; forget the messages (and the prefix unless `keep_prefix`)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. qh2o choosing its storage: said once at start
            self.model.set_kv_caches(self.model.build_kv_caches(self.kv_cache, 1))
        if self.undo_depth is not None:
            keep_undo_log(self.model, self.undo_depth)
        self.messages, self.replies, self.fed, self._reply = [], [], [], []
        self.documents = {}
        if not keep_prefix:
            self.prefix = None

    def adopt(self, messages: Sequence[Message], replies: Replies) -> bool:
        """Take the caches as they are (restored from a state) as holding `messages`, which end with a
        reply; False (nothing changed) when their tokens are not as many as the caches saw."""
        segments = self._through_last_reply(self.plan(messages, replies, add_generation_prompt=False))
        if sum(len(s.ids) for s in segments) != self.next_pos:
            return False
        self.prefix = None
        self._set_messages(messages, replies)
        self.fed = segments
        return True

    def _set_messages(self, messages: Sequence[Message], replies: Replies, documents: Documents | None = None) -> None:
        self.messages, self.replies = list(messages), [None if r is None else list(r) for r in replies]
        self.documents = {i: tuple(tuple(int(t) for t in d) for d in docs) for i, docs in (documents or {}).items()}

    def layout(self) -> dict[str, object]:
        """What a file needs besides the token history to resume the conversation (JSON data)."""
        return {
            "format": self.format.name,
            "prefix": self.prefix is not None,
            "segments": [[len(seg.ids), seg.reply, *([True] if seg.block else [])] for seg in self.fed],
            "messages": [list(m) for m in self.messages],
            "documents": [[i, [list(d) for d in docs]] for i, docs in sorted(self.documents.items())],
        }

    def resume(self, history: list[int], layout: dict[str, object] | None) -> None:
        """Take the caches as they are (restored from a file) as holding `history`, laid out as `layout`
        (from `layout()`); `None`: one prefix without messages (the conversation goes on after it).

        Raises:
            ValueError/TypeError: the layout does not cover the history or does not match its messages.
        """
        if len(history) != self.next_pos:
            raise ValueError(f"the history has {len(history)} tokens, the caches saw {self.next_pos}")
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
            fed.append(Segment(tuple(history[at : at + n]), reply, bool(block)))
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
        self.prefix = fed[0] if prefix else None
        self._set_messages(msgs, [next(reply_ids) if role == "assistant" else None for role, _ in msgs], documents)
        self.fed = fed

    def plan(
        self,
        messages: Sequence[Message],
        replies: Replies,
        prefix: Sequence[int] = (),
        add_generation_prompt: bool = True,
        documents: Documents | None = None,
    ) -> list[Segment]:
        """Every segment of the conversation `prefix` + `messages` (a generation prompt at the end);
        `documents[i]`: the documents' ids of user message `i`."""
        head = [Segment(tuple(prefix), False)] if prefix else []
        return head + self.format.segments(messages, replies, not prefix, add_generation_prompt, documents)

    @staticmethod
    def _through_last_reply(segments: list[Segment]) -> list[Segment]:
        replies = [i for i, s in enumerate(segments) if s.reply]
        return segments[: replies[-1] + 1] if replies else segments

    def prepare(self, messages: Sequence[Message], replies: Replies, documents: Documents | None = None) -> Pending:
        """What feeding `messages` (a generation prompt at the end; `documents[i]`: those of user message
        `i`) needs: the segments the caches do not hold yet, or, when the caches hold something else, all of
        them from an empty cache."""
        prefix = self.prefix.ids if self.prefix is not None else ()
        segments = self.plan(messages, replies, prefix, documents=documents)
        if segments[: len(self.fed)] == self.fed:
            return Pending(segments[len(self.fed) :], restart=False)
        return Pending(segments, restart=True)

    def check_room(self, pending: Pending, extra: int) -> None:
        """ValueError when a lossless cache cannot take `pending` and `extra` more tokens."""
        needed = pending.num_tokens + extra
        for cache in self.model.kv_caches:
            limit = type(cache).max_tokens(cache.config)
            filled = 0 if pending.restart else cache.num_filled
            if limit is not None and filled + needed > limit:
                raise ValueError(
                    f"the {cache.config.policy} cache is full: {filled} of {limit} slots used, this turn "
                    f"may need {needed} more; /undo, /reset, or restart with an evicting policy (--kv_cache h2o)"
                )

    # -- feeding ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def feed(
        self, pending: Pending, messages: Sequence[Message], replies: Replies, documents: Documents | None = None
    ) -> torch.Tensor:
        """Run `pending` through the caches (the conversation is then `messages` with `documents`); hidden
        states `(1, 1, n_embd)` of the last token."""
        if pending.restart:
            warnings.warn(
                f"the conversation's earlier tokens differ from what the cache holds (format {self.format.name}); "
                "recomputing it from the start",
                stacklevel=2,
            )
            self.reset(keep_prefix=True)
        hidden, segments, i = None, pending.segments, 0
        while i < len(segments):
            seg = segments[i]
            if seg.block:  # a run of documents and the text after it (their recomputed tokens run with it)
                end = next((j for j in range(i, len(segments)) if not segments[j].block), len(segments))
                text = segments[end] if end < len(segments) and not segments[end].reply else None
                hidden = self._run_blocks(segments[i:end], text)
                run = segments[i : end + (text is not None)]
            else:
                run = [seg]
                if seg.ids:  # an empty reply (cut at once) holds no token
                    hidden = self._run(seg)
            self.fed.extend(run)
            i += len(run)
        if hidden is None:
            raise ValueError("nothing to feed: the conversation's new messages encode to no tokens")
        self._set_messages(messages, replies, documents)
        return hidden

    def _run(self, seg: Segment) -> torch.Tensor:
        n = len(seg.ids)
        plan = segment_plan(seg, self.next_pos, self.kv_cache)
        idx = torch.tensor([seg.ids], dtype=torch.long, device=self.device)
        start = self.next_pos
        pos = torch.arange(start, start + n, device=self.device)[None]
        return run_chunks(self.model, idx, pos, plan, lm_head=False, last_only=True)

    def _run_blocks(self, blocks: Sequence[Segment], text: Segment | None) -> torch.Tensor:
        """Documents `blocks` spliced (`feed_blocks`; a block is computed alone as a prefill from 0) and
        `text` after them; hidden states `(1, 1, n_embd)` of the last token."""
        ids = [torch.tensor(b.ids, dtype=torch.long) for b in blocks]
        after = None if text is None else torch.tensor(text.ids, dtype=torch.long)
        plan = ChunkPlan.of(self.kv_cache)
        return feed_blocks(self.model, ids, after, self.next_pos, plan, self.blocks, self.recompute)[:, None]

    # -- the reply ------------------------------------------------------------------------------

    @torch.inference_mode()
    def reply(self, hidden: torch.Tensor, max_new_tokens: int, pick: Pick) -> Iterator[int]:
        """Sample and feed up to `max_new_tokens` tokens after `hidden` `(1, T, n_embd)`; yields each
        token once it is in the caches; ends after a stop token of the format. `end_reply` records it."""
        self._reply = []
        start = self.next_pos
        for i in range(max_new_tokens):
            logits = self.model.logits(hidden[:, -1])
            require_finite_logits(bool(torch.isfinite(logits).all()), i + 1)  # read with the token anyway
            token = int(pick(logits)[0])
            pos = torch.tensor([[start + i]], device=self.device)
            hidden = self.model(torch.tensor([[token]], device=self.device), pos, lm_head=False)
            self._reply.append(token)
            yield token
            if token in self.format.stop_ids:
                return

    def end_reply(self, content: str) -> list[int]:
        """Record the reply produced since `reply` (its tokens are in the caches) as the assistant
        message `content`; returns its ids."""
        ids, self._reply = self._reply, []
        self.fed.append(Segment(tuple(ids), True))
        self.messages.append(("assistant", content))
        self.replies.append(list(ids))
        return ids

    # -- turns (for undo) -------------------------------------------------------------------------

    def turn_sizes(self) -> list[int]:
        """Tokens of each turn: the segments after one reply up to and including the next."""
        sizes, run = [], 0
        for seg in self.fed[1:] if self.prefix is not None else self.fed:
            run += len(seg.ids)
            if seg.reply:
                sizes.append(run)
                run = 0
        return sizes

    def drop_last_turn(self) -> None:
        """Forget the last turn's segments and messages (the caller rolls the caches back)."""
        before = [i for i, s in enumerate(self.fed) if s.reply][:-1]
        cut = before[-1] + 1 if before else (1 if self.prefix is not None else 0)
        self.fed = self.fed[:cut]
        assistants = [i for i, (role, _) in enumerate(self.messages) if role == "assistant"]
        keep = assistants[-2] + 1 if len(assistants) >= 2 else 0
        self.messages, self.replies = self.messages[:keep], self.replies[:keep]
        self.documents = {i: docs for i, docs in self.documents.items() if i < keep}


def _read_documents(raw: object) -> dict[int, tuple[tuple[int, ...], ...]]:
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
