"""Continuous batching: one loop runs every conversation's turn on the rows of one batch (`RowBatch`).

A turn is a `Job`: what its row must be fed (the segments its restored state does not hold) and its
reply's sampling. Each `step()` of the `Scheduler`:

1. drops cancelled jobs (their row is free at once; nothing is stored) and lets waiting jobs into free
   rows (`Engine.admit`: restore the longest stored state into the row, or start it empty);
2. feeds waiting prompt text, chunk by chunk, up to a token budget (`max_step_tokens`): the jobs with
   prompt text left, in the order they were admitted, each feeds its next chunks while they fit the
   budget (the step's first chunk always goes in; the walk stops at the first chunk that does not fit,
   so no prompt overtakes an earlier one). A chunk is exactly a chunk of the solo run (the bounds of
   the segment's `ChunkPlan`, `segment_plan`, cut from the segment's first token), fed at batch one
   (`RowBatch.prefill` of that chunk alone): a row gets the same calls, so the same bits, whatever
   else is fed in the step. With a large budget, prompts that arrive together are all fed before the
   next decode step (not one per round); a long prompt delays the other rows' next token by at most a
   budget's chunks. Documents (a run of KV blocks) go in whole, their tokens counted against the budget. A job
   with no prompt text left samples its first token. The default budget is one chunk per step: prompts
   fed together decode in step and end together, so a closed loop of clients then sends its next turns
   together (docs/serve.md);
3. runs one decode step of the rows in use (`RowBatch.step`: the smallest row count of the batch's rounding
   class that holds them): a generating row feeds its last token, a row that replays a
   reply (a conversation recomputed from its messages) feeds the reply's next id, exactly as decoding
   fed it; the other rows are padding. Each generating row then samples its next token with its own
   settings and generator; a row that is done (stop token, stop string, `max_tokens`) leaves and its
   state is stored (`Engine.finish`).

A stop token of the format (EOS, the template's end-of-turn token) ends a reply and is not fed: the
template's text after the reply writes it, so a reply's cache holds the same tokens whether it ended
there or was cut by `max_tokens`, and a recomputation from the messages' text feeds them the same way.

The loop runs in the caller's thread (`step`, `run_until`), or in its own (`start`), taking jobs from
other threads (`submit`) and giving their output through `Job.emit`.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from litkv.core.validation import require_finite_logits
from litkv.inference.conversation import Run, TurnPlan, segment_plan
from litkv.inference.sampling import sample
from litkv.kvcache.config import ChunkPlan
from litkv.serve.batch import RowBatch
from litkv.serve.turns import TurnRequest, TurnResult

__all__ = ["DEFAULT_STEP_TOKENS", "Job", "Scheduler"]

DEFAULT_STEP_TOKENS = 1  # one chunk per step: a burst of prompts is fed one per round (docs/serve.md)

log = logging.getLogger(__name__)

Emit = Callable[[str, Any], None]  # ("text", str) / ("done", TurnResult) / ("error", Exception)


@dataclass
class Job:
    """One turn on its way through the batch.

    Attributes:
        req, result: the request and what it produced so far.
        cancelled: polled once per step; true: the turn stops, stores nothing.
        emit: receives ("text", delta), then ("done", result) or ("error", exception); from the loop's thread.
        keys, replies: the message prefixes' keys and every assistant message's ids (`Engine.admit`).
        plan: the turn's plan (`litkv.inference.conversation.TurnPlan`, `Engine.admit`).
        pending: runs (`Run`) the row still has to be fed; `forced`: ids of a reply being replayed.
        row: the job's row in the batch (-1: waiting).
        feed: the token the next step feeds (a generated one); `finishing`: the job is done after it.
        chunks: `(start, end)` bounds of `pending[0]`'s ids still to feed (a run fed chunk by chunk).
        hidden: the last fed token's hidden state `(1, n_embd)` (the first token is sampled from it).
        admitted: the job's place in the order of admission (prompt chunks are fed in that order).
    """

    req: TurnRequest
    result: TurnResult
    cancelled: Callable[[], bool] = lambda: False
    emit: Emit = lambda kind, value: None
    keys: list[str] = field(default_factory=list)
    replies: list[list[int] | None] = field(default_factory=list)
    plan: TurnPlan | None = None
    pending: collections.deque[Run] = field(default_factory=collections.deque)
    forced: collections.deque[int] = field(default_factory=collections.deque)
    row: int = -1
    feed: int | None = None
    finishing: bool = False
    done: bool = False
    generator: torch.Generator | None = None
    scanner: Any = None
    chunks: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    hidden: torch.Tensor | None = None
    admitted: int = -1


class Turns(Protocol):
    """What the loop asks of the server's engine (`litkv.serve.engine.Engine`) about a job."""

    top_k: int | None

    def admit(self, job: Job) -> None: ...
    def feed_prompt(self, job: Job, run: Run) -> torch.Tensor: ...
    def prompt_fed(self, job: Job, run: Run) -> None: ...
    def on_token(self, job: Job, token: int) -> bool: ...
    def finish(self, job: Job) -> None: ...


class Scheduler:
    """The decode loop of `litkv serve`: at most `batch.rows` turns at once, the others wait in order.

    Args:
        engine: turns in and out (restore, plan, sampling settings, store).
        batch: the rows.
        max_step_tokens: prompt tokens fed per step at most (but always one chunk when a prompt waits; the
            default, 1: one chunk per step).
    """

    def __init__(self, engine: Turns, batch: RowBatch, max_step_tokens: int = DEFAULT_STEP_TOKENS) -> None:
        if isinstance(max_step_tokens, bool) or not isinstance(max_step_tokens, int) or max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be an int >= 1, got {max_step_tokens!r}")
        self.max_step_tokens = max_step_tokens
        self.engine = engine
        self.batch = batch
        self.rows: list[Job | None] = [None] * batch.rows
        self.waiting: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        self._admitted = 0
        self.last_step_tokens = 0  # prompt tokens the last step fed

    # -- jobs -----------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue `job` (any thread); the loop lets it in when a row is free."""
        with self._lock:
            self.waiting.append(job)
            self._lock.notify()

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(job is not None for job in self.rows)

    def _end(self, job: Job, kind: str, value: Any) -> None:
        job.done = True
        if job.row >= 0:
            self.rows[job.row] = None
            self.batch.release(job.row)
        job.emit(kind, value)

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> None:
        """One round: admit, prompt chunks up to the budget, one decode step (see the module docstring)."""
        with self._lock:
            self._drop_cancelled()
            self._admit()
        self._feed_prompts()
        self._decode()
        self.steps += 1

    def _guard(self, job: Job, action: Callable[[Job], None]) -> None:
        try:
            action(job)
        except Exception as err:  # a turn that fails ends alone; the loop and the other rows go on
            log.exception("turn failed")
            self._end(job, "error", err)

    def _drop_cancelled(self) -> None:
        for job in [*self.waiting, *(j for j in self.rows if j is not None)]:
            if job.cancelled():
                if job in self.waiting:
                    self.waiting.remove(job)
                job.result.finish_reason = "cancelled"
                self._end(job, "done", job.result)

    def _admit(self) -> None:
        while self.waiting and None in self.rows:
            job = self.waiting.popleft()
            job.row = self.rows.index(None)
            job.admitted, self._admitted = self._admitted, self._admitted + 1
            self.rows[job.row] = job
            self._guard(job, self.engine.admit)

    def _feeds_prompt(self, job: Job | None) -> bool:
        """`job` has prompt text to feed now (not a reply being replayed, not a token to decode)."""
        return job is not None and not job.done and bool(job.pending) and not job.forced and job.feed is None

    def _feed_prompts(self) -> None:
        """Feed the waiting prompts' chunks, in admission order, while they fit the step's token budget."""
        left, fed = self.max_step_tokens, 0
        for job in sorted((j for j in self.rows if self._feeds_prompt(j)), key=lambda j: j.admitted):
            while self._feeds_prompt(job):
                cost = self._next_cost(job)
                if fed and cost > left:
                    self.last_step_tokens = fed
                    return
                self._guard(job, self._feed_next)
                left, fed = left - cost, fed + cost
        self.last_step_tokens = fed

    def _next_cost(self, job: Job) -> int:
        """Tokens the job's next feed (`_feed_next`) runs."""
        if job.chunks:
            start, end = job.chunks[0]
            return end - start
        run = job.pending[0]
        if run.reply:
            return 0
        if run.segments[0].block or not run.ids:
            return len(run.ids)
        return next(iter(self._plan(job, run)))[1]

    def _plan(self, job: Job, run: Run) -> collections.deque[tuple[int, int]]:
        """The chunks a solo run feeds `run` in (from the row's next position)."""
        plan = segment_plan(run.segments[0], self.batch.next_pos(job.row), self.batch.kv_cache)
        return collections.deque(plan.bounds(len(run.ids)))

    def _feed_next(self, job: Job) -> None:
        """Feed the job's next chunk of prompt text, or a whole run of
        documents; move a reply to replay to `forced`; sample the first token once no prompt text is left."""
        run = job.pending[0]
        if run.reply:  # a reply to replay: one id per decode step
            job.forced.extend(job.pending.popleft().ids)
            return
        if not job.chunks and (run.segments[0].block or not run.ids):  # documents: in whole
            job.pending.popleft()
            job.hidden = self.engine.feed_prompt(job, run)
            self._ready(job)
            return
        if not job.chunks:
            job.chunks = self._plan(job, run)
        start, end = job.chunks.popleft()
        ids, ended = list(run.ids[start:end]), None
        if not job.chunks:
            job.pending.popleft()
            ended = run
        self._chunk_fed(job, self.batch.prefill(job.row, ids, ChunkPlan(len(ids), len(ids))), ended)

    def _chunk_fed(self, job: Job, hidden: torch.Tensor, ended: Run | None) -> None:
        """A chunk is in the job's row (`hidden`: its last token's `(1, n_embd)`); `ended`: the run it ended."""
        job.hidden = hidden
        if ended is not None:
            self.engine.prompt_fed(job, ended)
            self._ready(job)

    def _ready(self, job: Job) -> None:
        """Sample the job's first token when no prompt is left to feed."""
        if job.pending:
            return
        hidden, job.hidden = job.hidden, None
        if hidden is None:
            raise ValueError("nothing to feed: the conversation's new messages encode to no tokens")
        self._pick(job, self.batch.logits(hidden))

    def _pick(self, job: Job, logits: torch.Tensor) -> None:
        """Sample the job's next token from its logits `(1, V)`; hand it on; end the job at a stop token."""
        req = job.req
        require_finite_logits(bool(torch.isfinite(logits).all()), len(job.result.reply_ids) + 1)
        token = int(sample(logits, req.temperature, self.engine.top_k, req.top_p, job.generator)[0])
        stop = self.engine.on_token(job, token)
        if stop:  # a stop token: not fed; the turn is done
            self._finish(job)
            return
        job.feed = token
        job.finishing = job.scanner.stopped or len(job.result.reply_ids) >= req.max_tokens

    def _finish(self, job: Job) -> None:
        self._guard(job, self.engine.finish)
        if not job.done:
            self._end(job, "done", job.result)

    def _decode(self) -> None:
        tokens: list[int | None] = [None] * self.batch.rows
        positions = [0] * self.batch.rows
        for r, job in enumerate(self.rows):
            if job is None or job.done:
                continue
            if job.forced:
                tokens[r] = job.forced.popleft()
            elif job.feed is not None:
                tokens[r] = job.feed
            else:
                continue
            positions[r] = self.batch.next_pos(r)
        if any(t is not None for t in tokens):
            self._decoded(tokens, self.batch.step(tokens, positions))

    def _decoded(self, tokens: list[int | None], logits: torch.Tensor) -> None:
        """After a decode step: each generating row samples its next token from its logits, or finishes."""
        for r, job in enumerate(self.rows):
            if job is None or tokens[r] is None or job.forced:
                continue
            if job.feed is None:  # the last id of a replayed reply: prompt text (or the first token) next
                continue
            job.feed = None
            if job.finishing:
                self._finish(job)
            else:
                self._guard(job, lambda j, r=r: self._pick(j, logits[r : r + 1]))

    # -- in a thread ----------------------------------------------------------------------------

    def run_until(self, done: Callable[[], bool]) -> None:
        """Step in this thread until `done()` (or nothing is left to do)."""
        while not done() and self.busy:
            self.step()

    def start(self) -> None:
        """Run the loop in a daemon thread (jobs come through `submit`)."""
        self._thread = threading.Thread(target=self._serve, name="litkv-batch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self.busy and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # the loop itself must live: log, end every job, go on
                log.exception("the batch loop failed; ending the turns in flight")
                for job in [j for j in self.rows if j is not None]:
                    self._end(job, "error", RuntimeError("the batch loop failed"))
