"""The conversation core of `litkv chat` and `litkv serve`: turns planned, documents grouped, room and
recompute checked, runs fed to a row.

The planning is the same for both (functions of the format, no caches): `plan_segments` renders the whole
conversation (`chat_template.TurnSegment`s, replies kept as their token ids; the leading system messages
fed as a segment of their own where their tokens end cleanly), `held_segments` is what caches
hold after a reply, `runs` groups the segments as they are fed (a run of documents with the prompt text
after it, every other segment alone), `lossless_overflow` is the room check of a lossless cache and
`check_recompute` the check of a recompute fraction; `plan_turn` is all of it for one server turn, a
`TurnPlan`. A `Feeder` feeds a `Run` to a `Row` (the small
protocol of where tokens go: `next_pos`, `prefill`, `feed_blocks`): a batch-of-one model run (a
`Conversation`, chat) or one row of the server's batch (`litkv.serve.engine`).

A `Conversation` is one conversation on a model's caches (chat): the messages, the segments already fed
(what the caches hold, in order), the feeding and the reply loop. A turn is planned from the whole
conversation and only what the caches do not hold yet is fed (`prepare`); if the caches hold something
else (another format, a template whose earlier turns render differently), the conversation is
recomputed from an empty cache, with a warning.

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

`reply` runs `generate`'s decode loop (`litkv.inference.generate.decode_tokens`, the tokens picked by a
`Sampling`, every token fed) as a generator of token ids (each is in the caches when it is yielded); it
ends at a stop token of the format (EOS, the template's end-of-turn token) or `max_new_tokens`, and the
caller may stop it earlier (a newline, a stop string, Ctrl-C, a client gone); `end_reply` then records
the reply as a turn. What a session file holds besides the tokens is `layout` (`conversation_layout`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Protocol

import torch

from litkv.inference.blocks import check_recompute, feed_blocks
from litkv.inference.chat_template import Documents, Format, Message, Replies, TurnSegment
from litkv.inference.conversation_layout import dump_layout, parse_layout
from litkv.inference.generate import decode_tokens
from litkv.inference.sampling import Sampling
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.kvzip import KVzipKVCache
from litkv.modeling.model import GPT
from litkv.modeling.runner import run_chunks
from litkv.states.block_store import BlockStore
from litkv.states.undo import keep_undo_log

__all__ = [
    "refuse_one_shot",
    "Conversation",
    "Feeder",
    "Pending",
    "Row",
    "Run",
    "TurnPlan",
    "held_segments",
    "lossless_overflow",
    "plan_segments",
    "plan_turn",
    "runs",
    "segment_plan",
    "system_count",
]


@dataclass
class Pending:
    """The segments a turn still has to feed; `restart`: from an empty cache (the caches hold other tokens)."""

    segments: list[TurnSegment]
    restart: bool

    @property
    def num_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)


def segment_plan(seg: TurnSegment, next_pos: int, kv_cache: KVCacheConfig) -> ChunkPlan:
    """The calls of a segment fed at `next_pos`: a reply one token per call, the conversation's first
    segment by `prefill_length` then `chunk_size`, a later prompt segment by `chunk_size` (chat and serve)."""
    if seg.reply:
        return ChunkPlan(1, 1)
    if next_pos == 0:
        return ChunkPlan.of(kv_cache)
    return ChunkPlan(kv_cache.chunk_length, kv_cache.chunk_length)


def plan_segments(
    fmt: Format,
    messages: Sequence[Message],
    replies: Replies,
    prefix: Sequence[int] = (),
    add_generation_prompt: bool = True,
    documents: Documents | None = None,
) -> list[TurnSegment]:
    """Every segment of the conversation `prefix` + `messages` in `fmt` (a generation prompt at the end);
    `documents[i]`: the documents' ids of user message `i`. The leading system messages end a segment
    when that is a clean token boundary (`_split_at_system`), so a system prompt's state can be shared by
    conversations (`litkv serve`). Raises the format's `ChatTemplateError`."""
    head = [TurnSegment(tuple(prefix), False)] if prefix else []
    segments = fmt.segments(messages, replies, not prefix, add_generation_prompt, documents)
    return head + _split_at_system(fmt, messages, segments, not prefix)


def system_count(messages: Sequence[Message]) -> int:
    """The leading system messages of a conversation that goes on after them (0: none, or nothing after)."""
    n = next((i for i, (role, _) in enumerate(messages) if role != "system"), len(messages))
    return n if n < len(messages) else 0


def _split_at_system(
    fmt: Format, messages: Sequence[Message], segments: list[TurnSegment], first: bool
) -> list[TurnSegment]:
    """`segments` with a feed boundary at the end of the leading system messages (`system_count`), when
    the ids of their rendering alone (no generation prompt) are a prefix of the segments' prompt text; else
    `segments` as they are (a template that folds the system prompt into the user turn). The ids are the
    same; only where a feed ends moves."""
    n = system_count(messages)
    if n == 0:
        return segments
    try:
        system = fmt.segments(messages[:n], [None] * n, first, False)
    except ValueError:  # a template that refuses a conversation of system messages alone
        return segments
    ids = tuple(t for s in system for t in s.ids)
    at = 0
    for i, seg in enumerate(segments):
        cut = min(len(seg.ids), len(ids) - at)
        if not ids or seg.reply or seg.block or seg.ids[:cut] != ids[at : at + cut]:
            return segments
        at += cut
        if at == len(ids):
            if cut == len(seg.ids):  # already a boundary
                return segments
            return [
                *segments[:i],
                TurnSegment(seg.ids[:cut], False),
                TurnSegment(seg.ids[cut:], False),
                *segments[i + 1 :],
            ]
    return segments


def held_segments(fmt: Format, messages: Sequence[Message], replies: Replies) -> list[TurnSegment]:
    """The segments of a conversation that ends with an assistant message, through its reply: what the
    caches hold after that reply (no generation prompt)."""
    segments = plan_segments(fmt, messages, replies, add_generation_prompt=False)
    last = [i for i, s in enumerate(segments) if s.reply]
    return segments[: last[-1] + 1] if last else segments


def lossless_overflow(kv_cache: KVCacheConfig, filled: int, needed: int) -> int | None:
    """The slots of a lossless `kv_cache` when `filled` tokens and `needed` more exceed them; None when they
    fit or the policy evicts."""
    limit = kv_cache.policy_class.max_tokens(kv_cache)
    return limit if limit is not None and filled + needed > limit else None


@dataclass(frozen=True)
class Run:
    """What one feed puts in a row: a prompt segment, a reply, or a run of documents (block segments) with
    the prompt text after them (their recomputed tokens run with it)."""

    segments: tuple[TurnSegment, ...]

    @property
    def reply(self) -> bool:
        return self.segments[0].reply

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(t for s in self.segments for t in s.ids)

    @property
    def documents(self) -> list[tuple[int, ...]]:
        return [s.ids for s in self.segments if s.block]

    @property
    def text(self) -> tuple[int, ...] | None:
        """The ids of the prompt text after a run of documents (None: none)."""
        rest = [s for s in self.segments if not s.block]
        return rest[0].ids if rest else None


def runs(segments: Sequence[TurnSegment]) -> list[Run]:
    """`segments` grouped as they are fed: each run of documents with the prompt text after it (not a
    reply), every other segment alone."""
    out, i = [], 0
    while i < len(segments):
        end = i + 1
        if segments[i].block:
            while end < len(segments) and segments[end].block:
                end += 1
            end += end < len(segments) and not segments[end].reply
        out.append(Run(tuple(segments[i:end])))
        i = end
    return out


@dataclass(frozen=True)
class TurnPlan:
    """A turn of a conversation that may start from a stored state (`plan_turn`, `litkv serve`).

    Attributes:
        fmt, messages, replies: what the turn was planned from (`replies`: each assistant message's ids).
        segments: every segment of the conversation, with the generation prompt (`plan_segments`).
        system: the leading system messages when the plan feeds them as segments of their own, so that
            their state can be shared (their count; 0: none, or not shared).
        system_segments: how many of `segments` those messages are.
    """

    fmt: Format
    messages: Sequence[Message]
    replies: Replies
    segments: list[TurnSegment]
    system: int
    system_segments: int

    def prefixes(self) -> Iterator[int]:
        """Message counts `k` whose stored state may stand for `messages[:k]`, longest first: a prefix that
        ends with an assistant message, or the shared leading system messages."""
        for k in range(len(self.messages) - 1, 0, -1):
            if self.messages[k - 1][0] == "assistant" or k == self.system:
                yield k

    def held(self, k: int) -> list[TurnSegment] | None:
        """The segments a state of `messages[:k]` holds when they begin this plan's segments, else None."""
        held = held_segments(self.fmt, self.messages[:k], self.replies[:k])
        return held if self.segments[: len(held)] == held else None

    def ids(self, count: int | None = None) -> list[int]:
        """The ids of the first `count` segments (all by default)."""
        return [t for s in self.segments[:count] for t in s.ids]

    def runs_after(self, held: int) -> list[Run]:
        """The runs a row that holds the first `held` segments is fed (`runs`)."""
        return runs(self.segments[held:])

    def overflow(self, kv_cache: KVCacheConfig, held: int, max_new_tokens: int) -> int | None:
        """`lossless_overflow` of a row that holds the first `held` segments, fed the rest and a reply of
        `max_new_tokens`: the lossless cache's slots when they are too few, else None."""
        reused, total = len(self.ids(held)), len(self.ids())
        return lossless_overflow(kv_cache, reused, total - reused + max_new_tokens)

    def after_reply(self, content: str, reply_ids: Sequence[int]) -> list[int]:
        """The ids the caches hold after the reply `content` (generated as `reply_ids`)."""
        messages = [*self.messages, ("assistant", content)]
        held = held_segments(self.fmt, messages, [*self.replies, list(reply_ids)])
        return [t for s in held for t in s.ids]


def plan_turn(
    fmt: Format, messages: Sequence[Message], replies: Replies, documents: Documents | None = None
) -> TurnPlan:
    """The plan of a turn of `messages` in `fmt` (`replies`: each assistant message's ids; `documents`: as in
    `plan_segments`). Raises the format's `ChatTemplateError`."""
    segments = plan_segments(fmt, messages, replies, documents=documents)
    k = system_count(messages)
    system = held_segments(fmt, messages[:k], replies[:k]) if k else []
    shared = bool(system) and segments[: len(system)] == system and len(segments) > len(system)
    return TurnPlan(fmt, messages, replies, segments, k if shared else 0, len(system) if shared else 0)


class Row(Protocol):
    """Where a conversation's runs are fed: a batch-of-one model run (`Conversation`) or one row of the
    server's batch (`litkv.serve`). Each call returns the last token's hidden state (the row's shape)."""

    @property
    def next_pos(self) -> int: ...
    def prefill(self, ids: list[int], plan: ChunkPlan) -> torch.Tensor: ...
    def feed_blocks(
        self, blocks: list[tuple[int, ...]], text: tuple[int, ...] | None, store: BlockStore, recompute: float
    ) -> torch.Tensor: ...


class Feeder:
    """How runs enter a row: prompt text and replies through the chunk runner (`segment_plan`), documents
    spliced from `blocks` with `recompute` of their tokens recomputed in context.

    Args:
        blocks: where documents' KV is kept (default: a store that keeps nothing: computed at each use).
        recompute: the fraction of each spliced document's tokens recomputed in context (0: pure splice).
    """

    def __init__(self, blocks: BlockStore | None = None, recompute: float = 0.0) -> None:
        self.blocks = BlockStore(0) if blocks is None else blocks
        self.recompute = check_recompute(recompute)

    def feed(self, row: Row, run: Run, kv_cache: KVCacheConfig) -> torch.Tensor | None:
        """Feed `run` to `row`; the last token's hidden state, None for an empty reply (nothing to feed)."""
        if run.segments[0].block:
            return row.feed_blocks(run.documents, run.text, self.blocks, self.recompute)
        if not run.ids:
            return None
        return row.prefill(list(run.ids), segment_plan(run.segments[0], row.next_pos, kv_cache))


def refuse_one_shot(kv_cache: KVCacheConfig | Sequence[KVCacheConfig], command: str) -> None:
    """ValueError (one line naming the mode and the policy) for a one-shot cache in a conversation (chat,
    serve): its compression runs once, at the end of one prompt, which a conversation of many turns never
    has, so its turns would run dense without a word."""
    configs = list(kv_cache) if isinstance(kv_cache, (list, tuple)) else [kv_cache]
    for cfg in configs:
        if issubclass(cfg.policy_class, KVzipKVCache):
            raise ValueError(
                f"{command} does not run kvzip (mode='one-shot', its only mode): it compresses one prompt once "
                "after a reconstruction pass, and a conversation feeds turn after turn into a live cache "
                "(docs/kvzip.md); use litkv generate / evaluate for kvzip, or an evicting policy here (e.g. snapkv)"
            )
        if cfg.policy_options.one_shot_budget(cfg.cache_length) is not None:
            raise ValueError(
                f"{command} does not apply --kv_cache.mode one-shot (policy {cfg.policy!r}): the one-shot "
                "compression runs once, at the end of one prompt (litkv generate); a conversation's turns would "
                "stay dense. Use --kv_cache.mode continuous (the default) here"
            )


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
        refuse_one_shot(kv_cache, "litkv chat")
        self.model = model
        self.feeder = Feeder(blocks, recompute)
        self.documents: dict[int, tuple[tuple[int, ...], ...]] = {}
        self.undo_depth = undo_depth
        self.format = fmt
        self.kv_cache = kv_cache
        self.device = model.lm_head.weight.device
        self.messages: list[Message] = []
        self.replies: list[list[int] | None] = []
        self.fed: list[TurnSegment] = []
        self.prefix: TurnSegment | None = None  # tokens of a state without messages (kept before them)
        self._reply: list[int] = []
        self.reset()

    # -- state ----------------------------------------------------------------------------------

    @property
    def blocks(self) -> BlockStore:
        return self.feeder.blocks

    @property
    def recompute(self) -> float:
        return self.feeder.recompute

    @recompute.setter
    def recompute(self, value: float) -> None:
        self.feeder.recompute = check_recompute(value)

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
        segments = held_segments(self.format, messages, replies)
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
        """What a file needs besides the token history to resume the conversation (JSON data, `dump_layout`)."""
        return dump_layout(self.format.name, self.prefix is not None, self.fed, self.messages, self.documents)

    def resume(self, history: list[int], layout: dict[str, object] | None) -> None:
        """Take the caches as they are (restored from a file) as holding `history`, laid out as `layout`
        (from `layout()`); `None`: one prefix without messages (the conversation goes on after it).

        Raises:
            ValueError/TypeError: the layout does not cover the history or does not match its messages
                (`parse_layout`).
        """
        if len(history) != self.next_pos:
            raise ValueError(f"the history has {len(history)} tokens, the caches saw {self.next_pos}")
        read = parse_layout(history, layout)
        self.prefix = read.fed[0] if read.prefix else None
        self._set_messages(read.messages, read.replies, read.documents)
        self.fed = read.fed

    def plan(
        self, messages: Sequence[Message], replies: Replies, documents: Documents | None = None
    ) -> list[TurnSegment]:
        """Every segment of the conversation's prefix (if any) + `messages`, a generation prompt at the end
        (`plan_segments`); `documents[i]`: the documents' ids of user message `i`."""
        prefix = self.prefix.ids if self.prefix is not None else ()
        return plan_segments(self.format, messages, replies, prefix, documents=documents)

    def prepare(self, messages: Sequence[Message], replies: Replies, documents: Documents | None = None) -> Pending:
        """What feeding `messages` (a generation prompt at the end; `documents[i]`: those of user message
        `i`) needs: the segments the caches do not hold yet, or, when the caches hold something else, all of
        them from an empty cache."""
        segments = self.plan(messages, replies, documents)
        if segments[: len(self.fed)] == self.fed:
            return Pending(segments[len(self.fed) :], restart=False)
        return Pending(segments, restart=True)

    def check_room(self, pending: Pending, extra: int) -> None:
        """ValueError when a lossless cache cannot take `pending` and `extra` more tokens."""
        needed = pending.num_tokens + extra
        for cache in self.model.caches.policy_caches:  # a recurrent layer (hybrid models) has no slots
            filled = 0 if pending.restart else cache.num_filled
            limit = lossless_overflow(cache.config, filled, needed)
            if limit is not None:
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
        hidden = None
        for run in runs(pending.segments):
            out = self.feeder.feed(self, run, self.kv_cache)
            hidden = hidden if out is None else out
            self.fed.extend(run.segments)
        if hidden is None:
            raise ValueError("nothing to feed: the conversation's new messages encode to no tokens")
        self._set_messages(messages, replies, documents)
        return hidden

    # -- the row it feeds (`Row`): the model's caches, batch of one ---------------------------------

    def prefill(self, ids: list[int], plan: ChunkPlan) -> torch.Tensor:
        """Run `ids` from `next_pos` in the calls of `plan`; hidden states `(1, 1, n_embd)` of the last token."""
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        start = self.next_pos
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        return run_chunks(self.model, idx, pos, plan, lm_head=False, last_only=True)

    def feed_blocks(
        self, blocks: list[tuple[int, ...]], text: tuple[int, ...] | None, store: BlockStore, recompute: float
    ) -> torch.Tensor:
        """Documents `blocks` spliced (`feed_blocks`; a block is computed alone as a prefill from 0) and
        `text` after them; hidden states `(1, 1, n_embd)` of the last token."""
        ids = [torch.tensor(b, dtype=torch.long) for b in blocks]
        after = None if text is None else torch.tensor(text, dtype=torch.long)
        plan = ChunkPlan.of(self.kv_cache)
        return feed_blocks(self.model, ids, after, self.next_pos, plan, store, recompute)[:, None]

    # -- the reply ------------------------------------------------------------------------------

    @torch.inference_mode()
    def reply(self, hidden: torch.Tensor, max_new_tokens: int, sampling: Sampling) -> Iterator[int]:
        """Pick (by `sampling`) and feed up to `max_new_tokens` tokens after `hidden` `(1, T, n_embd)`, through
        `generate`'s decode loop (`litkv.inference.generate.decode_tokens`, every token fed); yields each token
        once it is in the caches; ends after a stop token of the format (or of `sampling`). `end_reply`
        records it. ValueError when a lossless cache has no room for `max_new_tokens` more."""
        self.check_room(Pending([], restart=False), max_new_tokens)
        self._reply = []
        stops = tuple(sorted({*sampling.stop_tokens, *self.format.stop_ids}))
        sampling = dataclasses.replace(sampling, stop_tokens=stops)
        next_pos = torch.tensor([self.next_pos], device=self.device)
        with closing(decode_tokens(self.model, hidden, next_pos, max_new_tokens, sampling, feed_last=True)) as loop:
            for tokens in loop:
                token = int(tokens[0])
                self._reply.append(token)
                yield token

    def end_reply(self, content: str) -> list[int]:
        """Record the reply produced since `reply` (its tokens are in the caches) as the assistant
        message `content`; returns its ids."""
        ids, self._reply = self._reply, []
        self.fed.append(TurnSegment(tuple(ids), True))
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
