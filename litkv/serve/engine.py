"""The turns of `litkv serve`: requests' messages in, reply text out, through stored cache states.

A turn is planned and fed as `litkv chat`'s are (`litkv.inference.conversation`: `plan_segments` in the
checkpoint's chat template or raw text, documents grouped into `runs`, the lossless room check, a
`Feeder` that feeds each run to the job's row of the batch, `_BatchRow`); this module adds what only a
server has: the messages' keys, the stored states and the continuous batch (`litkv.serve.scheduler`).
Prompt text is fed in chunks from its segment's first token, an assistant message one token per decode
step, as decoding fed it: the reply's exact ids when this server generated it (kept next to its state),
else its text's ids (`Engine.text_ids`: the server returns a reply as the text of exactly the tokens it
fed, so the text stands for the same ids unless it does not re-tokenize to them).

A request's messages are matched against stored states at message boundaries: the longest prefix
that ends with an assistant message, or with the leading system messages, and has a state is restored
into the job's row, and only the segments after it are fed. After the reply the row's state is stored
under the prefix that includes the reply; a new conversation's state is also stored once its leading
system messages are fed (when the plan ends a segment there), so conversations that share a system
prompt prefill it once. So a turn's tokens are the same whether its state came from memory, from disk, or was
recomputed from the messages, and whatever else runs in the batch (`litkv.serve.batch`).

A request's `documents` belong to its last user message: each is tokenized alone and put at the start
of the message's content as a KV block (`litkv.inference.chat_template`), its KV taken from the server's block
store (`litkv.states.block_store.BlockStore`, computed alone once) and spliced at its offset, `recompute` of its
tokens recomputed (docs/blocks.md). They are in that message's key, so a state is restored only for the
same documents; a later request that wants them in its history sends them again (spliced again from the
store; the earlier turns are then recomputed from their text).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from litkv.core.tokens import encode_text
from litkv.inference.blocks import encode_document
from litkv.inference.chat_template import (
    ChatTemplateError,
    Documents,
    Format,
    Message,
    RawFormat,
    TemplateFormat,
    TurnSegment,
)
from litkv.inference.conversation import (
    Feeder,
    Run,
    check_turn_policy,
    held_segments,
    lossless_overflow,
    plan_segments,
    runs,
    system_count,
)
from litkv.inference.text_stream import TextStream
from litkv.modeling.config import KVCacheConfig
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT
from litkv.modeling.runner import ChunkPlan
from litkv.serve.batch import RowBatch
from litkv.serve.scheduler import DEFAULT_STEP_TOKENS, Job, Scheduler
from litkv.serve.store import ConversationStore
from litkv.serve.turns import RequestError, TurnRequest, TurnResult
from litkv.states.block_store import BlockStore

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

__all__ = [
    "ROLES",
    "Engine",
    "RequestError",
    "TurnRequest",
    "TurnResult",
    "count_prompt_tokens",
    "document_ids",
    "message_keys",
]

ROLES = ("system", "user", "assistant")
log = logging.getLogger(__name__)


def message_keys(root: str, messages: Sequence[Message], documents: Sequence[str] = ()) -> list[str]:
    """Digest of each prefix: `keys[k]` covers `messages[:k]` (`keys[0]` is `root`); `documents`: those of
    the last message (in its key)."""
    keys = [root]
    for i, (role, content) in enumerate(messages):
        docs = list(documents) if i == len(messages) - 1 and documents else []
        text = json.dumps([keys[-1], role, content, *([docs] if docs else [])], ensure_ascii=False)
        keys.append(hashlib.sha256(text.encode()).hexdigest())
    return keys


def document_ids(
    tokenizer: Tokenizer, documents: Sequence[str], max_count: int, max_tokens: int
) -> list[tuple[int, ...]]:
    """Each document's ids (tokenized alone); RequestError (400) naming the limit for more than `max_count`
    documents, an empty one, or more than `max_tokens` tokens in all."""
    if len(documents) > max_count:
        raise RequestError(f"documents: at most {max_count} per request, got {len(documents)}", param="documents")
    out = []
    for k, text in enumerate(documents):
        if not isinstance(text, str) or not text:
            raise RequestError(f"documents[{k}] must be a non-empty string", param="documents")
        try:
            out.append(encode_document(tokenizer, text, f"documents[{k}]"))
        except ValueError as err:
            raise RequestError(str(err), param="documents") from None
    total = sum(len(ids) for ids in out)
    if total > max_tokens:
        raise RequestError(f"documents: at most {max_tokens} tokens in all per request, got {total}", param="documents")
    return out


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
    """Turns of conversations on one model, continuously batched (`litkv.serve.scheduler`): restores and
    stores cache states, plans what each turn feeds (`litkv.inference.conversation`'s planning), samples and
    cuts replies (`litkv.inference.text_stream.TextStream`).

    Args:
        model: the GPT.
        tokenizer: the checkpoint's tokenizer.
        kv_cache: the cache config of every layer.
        store: where conversation states live.
        top_k: sample among the k most likely tokens (as `litkv chat`'s `--top_k`).
        stop_at_newline: end a reply at its first newline, which it keeps (as `litkv chat`); default:
            only for raw text.
        default_seed: sampler seed of a request without `seed`.
        fmt: how messages become tokens (`litkv.inference.chat_template.load_format`); default raw text.
        max_batch: rows of the running batch (turns run at once; more wait).
        blocks: where documents' KV is kept (default: a store that keeps nothing).
        recompute: the fraction of each spliced document's tokens recomputed in context (0: pure splice).
        max_documents, max_document_tokens: most documents of a request, and their tokens in all.
        max_step_tokens: prompt tokens a step of the batch feeds at most (`litkv.serve.scheduler`).
        packed_steps: run a step's prompt chunks and decode rows in one model call where the model allows
            (`RowBatch`'s `packing`; exact either way).
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        kv_cache: KVCacheConfig,
        store: ConversationStore,
        top_k: int | None = 50,
        stop_at_newline: bool | None = None,
        default_seed: int = 1234,
        fmt: Format | None = None,
        max_batch: int = 8,
        blocks: BlockStore | None = None,
        recompute: float = 0.0,
        max_documents: int = 8,
        max_document_tokens: int = 8192,
        max_step_tokens: int = DEFAULT_STEP_TOKENS,
        packed_steps: bool = False,
    ) -> None:
        check_turn_policy(kv_cache, "serve")
        self.feeder = Feeder(blocks, recompute)
        self.max_documents, self.max_document_tokens = max_documents, max_document_tokens
        self.model = model
        self.tokenizer = tokenizer
        self.kv_cache = kv_cache
        self.store = store
        self.top_k = top_k
        self.format = fmt or RawFormat(tokenizer)
        self.stop_at_newline = self.format.name == "raw" if stop_at_newline is None else stop_at_newline
        self.default_seed = default_seed
        self.batch = RowBatch(model, kv_cache, max_batch, packing=packed_steps)
        self.scheduler = Scheduler(self, self.batch, max_step_tokens)
        # the steps' rounding class is in the key: a state's rounding is that of decode steps of that class
        # the planning's feed boundaries are in the key too: a state fed in other chunks rounds otherwise
        identity = [model_fingerprint(model), repr(kv_cache), f"step-rounding-rows={self.batch.rounding_rows}"]
        identity.append("plan=system-boundary")
        if isinstance(self.format, TemplateFormat):  # another format: other tokens, other states
            identity.append(self.format.template.source)
        self.root = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        self.device = model.lm_head.weight.device
        # row -> (the run that ends the leading system messages, its key, the ids through it): stored once fed
        self._share: dict[int, tuple[Run, str, list[int]]] = {}

    # -- tokens ---------------------------------------------------------------------------------

    def count_prompt_tokens(self, messages: Sequence[Message], documents: Sequence[str] = ()) -> int:
        """Tokens of the whole conversation (assistant replies re-tokenised: an estimate for limits)."""
        docs = document_ids(self.tokenizer, documents, self.max_documents, self.max_document_tokens)
        return count_prompt_tokens(self.format, messages, {len(messages) - 1: docs} if docs else None)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(torch.tensor(ids, dtype=torch.long)) if ids else ""

    def text_ids(self, content: str) -> list[int]:
        """The ids an assistant message's text stands for, fed as a reply is (no BOS, nothing added: the
        server returns a reply as the text of exactly the tokens it fed, stop token excluded)."""
        if not content:
            return []
        return [int(t) for t in encode_text(self.tokenizer, content)]  # a control string in it is text

    def _replies(self, keys: list[str], messages: Sequence[Message]) -> list[list[int] | None]:
        """Each assistant message's ids: those it was generated as (stored), else its text's (`text_ids`)."""
        out: list[list[int] | None] = []
        for i, (role, content) in enumerate(messages):
            if role != "assistant":
                out.append(None)
                continue
            known = self.store.reply_ids(keys[i + 1])
            if known is not None and not self._decode(known).startswith(content):
                log.warning("state store: the stored reply ids of %s do not give its text: ignored", keys[i + 1][:12])
                self.store.drop_reply(keys[i + 1])
                known = None
            out.append(known if known is not None else self.text_ids(content))
        return out

    # -- a turn's way through the batch ---------------------------------------------------------

    def admit(self, job: Job) -> None:
        """Put `job` on its row: the longest stored state of its messages (else an empty row), and the
        segments still to feed; RequestError when they do not fit a lossless cache."""
        req = job.req
        docs = document_ids(self.tokenizer, req.documents, self.max_documents, self.max_document_tokens)
        job.keys = message_keys(self.root, req.messages, req.documents)
        job.replies = self._replies(job.keys, req.messages)
        documents: Documents = {len(req.messages) - 1: docs} if docs else {}
        try:
            segments = plan_segments(self.format, req.messages, job.replies, documents=documents)
        except ChatTemplateError as err:  # the chat template refuses this conversation
            raise RequestError(err.reason, param="messages") from None
        system = self._system_segments(job, segments)
        held = self._restore_longest(job, segments, len(system))
        job.pending = collections.deque(runs(segments[held:]))
        self._share.pop(job.row, None)
        if system and held == 0 and not self.store.has(job.keys[system_count(req.messages)]):
            self._share_after(job, len(system), [i for s in system for i in s.ids])
        job.result.reused_tokens = sum(len(s.ids) for s in segments[:held])
        job.result.prompt_tokens = sum(len(s.ids) for s in segments)
        needed = job.result.prompt_tokens - job.result.reused_tokens + req.max_tokens
        limit = lossless_overflow(self.kv_cache, job.result.reused_tokens, needed)
        if limit is not None:
            raise RequestError(
                f"the conversation needs {job.result.prompt_tokens + req.max_tokens} tokens, more than the "
                f"{self.kv_cache.policy} cache's {limit} slots; use an evicting policy (--kv-cache h2o) or "
                "a larger --kv_cache.cache_length",
                code="context_length_exceeded",
                param="messages",
            )
        job.generator = torch.Generator(device=self.device)
        job.generator.manual_seed(self.default_seed if req.seed is None else req.seed)
        job.scanner = TextStream(self.tokenizer, req.stop, self.stop_at_newline)

    def _system_segments(self, job: Job, segments: list[TurnSegment]) -> list[TurnSegment]:
        """The segments of the job's leading system messages when the plan feeds them alone (a clean token
        boundary after them, `plan_segments`); else [] (their state is not shared)."""
        k = system_count(job.req.messages)
        if k == 0:
            return []
        held = held_segments(self.format, job.req.messages[:k], job.replies[:k])
        return held if held and segments[: len(held)] == held and len(segments) > len(held) else []

    def _share_after(self, job: Job, count: int, ids: list[int]) -> None:
        """Store the row's state once the runs of the first `count` segments (the system messages) are fed."""
        fed = 0
        for run in job.pending:
            fed += len(run.segments)
            if fed == count:
                self._share[job.row] = (run, job.keys[system_count(job.req.messages)], ids)
                return
            if fed > count:
                return

    def _restore_longest(self, job: Job, segments: list[TurnSegment], system: int = 0) -> int:
        """Load the longest stored prefix that ends with an assistant message, or with the leading system
        messages when they are the first `system` segments, into the job's row; how many of `segments` it
        holds (0: the row starts empty)."""
        messages = job.req.messages
        shared = system_count(messages) if system else 0
        for k in range(len(messages) - 1, 0, -1):
            if messages[k - 1][0] != "assistant" and k != shared:
                continue
            if not self.store.has(job.keys[k]):
                continue
            held = held_segments(self.format, messages[:k], job.replies[:k])
            if segments[: len(held)] != held:
                continue
            ids = [i for s in held for i in s.ids]
            state = self.store.get(job.keys[k], ids)
            last = -1 if state is None or state.last_pos is None else int(state.last_pos[0])
            if state is None or len(ids) != last + 1:
                continue
            try:
                self.batch.load(job.row, state)
            except ValueError:  # taken with another config: never restored
                continue
            return len(held)
        self.batch.clear(job.row)
        return 0

    def feed_prompt(self, job: Job, run: Run) -> torch.Tensor:
        """Feed a run of the job's prompt (a prompt segment, or documents and the text after them) to the job's
        row (`litkv.inference.conversation.Feeder`); the last token's hidden state `(1, n_embd)`."""
        before = self.feeder.blocks.reused_tokens
        hidden = self.feeder.feed(_BatchRow(self.batch, job.row), run, self.kv_cache)
        job.result.block_tokens += self.feeder.blocks.reused_tokens - before
        if hidden is None:
            raise ValueError("nothing to feed: a prompt run without tokens")
        self.prompt_fed(job, run)
        return hidden

    def prompt_fed(self, job: Job, run: Run) -> None:
        """`run` is in the job's row (`feed_prompt`, or the scheduler's chunks): store the row's state when it
        ends the leading system messages (conversations sharing them restore it)."""
        shared = self._share.get(job.row)
        if shared is not None and shared[0] is run:  # the system messages are in: their state is shared
            del self._share[job.row]
            _, key, ids = shared
            if not self.store.has(key):
                self.store.put(key, self.batch.take(job.row), [], ids)

    def on_token(self, job: Job, token: int) -> bool:
        """A sampled token: True when it is a stop token (the reply ends before it); else it joins the reply
        and its text goes out (up to a stop string)."""
        result = job.result
        result.generated += 1
        if token in self.format.stop_ids:
            result.finish_reason = "stop"
            delta = job.scanner.finish()
            if delta:
                job.emit("text", delta)
            return True
        result.reply_ids.append(token)
        delta = job.scanner.add(token)
        if job.scanner.stopped:
            result.finish_reason = "stop"
        elif len(result.reply_ids) >= job.req.max_tokens:
            result.finish_reason = "length"
            delta += job.scanner.finish()
        if delta:
            job.emit("text", delta)
        return False

    def finish(self, job: Job) -> None:
        """The turn is done and its tokens are in its row: store the row's state under the conversation
        with the reply."""
        result = job.result
        result.content = job.scanner.content
        key = message_keys(job.keys[-1], [("assistant", result.content)])[-1]
        messages = [*job.req.messages, ("assistant", result.content)]
        held = held_segments(self.format, messages, [*job.replies, list(result.reply_ids)])
        self.store.put(key, self.batch.take(job.row), result.reply_ids, [i for s in held for i in s.ids])
        result.stored = True

    # -- one turn, in this thread ---------------------------------------------------------------

    def run(self, req: TurnRequest, result: TurnResult, cancelled: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Run a turn (with any others submitted) in this thread; yields the reply's text as it comes and
        fills `result`. The state after the reply is stored only when the turn ends normally."""
        check_messages(req.messages)
        out: list[tuple[str, object]] = []
        job = Job(req, result, cancelled, lambda kind, value: out.append((kind, value)))
        self.scheduler.submit(job)
        while not job.done or out:
            if not out:
                self.scheduler.step()
                continue
            kind, value = out.pop(0)
            if kind == "text":
                yield value  # type: ignore[misc]
            elif kind == "error":
                raise value  # type: ignore[misc]


def count_prompt_tokens(fmt: Format, messages: Sequence[Message], documents: Documents | None = None) -> int:
    """Tokens of a request's messages (and `documents`) in `fmt` with the generation prompt (assistant
    replies re-tokenised from their text: an estimate for limits, made before the stored reply ids are
    looked up)."""
    try:
        segments = plan_segments(fmt, messages, [None] * len(messages), documents=documents)
    except ChatTemplateError as err:  # the chat template refuses this conversation (raise_exception, ...)
        raise RequestError(err.reason, param="messages") from None
    return sum(len(s.ids) for s in segments)


class _BatchRow:
    """One row of the server's batch as a conversation's `Row` (`litkv.inference.conversation.Row`)."""

    def __init__(self, batch: RowBatch, row: int) -> None:
        self.batch, self.row = batch, row

    @property
    def next_pos(self) -> int:
        return self.batch.next_pos(self.row)

    def prefill(self, ids: list[int], plan: ChunkPlan) -> torch.Tensor:
        return self.batch.prefill(self.row, ids, plan)

    def feed_blocks(
        self, blocks: list[tuple[int, ...]], text: tuple[int, ...] | None, store: BlockStore, recompute: float
    ) -> torch.Tensor:
        return self.batch.feed_blocks(self.row, blocks, text, store, recompute)
