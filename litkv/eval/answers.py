"""The answers of a RULER table as units of work: planned, answered, stored one file each, scored.

A table (`litkv evaluate --tasks`) is cut into units that do not depend on one another: per continuous row
(dense, or a policy at one budget), task and batch of samples, the greedy answers through its cache
(`generate`); per one-shot policy, task and batch, the answers at every budget from one prefill
(`litkv.eval.oneshot.oneshot_answers`). A batch is `batch_size` consecutive samples of a task, whatever
the number of processes, so each unit computes the same thing in a one-process run and in a
data-parallel one (`litkv.eval.parallel`), and the merged answers are the same.

An `AnswerStore` (`out_dir/answers/`) holds `run.json` (what decides the answers: the model's fingerprint,
the samples' digest, rows, budgets, options, cache template, batch size) and one JSON file per unit,
written atomically as soon as the unit is answered, so that a stopped run resumes from the units it has.
The scores are RULER's metric over each (row, budget, task)'s answers in sample order.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from litkv.core.atomic import write_text_atomic
from litkv.eval.oneshot import oneshot_answers
from litkv.eval.ruler import METRICS as RULER_METRICS
from litkv.eval.ruler import TASKS as RULER_TASKS
from litkv.eval.ruler import RulerSample
from litkv.inference.generate import generate
from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.kvcache.kvzip import KVzipKVCache
from litkv.modeling.config import KVCacheConfig
from litkv.modeling.model import GPT

__all__ = ["AnswerStore", "RulerPlan", "Unit", "answer_unit", "ruler_scores", "samples_digest"]

Answers = dict[int, list[list[int]]]  # budget -> per sample of the unit, its answer's token ids


@dataclass(frozen=True)
class Unit:
    """One unit: `policy` at `budget` (`None`: a one-shot policy, every budget) on samples `start..stop-1` of
    `task`; `cost`: a relative estimate of its work (prompt tokens times passes), for the sharding."""

    policy: str
    budget: int | None
    task: str
    start: int
    stop: int
    cost: float

    @property
    def key(self) -> str:
        """A file-safe name, unique in a table."""
        budget = "all" if self.budget is None else str(self.budget)
        return re.sub(r"[^A-Za-z0-9._-]", "_", f"{self.task}.{self.start}-{self.stop}.{self.policy}.{budget}")


@dataclass
class RulerPlan:
    """What answering a table's units needs.

    Attributes:
        samples: task -> its samples.
        continuous: (policy, budget) -> config, dense's first (`generate`).
        one_shot: policy -> budget -> config in mode one-shot (`oneshot_answers`).
        batch_size: samples per unit.
        repeat: kvzip's reconstruction prompt.
        context_only: one-shot policies compress the context and get the question after it.
    """

    samples: dict[str, list[RulerSample]]
    continuous: dict[tuple[str, int], KVCacheConfig]
    one_shot: dict[str, dict[int, KVCacheConfig]]
    batch_size: int
    repeat: RepeatPrompt | None = None
    context_only: bool = True

    def units(self) -> list[Unit]:
        """Every unit, in the order a one-process run answers them."""
        out = []
        for policy, budget in self.continuous:
            out += self._per_batch(policy, budget, 1.0)
        for policy, configs in self.one_shot.items():
            first = next(iter(configs.values()))
            passes = 2.5 if issubclass(first.policy_class, KVzipKVCache) else 1.0  # reconstruction
            out += self._per_batch(policy, None, passes + 0.05 * len(configs))
        return out

    def _per_batch(self, policy: str, budget: int | None, passes: float) -> list[Unit]:
        units = []
        for task, samples in self.samples.items():
            for start in range(0, len(samples), self.batch_size):
                batch = samples[start : start + self.batch_size]
                cost = passes * sum(len(s.ids) for s in batch) + sum(s.max_new_tokens for s in batch)
                units.append(Unit(policy, budget, task, start, start + len(batch), cost))
        return units


@torch.inference_mode()
def answer_unit(model: GPT, plan: RulerPlan, unit: Unit) -> Answers:
    """The greedy answers of `unit` (each cut to its sample's `max_new_tokens`), per budget."""
    device = model.lm_head.weight.device
    batch = plan.samples[unit.task][unit.start : unit.stop]
    ids = [torch.tensor(s.ids, dtype=torch.long, device=device) for s in batch]
    new = max(s.max_new_tokens for s in batch)
    if unit.budget is not None:
        outputs = {unit.budget: generate(model, ids, new, plan.continuous[(unit.policy, unit.budget)])}
    else:
        configs = plan.one_shot[unit.policy]
        repeat = plan.repeat if issubclass(next(iter(configs.values())).policy_class, KVzipKVCache) else None
        if plan.context_only:
            contexts = [x[: s.context_length] for x, s in zip(ids, batch, strict=True)]
            questions = [x[s.context_length :] for x, s in zip(ids, batch, strict=True)]
            outputs = oneshot_answers(model, contexts, new, configs, repeat, None, questions)
        else:
            outputs = oneshot_answers(model, ids, new, configs, repeat)
    return {
        b: [out[: s.max_new_tokens].tolist() for s, out in zip(batch, outs, strict=True)] for b, outs in outputs.items()
    }


def ruler_scores(
    plan: RulerPlan, units: Sequence[Unit], answers: Mapping[str, Answers], decode: Callable[[list[int]], str]
) -> dict[tuple[str, int], dict[str, float]]:
    """(policy, budget) -> task -> RULER's score of the answers of `units` (every one must be answered)."""
    missing = [u.key for u in units if u.key not in answers]
    if missing:
        raise RuntimeError(f"{len(missing)} units have no answers, e.g. {missing[0]}")
    predictions: dict[tuple[str, int], dict[str, list[str]]] = {}
    for unit in sorted(units, key=lambda u: u.start):  # sample order within each (row, task)
        for budget, outs in answers[unit.key].items():
            row = predictions.setdefault((unit.policy, int(budget)), {}).setdefault(unit.task, [])
            row += [decode(out) for out in outs]
    scores: dict[tuple[str, int], dict[str, float]] = {}
    for key, per_task in predictions.items():
        for task, preds in per_task.items():
            references = [s.references for s in plan.samples[task]]
            scores.setdefault(key, {})[task] = RULER_METRICS[RULER_TASKS[task].metric](preds, references)
    return scores


def samples_digest(samples: Mapping[str, Sequence[RulerSample]]) -> str:
    """sha256 of every sample's task, token ids, context length, answer length and references."""
    h = hashlib.sha256()
    for task, rows in samples.items():
        for s in rows:
            record = [task, list(s.ids), s.context_length, s.max_new_tokens, list(s.references)]
            h.update(json.dumps(record).encode())
    return h.hexdigest()


class AnswerStore:
    """`directory/run.json` (the run's identity) and one `<unit key>.json` per answered unit."""

    RUN = "run.json"

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def start(self, identity: dict[str, Any], resume: bool) -> None:
        """A fresh store (answers of an earlier run removed), or with `resume` the one there, whose
        `run.json` must be `identity` (ValueError naming the first difference)."""
        path = self.directory / self.RUN
        if resume and path.is_file():
            before = json.loads(path.read_text(encoding="utf-8"))
            if before != identity:
                diff = sorted(k for k in {*before, *identity} if before.get(k) != identity.get(k))
                raise ValueError(
                    f"--resume: the answers in {str(self.directory)!r} were made by another run (it differs in "
                    f"{', '.join(diff)}); give the same settings, or a new --out_dir"
                )
            return
        if self.directory.is_dir():
            for old in self.directory.glob("*.json"):
                old.unlink()
        self.directory.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(identity, indent=1, sort_keys=True) + "\n")

    def write(self, unit: Unit, answers: Answers) -> None:
        """The unit's answers, as one file written atomically."""
        data = {"key": unit.key, "answers": {str(b): outs for b, outs in answers.items()}}
        write_text_atomic(self.directory / f"{unit.key}.json", json.dumps(data) + "\n")

    def read(self, units: Sequence[Unit]) -> dict[str, Answers]:
        """The stored answers of those `units` that have a complete file (a unit's file is whole or absent)."""
        out = {}
        for unit in units:
            path = self.directory / f"{unit.key}.json"
            if path.is_file():
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("key") == unit.key:
                    out[unit.key] = decode_answers(data["answers"], unit)
        return out


def decode_answers(data: Mapping[str, Any], unit: Unit) -> Answers:
    """Stored answers (budget strings -> token-id lists) back to `Answers`, their shape checked."""
    n = unit.stop - unit.start
    out: Answers = {}
    for budget, outs in data.items():
        if not isinstance(outs, list) or len(outs) != n or not all(isinstance(o, list) for o in outs):
            raise ValueError(f"answers of unit {unit.key}: expected {n} token lists per budget, got {outs!r:.80}")
        out[int(budget)] = [[int(t) for t in o] for o in outs]
    return out
