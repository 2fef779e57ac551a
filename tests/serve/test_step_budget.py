"""Prompts fed inside the batch's steps under a token budget (`litkv.serve.scheduler`, `max_step_tokens`):
a step feeds the chunks of as many waiting prompts as fit, each chunk exactly a chunk of the solo run, and
every row stays bitwise equal to its solo run (reply ids and every logits row sampled from), for every
built-in policy, with ragged prompts arriving while other rows decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.kvcache import known_policies
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult
from litkv.serve.scheduler import Job, Scheduler
from tests.helpers import WORDS, attach_random_gates, evicts_alone


@pytest.fixture(scope="module")
def model_and_tok(ckpt: Path) -> tuple:
    return attach_random_gates(load_model(ckpt)), load_tokenizer(ckpt)  # gates: the learned policy too


def kv_config(policy: str) -> KVCacheConfig:
    """Evicting caches (24 slots; dense: lossless 256) cut 5 tokens first, then 8."""
    return KVCacheConfig(policy=policy, cache_length=256 if policy == "dense" else 24, chunk_size=8, prefill_length=5)


def make_engine(model_and_tok: tuple, kv: KVCacheConfig, **kw: object) -> Engine:
    model, tok = model_and_tok
    store = ConversationStore(1 << 30, model=model, kv_cache=kv)
    return Engine(model, tok, kv, store, stop_at_newline=False, max_batch=4, **kw)  # type: ignore[arg-type]


def conversations(n: int) -> tuple[list[list[str]], list[list[int]]]:
    """`n` conversations of 2 turns, prompts of ragged lengths (1 to 4 chunks), and their reply budgets."""
    convs = [[" ".join(WORDS[(i + 5 * t) % 9 :][: 2 + (3 * i + 7 * t) % 13]) for t in range(2)] for i in range(n)]
    return convs, [[3 + (i + 2 * t) % 5 for t in range(2)] for i in range(n)]


class Trace:
    """Per step: the prompt chunks fed (row, start position, width, the job's id) and the rows a decode step fed."""

    def __init__(self, eng: Engine) -> None:
        self.steps: list[tuple[list[tuple[int, int, int, int]], set[int]]] = [([], set())]
        batch = eng.batch
        prefill, step = batch.prefill, batch.step

        def record_prefill(row: int, ids: list[int], plan: ChunkPlan) -> torch.Tensor:
            start, job = batch.next_pos(row), id(eng.scheduler.rows[row])
            self.steps[-1][0].extend((row, start + s, e - s, job) for s, e in plan.bounds(len(ids)))
            return prefill(row, ids, plan)

        def record_step(tokens: list[int | None], positions: list[int]) -> torch.Tensor:
            self.steps[-1][1].update(r for r, t in enumerate(tokens) if t is not None)
            return step(tokens, positions)

        batch.prefill, batch.step = record_prefill, record_step  # type: ignore[method-assign]

    def next_step(self) -> None:
        self.steps.append(([], set()))


def whole_runs(eng: Engine) -> Engine:
    """`eng` feeding each prompt run in whole through `Engine.feed_prompt` (the chunk runner over the whole
    segment, as `litkv chat` feeds it), one run per step: the reference the budgeted chunks must equal."""
    sched = eng.scheduler

    def feed_whole(job: Job) -> None:
        run = job.pending.popleft()
        if run.reply:
            job.forced.extend(run.ids)
            return
        job.hidden = eng.feed_prompt(job, run)
        if not job.pending:
            sched._pick(job, eng.batch.logits(job.hidden))

    sched._feed_next = feed_whole  # type: ignore[method-assign]
    sched.max_step_tokens = 1  # one run per step
    return eng


def run(eng: Engine, convs: list[list[str]], budgets: list[list[int]], stagger: bool = True) -> tuple[list, Trace]:
    """Every conversation's turns (a turn arrives some steps after the last one ended, or all at once); per
    conversation and turn: (reply ids, the logits rows it sampled from); the trace, whose `owner` maps a
    job's id to its conversation."""
    sched, trace = eng.scheduler, Trace(eng)
    messages: list[list] = [[] for _ in convs]
    got: list[list] = [[] for _ in convs]
    jobs: dict[int, Job] = {}
    seen: dict[int, list[torch.Tensor]] = {}
    pick = sched._pick

    def record(job: Job, logits: torch.Tensor) -> None:
        seen.setdefault(id(job), []).append(logits.clone())
        pick(job, logits)

    sched._pick = record  # type: ignore[method-assign]
    trace.owner = {}
    while any(len(g) < len(c) for g, c in zip(got, convs, strict=True)):
        for i, conv in enumerate(convs):
            turn = len(got[i])
            if i not in jobs and turn < len(conv) and (not stagger or (i + sched.steps) % (2 + i % 3) == 0):
                messages[i].append(("user", conv[turn]))
                jobs[i] = Job(TurnRequest(list(messages[i]), budgets[i][turn]), TurnResult(), emit=raise_error)
                trace.owner[id(jobs[i])] = i
                sched.submit(jobs[i])
        sched.step()
        trace.next_step()
        for i, job in list(jobs.items()):
            if job.done:
                assert job.result.finish_reason in ("stop", "length"), job.result.finish_reason
                messages[i].append(("assistant", job.result.content))
                got[i].append((job.result.reply_ids, torch.cat(seen.pop(id(job)))))
                del jobs[i]
    return got, trace


def raise_error(kind: str, value: object) -> None:
    """A job's emit: a turn that fails fails the test with its error."""
    if kind == "error":
        raise value  # type: ignore[misc]


def assert_equal(together: list, solo: list) -> None:
    for mine, alone in zip(together, solo, strict=True):
        for (ids, logits), (ids_alone, logits_alone) in zip(mine, alone, strict=True):
            assert ids == ids_alone and torch.equal(logits, logits_alone)  # bitwise


@pytest.mark.parametrize("policy", [p for p in known_policies() if evicts_alone(p)])
def test_prompts_fed_beside_decoding_rows_equal_solo_runs(model_and_tok: tuple, policy: str) -> None:
    """One chunk per step (budget 8: a prompt spread over steps while the other rows decode) and a budget of
    several prompts' chunks at once: every reply and every logits row equals its solo run (the chunk runner over
    the whole segment), bitwise."""
    kv = kv_config(policy)
    convs, budgets = conversations(6)
    solo = [
        run(whole_runs(make_engine(model_and_tok, kv)), [c], [b])[0][0] for c, b in zip(convs, budgets, strict=True)
    ]
    for step_tokens in (8, 64):
        eng = make_engine(model_and_tok, kv, max_step_tokens=step_tokens)
        together, trace = run(eng, convs, budgets)
        assert_equal(together, solo)
        beside = [s for s in trace.steps if s[0] and s[1] - {r for r, _, _, _ in s[0]}]
        assert beside, "no prompt chunk was fed in a step where other rows decoded"
        for fed, _ in trace.steps:
            assert len(fed) <= 1 or sum(w for _, _, w, _ in fed) <= step_tokens  # a step's chunks fit the budget
        if step_tokens == 64:
            assert any(len({r for r, _, _, _ in fed}) >= 2 for fed, _ in trace.steps)  # several prompts in one step


def test_chunks_are_the_solo_runs_chunks(model_and_tok: tuple) -> None:
    """Prompts arriving together under a budget of 13 tokens: each conversation is fed exactly the chunks of
    its solo run through the chunk runner (5 tokens first, then 8, from the segment's first token); a step
    feeds the prompts in admission order while their chunks fit (so 5 + 8 of one prompt, or chunks of several),
    every chunk alone."""
    kv = kv_config("h2o")
    convs, budgets = conversations(4)

    def chunks(trace: Trace, n: int) -> list[list[tuple[int, int]]]:
        out: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for fed, _ in trace.steps:
            for _, pos, width, job in fed:
                out[trace.owner[job]].append((pos, width))
        return out

    solo, solo_chunks = [], []
    for conv, budget in zip(convs, budgets, strict=True):
        got, trace = run(whole_runs(make_engine(model_and_tok, kv)), [conv], [budget], stagger=False)
        solo.append(got[0])
        solo_chunks += chunks(trace, 1)
    eng = make_engine(model_and_tok, kv, max_step_tokens=13)
    together, trace = run(eng, convs, budgets, stagger=False)
    assert_equal(together, solo)
    assert chunks(trace, len(convs)) == solo_chunks
    assert any(c[:2] == [(0, 5), (5, 8)] for c in solo_chunks)  # the first segment: prefill_length, then chunk_size
    widths = [[w for _, _, w, _ in fed] for fed, _ in trace.steps if fed]
    assert [5, 8] in widths  # two chunks of one prompt in a step
    assert any(len({job for _, _, _, job in fed}) >= 2 for fed, _ in trace.steps)  # chunks of several prompts
    assert all(len(w) == 1 or sum(w) <= 13 for w in widths)


@pytest.mark.parametrize("bad", [0, -1, True, 8.0, "8"])
def test_max_step_tokens_is_checked(model_and_tok: tuple, bad: object) -> None:
    eng = make_engine(model_and_tok, kv_config("h2o"))
    with pytest.raises(ValueError, match="max_step_tokens must be an int >= 1"):
        Scheduler(eng, eng.batch, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, True])
def test_serve_refuses_a_bad_max_step_tokens_before_starting(ckpt: Path, bad: object) -> None:
    from litkv.cli.serve_cmd import serve

    with pytest.raises(ValueError, match="max_step_tokens"):
        serve(ckpt, max_step_tokens=bad)  # type: ignore[arg-type]
