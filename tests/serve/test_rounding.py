"""Rounding classes measured at start (`litkv.serve.rounding`) and decode steps that run the smallest row
count of the batch's class (`litkv.serve.batch.RowBatch`): the probe agrees with a brute-force comparison,
and rows stay bitwise equal to their solo runs when the step's row count changes within the class."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.kvcache.config import KVCacheConfig
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult
from litkv.serve.rounding import RoundingClasses, probe_rounding_classes
from litkv.serve.scheduler import Job

# SmolLM2-135M's matrix products: qkv, attention out, MLP in (x2), MLP out, lm head
SMOLLM2_SHAPES = [(576, 960), (576, 576), (576, 1536), (1536, 576), (576, 49152)]
FAST_SHAPES = [*SMOLLM2_SHAPES[:4], (576, 4096)]  # the lm head cut to 4,096 rows: a fast test


def brute_force_classes(layers: list[nn.Module], max_rows: int) -> list[set[int]]:
    """Counts grouped by comparing every pair of counts on every row they share, with the rows in two
    orders (so every input row sits at two places): an independent oracle of the probe."""
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(max_rows, layer.in_features, generator=gen) for layer in layers]
    perm = torch.randperm(max_rows, generator=gen)
    with torch.inference_mode():
        out = {
            m: [
                (layer(x[:m]), layer(x[perm[perm < m]])[torch.argsort(perm[perm < m])])
                for layer, x in zip(layers, xs, strict=True)
            ]
            for m in range(1, max_rows + 1)
        }
    stable = {m for m in out if all(torch.equal(a, b) for a, b in out[m])}
    groups: list[set[int]] = []
    for m in range(1, max_rows + 1):
        same = [
            g
            for g in groups
            if m in stable
            and all(
                k in stable and all(torch.equal(a[0][:k], b[0][:k]) for a, b in zip(out[k], out[m], strict=True))
                for k in g
            )
        ]
        if same:
            same[0].add(m)
        else:
            groups.append({m})
    return groups


def test_probe_agrees_with_brute_force_on_smollm2_shapes() -> None:
    layers = [nn.Linear(a, b, bias=False) for a, b in FAST_SHAPES]
    model = nn.Sequential(*layers)
    probed = probe_rounding_classes(model, 16)
    assert [set(c) for c in probed.classes] == brute_force_classes(layers, 16)
    assert sorted(itertools.chain(*probed.classes)) == list(range(1, 17))  # a partition of 1..16


#: What another CPU may measure (an AMD EPYC with AVX512: `1 / 2-3 / 4-16`): the tests below that depend on
#: the classes run with the measured ones and with these, reported by a stand-in probe.
OTHER_CPU = RoundingClasses(((1,), (2, 3), tuple(range(4, 17))))


def emulated_probe(classes: RoundingClasses):  # noqa: ANN201
    """A stand-in for `probe_rounding_classes` that reports `classes` cut to `1..max_rows`."""

    def probe(model: nn.Module, max_rows: int, dtype: torch.dtype | None = None, seed: int = 0) -> RoundingClasses:
        cut = tuple(tuple(r for r in group if r <= max_rows) for group in classes.classes)
        return RoundingClasses(tuple(g for g in cut if g))

    return probe


def expected_step_rows(groups: list[set[int]], active: int, batch_rows: int) -> int:
    """The smallest count >= `active` of the group holding `batch_rows`, from brute-force groups."""
    group = next(g for g in groups if batch_rows in g)
    return min(r for r in group if r >= active)


@pytest.mark.parametrize("shapes", [FAST_SHAPES, pytest.param(SMOLLM2_SHAPES, marks=pytest.mark.slow)])
def test_step_rows_follow_the_classes_measured_here(shapes: list) -> None:
    """On whatever CPU runs the suite: the probe's classes are the brute-force groups, and a step runs the
    smallest count of the batch's group that holds the active rows (for every batch size 1..16)."""
    layers = [nn.Linear(a, b, bias=False) for a, b in shapes]
    probed = probe_rounding_classes(nn.Sequential(*layers), 16)
    groups = brute_force_classes(layers, 16)
    assert [set(c) for c in probed.classes] == groups
    for batch_rows in range(1, 17):
        got = [probed.step_rows(n, batch_rows) for n in range(batch_rows + 1)]
        assert got == [expected_step_rows(groups, max(n, 1), batch_rows) for n in range(batch_rows + 1)], batch_rows


def test_step_rows_with_another_cpus_classes() -> None:
    """`1 / 2-3 / 4-16` (not this machine's, whatever it is): steps of a batch of 8 run 2, 3 or 4..8 rows."""
    assert OTHER_CPU.describe() == "1 / 2-3 / 4-16"
    assert [OTHER_CPU.step_rows(n, 8) for n in range(9)] == [4, 4, 4, 4, 4, 5, 6, 7, 8]
    assert [OTHER_CPU.step_rows(n, 3) for n in range(4)] == [2, 2, 2, 3]
    assert OTHER_CPU.step_rows(1, 1) == 1 and OTHER_CPU.step_rows(3, 16) == 4


def test_step_rows_and_errors() -> None:
    classes = RoundingClasses(((1,), (2, 3, 5), (4,)))
    assert classes.describe() == "1 / 2-3,5 / 4"
    assert [classes.step_rows(n, 5) for n in range(6)] == [2, 2, 2, 3, 5, 5]
    with pytest.raises(ValueError, match="were not probed"):
        classes.class_of(6)
    with pytest.raises(ValueError, match="max_rows"):
        probe_rounding_classes(nn.Linear(2, 2), 0)


# -- rows through the batch with the measured classes -------------------------------------------------


@pytest.fixture(scope="module")
def model_and_tok(ckpt: Path) -> tuple:
    return load_model(ckpt), load_tokenizer(ckpt)


def narrow_batch(classes: RoundingClasses) -> int:
    """A `--max_batch` whose class holds several counts below it (steps then run fewer rows), from the classes
    measured here (or reported by a stand-in probe)."""
    for rows in range(classes.max_rows, 1, -1):
        if rows not in classes.place_dependent and min(classes.class_of(rows)) < rows - 1:
            return rows
    pytest.skip(f"no class with 3 counts here: {classes.describe()}")


def refines(reported: RoundingClasses, measured: RoundingClasses, rows: int) -> bool:
    """Whether every count of `reported`'s class of `rows` rounds alike here (`measured`): only then are rows
    stepped by the reported classes bitwise their solo runs."""
    return set(reported.class_of(rows)) <= set(measured.class_of(rows))


def run_together(eng: Engine, convs: list[list[str]], budgets: list[list[int]]) -> tuple[list, set[int]]:
    """Every conversation's turns, arriving staggered; (per conversation and turn: reply ids and every logits
    row it sampled from, stacked; row counts stepped)."""
    sched, messages = eng.scheduler, [[] for _ in convs]
    got: list[list] = [[] for _ in convs]
    jobs: dict[int, Job] = {}
    stepped = set()
    seen: dict[int, list[torch.Tensor]] = {}
    pick = sched._pick

    def record(job: Job, logits: torch.Tensor) -> None:
        seen.setdefault(id(job), []).append(logits.clone())
        pick(job, logits)

    sched._pick = record
    while any(len(g) < len(c) for g, c in zip(got, convs, strict=True)):
        for i, conv in enumerate(convs):
            turn = len(got[i])
            if i not in jobs and turn < len(conv) and (i + sched.steps) % (2 + i % 3) == 0:
                messages[i].append(("user", conv[turn]))
                jobs[i] = Job(TurnRequest(list(messages[i]), budgets[i][turn]), TurnResult())
                sched.submit(jobs[i])
        eng.batch.last_step_rows = 0
        sched.step()
        if eng.batch.last_step_rows:  # 0: the step only fed prompt chunks
            stepped.add(eng.batch.last_step_rows)
        for i, job in list(jobs.items()):
            if job.done:
                messages[i].append(("assistant", job.result.content))
                got[i].append((job.result.reply_ids, torch.cat(seen.pop(id(job)))))
                del jobs[i]
    return got, stepped


@pytest.mark.parametrize(
    ("policy", "classes_from"),
    [("h2o", "measured"), ("keydiff", "measured"), ("dense", "measured"), ("h2o", "another CPU")],
)
def test_rows_equal_solo_runs_across_step_row_counts(
    model_and_tok: tuple, policy: str, classes_from: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Conversations join and leave a batch whose steps run 1 row alone and up to every row (the class's
    boundaries), with evicting caches: each equals its solo run; a solo run stepped the class's smallest count.
    With another CPU's classes (a stand-in probe reports `1 / 2-3 / 4-16`) the steps follow them; their rows
    are compared bitwise only where those classes round alike on this machine too."""
    model, tok = model_and_tok
    measured = probe_rounding_classes(model, 12)
    reported = emulated_probe(OTHER_CPU)(model, 12) if classes_from == "another CPU" else measured
    if classes_from == "another CPU":
        monkeypatch.setattr("litkv.serve.batch.probe_rounding_classes", emulated_probe(OTHER_CPU))
    rows = narrow_batch(reported)
    length = 256 if policy == "dense" else 20
    kv = KVCacheConfig(policy=policy, cache_length=length, chunk_size=8)

    def engine() -> Engine:
        store = ConversationStore(1 << 30, model=model, kv_cache=kv)
        return Engine(model, tok, kv, store, stop_at_newline=False, max_batch=rows)

    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "in", "the", "beginning"]
    convs = [[" ".join(words[(i + t) % 5 : (i + t) % 5 + 3 + (i * t) % 7]) for t in range(2)] for i in range(rows + 1)]
    budgets = [[4 + (i + t) % 5 for t in range(2)] for i in range(rows + 1)]
    solo, solo_rows = [], set()
    for conv, budget in zip(convs, budgets, strict=True):
        got, stepped = run_together(engine(), [conv], [budget])
        solo.append(got[0])
        solo_rows |= stepped
    eng = engine()
    assert eng.batch.classes.class_of(rows) == reported.class_of(rows)
    smallest = min(eng.batch.classes.class_of(rows))
    together, stepped = run_together(eng, convs, budgets)
    if refines(reported, measured, rows):
        for mine, alone in zip(together, solo, strict=True):
            for (ids, logits), (ids_alone, logits_alone) in zip(mine, alone, strict=True):
                assert ids == ids_alone and torch.equal(logits, logits_alone)  # bitwise
    assert solo_rows == {smallest}  # alone: the class's smallest count, not every row
    assert smallest in stepped and rows in stepped  # steps crossed the class from its smallest count to all rows
    assert stepped <= set(reported.class_of(rows))


@pytest.mark.slow
def test_real_model_lone_row_steps_fewer_rows_and_equals_it_under_load(real_smollm2: tuple) -> None:
    """SmolLM2-135M-Instruct, its chat template, h2o evicting, `--max_batch 8`: a lone conversation runs
    steps of the class's smallest count (measured here: 2 rows on the development CPU, 4 on an AMD EPYC, not
    8), and its logits are bitwise those it gets beside enough others to step more rows than that."""
    _, model, tok, fmt = real_smollm2
    kv = KVCacheConfig(policy="h2o", cache_length=48, chunk_size=16)
    smallest = min(probe_rounding_classes(model, 8).class_of(8))
    if smallest == 8:
        pytest.skip(f"no smaller count rounds like 8 rows here ({probe_rounding_classes(model, 8).describe()})")

    def engine() -> Engine:
        store = ConversationStore(1 << 30, model=model, kv_cache=kv)
        return Engine(model, tok, kv, store, fmt=fmt, max_batch=8)

    others = ["Name three colors.", "Why?", "Hi.", "Count to five.", "Say yes.", "What is two plus two?", "Go on."]
    convs = [["What is the capital of France?", "Tell me more."], *[[text] for text in others[:smallest]]]
    budgets = [[6, 30], *[[8] for _ in others[:smallest]]]  # smallest + 1 conversations: a wider step
    eng = engine()
    assert min(eng.batch.classes.class_of(8)) == smallest
    alone, stepped_alone = run_together(eng, convs[:1], budgets[:1])
    assert stepped_alone == {smallest}
    together, stepped = run_together(engine(), convs, budgets)
    assert max(stepped) > smallest  # the load changed the steps' row count
    for (ids, logits), (ids_alone, logits_alone) in zip(together[0], alone[0], strict=True):
        assert ids == ids_alone and torch.equal(logits, logits_alone)
