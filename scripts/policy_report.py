"""The report of `scripts/bench_policies.py`: its runs (`PolicyRun`), the side-by-side table of eager
and compiled decode speeds with the byte bound, the end-to-end lines against Hugging Face, and issue 23's
targets (met or missed, with the figures). Pure functions of the runs: `tests/cli/test_bench_cmd.py` checks them
on made-up runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

MODES = ("eager", "compiled")
HF = "hf-dynamic"  # the transformers row (eager)


@dataclass
class PolicyRun:
    """One (policy, mode) measurement in one configuration (`policy` HF: the transformers row)."""

    policy: str
    mode: str  # "eager" or "compiled"
    batch: int
    prompt: int
    new_tokens: int
    prefill_s: float
    decode_s: float  # the decode steps' own time, all of them
    decode_tok_s: float
    cache_bytes: int  # keys and values held by the caches (all layers, all rows; scales included)
    step_bytes: float  # bytes one decode step reads
    bound_tok_s: float = 0.0  # bandwidth / step_bytes x batch

    @property
    def prefill_tok_s(self) -> float:
        return self.batch * self.prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def e2e_s(self) -> float:
        """End-to-end seconds: the prefill and every decode step."""
        return self.prefill_s + self.decode_s


Runs = dict[tuple[str, str], PolicyRun]  # (policy, mode) -> run, one configuration


def by_key(runs: list[PolicyRun]) -> Runs:
    return {(r.policy, r.mode): r for r in runs}


def modes_of(runs: list[PolicyRun]) -> list[str]:
    """The modes the runs have, in `MODES` order."""
    return [m for m in MODES if any(r.mode == m for r in runs)]


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}x" if den > 0 and num > 0 else "-"


def _speed(runs: Runs, a: str, b: str, mode: str) -> float | None:
    """Decode tok/s of `a` over `b`'s in `mode` (None where either did not run)."""
    x, y = runs.get((a, mode)), runs.get((b, mode))
    return x.decode_tok_s / y.decode_tok_s if x and y and y.decode_tok_s > 0 else None


def byte_bound(runs: Runs, policy: str, mode: str) -> float | None:
    """Dense's bytes per step over `policy`'s (None without both)."""
    x, dense = runs.get((policy, mode)), runs.get(("dense", mode))
    return dense.step_bytes / x.step_bytes if x and dense and x.step_bytes > 0 else None


def of_bound(runs: Runs, policy: str, mode: str) -> float | None:
    """`policy`'s speed-up over dense as a fraction of its byte bound."""
    speed, bound = _speed(runs, policy, "dense", mode), byte_bound(runs, policy, mode)
    return speed / bound if speed is not None and bound else None


def _mode_cells(runs: Runs, policy: str, mode: str) -> list[str]:
    """decode tok/s, vs last-recent, vs dense, of bound, of bw of `policy` in `mode` (`-` where unknown)."""
    r = runs.get((policy, mode))
    if r is None:
        return ["-"] * 5
    ref = "eager" if policy == HF else mode  # the transformers row against litkv's eager runs
    recent, dense = runs.get(("last-recent", ref)), runs.get(("dense", ref))
    speed = r.decode_tok_s / dense.decode_tok_s if dense else None
    bound = dense.step_bytes / r.step_bytes if dense else None
    return [
        f"{r.decode_tok_s:.2f}",
        _ratio(r.decode_tok_s, recent.decode_tok_s) if recent else "-",
        f"{speed:.2f}x" if speed is not None else "-",
        f"{speed / bound:.0%}" if speed is not None and bound else "-",
        f"{r.decode_tok_s / r.bound_tok_s:.0%}" if r.bound_tok_s > 0 else "-",
    ]


def header(modes: list[str]) -> list[str]:
    shared = ["policy", "prefill tok/s", "byte bound", "MB/step", "bound tok/s", "cache MiB"]
    return shared + [c for m in modes for c in (f"{m} tok/s", "vs last-recent", "vs dense", "of bound", "of bw")]


def table_rows(runs: list[PolicyRun]) -> list[list[str]]:
    """Rows of one configuration's table, one per policy with its modes side by side (see `header`)."""
    by, modes = by_key(runs), modes_of(runs)
    dense = next((r for r in runs if r.policy == "dense"), None)
    rows = []
    for policy in dict.fromkeys(r.policy for r in runs):
        first = next(by[(policy, m)] for m in modes if (policy, m) in by)  # eager's prefill where it ran
        shared = [
            policy,
            f"{first.prefill_tok_s:.0f}",
            _ratio(dense.step_bytes, first.step_bytes) if dense else "-",
            f"{first.step_bytes / 1e6:.0f}",
            f"{first.bound_tok_s:.1f}",
            f"{first.cache_bytes / 2**20:.2f}",
        ]
        rows.append(shared + [c for m in modes for c in _mode_cells(by, policy, m)])
    return rows


def format_table(runs: list[PolicyRun]) -> str:
    """Markdown table of one configuration (see the module docstring for the columns)."""
    head, rows = header(modes_of(runs)), table_rows(runs)
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _lower_middle(items: list, key: Callable = lambda x: x):
    """The median of `items` by `key`, the lower of the two middle ones for an even count (an item itself)."""
    return sorted(items, key=key)[(len(items) - 1) // 2]


def median_rounds(rounds: list[list[PolicyRun]]) -> list[PolicyRun]:
    """One run per row from `rounds` (one list of runs per round of the same configuration, the rows in the same
    order): its median round (the lower of the two middle ones for an even count) by decode tok/s, each round's
    speeds first scaled by the median over rounds of last-recent's in the same mode over that round's (where its mode
    has a last-recent row): so a row's ratio to last-recent is the median of its rounds' ratios, the VM's drift
    between rounds taken out. A scaled run's decode seconds are scaled to match."""
    recent = {r.mode: i for i, r in enumerate(rounds[0]) if r.policy == "last-recent"}
    out = []
    for row in zip(*rounds, strict=True):
        at = recent.get(row[0].mode)
        scaled = list(row)
        if at is not None:
            speeds = [r[at].decode_tok_s for r in rounds]
            middle = _lower_middle(speeds)
            factors = [middle / x for x in speeds]
            scaled = [
                replace(r, decode_tok_s=r.decode_tok_s * f, decode_s=r.decode_s / f)
                for r, f in zip(row, factors, strict=True)
            ]
        out.append(_lower_middle(scaled, key=lambda r: r.decode_tok_s))
    return out


def round_ratio_lines(rounds: list[list[PolicyRun]]) -> list[str]:
    """One line per (policy, mode) but last-recent: its decode tok/s over last-recent's in the same mode, in each
    round and their median as `median_rounds` takes it (the lower middle for an even count: the table's ratio);
    nothing without a last-recent row."""
    lines = []
    for run in rounds[0]:
        if run.policy == "last-recent":
            continue
        ratios = [_speed(by_key(r), run.policy, "last-recent", run.mode) for r in rounds]
        if any(x is None for x in ratios):
            continue
        each = ", ".join(f"{x:.3f}x" for x in ratios)
        median = _lower_middle(ratios)
        lines.append(f"- {run.policy} ({run.mode}) vs last-recent, each round: {each} (median {median:.3f}x)")
    return lines


def e2e_ratio(runs: Runs, mode: str) -> float | None:
    """transformers' end-to-end time over dense's in `mode` (> 1: dense is faster)."""
    dense, hf = runs.get(("dense", mode)), runs.get((HF, "eager"))
    return hf.e2e_s / dense.e2e_s if dense and hf and dense.e2e_s > 0 else None


def prefill_ratio(runs: Runs, mode: str) -> float | None:
    """Dense's prefill tok/s in `mode` over transformers'."""
    dense, hf = runs.get(("dense", mode)), runs.get((HF, "eager"))
    return dense.prefill_tok_s / hf.prefill_tok_s if dense and hf and hf.prefill_tok_s > 0 else None


def e2e_lines(runs: list[PolicyRun]) -> list[str]:
    """Per mode: end-to-end seconds and prefill tok/s of dense against transformers (none without both)."""
    by = by_key(runs)
    hf = by.get((HF, "eager"))
    out = []
    for mode in modes_of(runs):
        dense, e2e, prefill = by.get(("dense", mode)), e2e_ratio(by, mode), prefill_ratio(by, mode)
        if hf is None or dense is None or e2e is None or prefill is None:
            continue
        out.append(
            f"end-to-end {dense.batch}x{dense.prompt}+{dense.new_tokens}: dense ({mode}) {dense.e2e_s:.2f} s, "
            f"HF dynamic {hf.e2e_s:.2f} s: {e2e:.2f}x HF; prefill {dense.prefill_tok_s:.0f} vs "
            f"{hf.prefill_tok_s:.0f} tok/s: {prefill:.2f}x HF"
        )
    return out


Figure = Callable[[Runs, str], "float | None"]


@dataclass(frozen=True)
class Target:
    """One target of issue 23: `figure(runs of a configuration, mode) >= threshold`, in every
    configuration of `batch` x `prompt` (None: any) run, or every configuration when none of them was."""

    label: str
    threshold: float
    figure: Figure
    batch: int | None = None
    prompt: int | None = None
    per_mode: bool = True  # False: the eager figure only (the prefill is not compiled)
    percent: bool = False  # the figure is a fraction (of the byte bound), shown as a percentage


def _vs(a: str, b: str) -> Figure:
    return lambda runs, mode: _speed(runs, a, b, mode)


def _bound_of(policy: str) -> Figure:
    return lambda runs, mode: of_bound(runs, policy, mode)


SCORING = (("h2o", 0.97), ("tova", 0.97), ("knorm", 0.97), ("keydiff", 0.97), ("snapkv", 0.90),
           ("expected-attention", 0.85), ("learned", 0.95))  # fmt: skip
TARGETS = (
    *(Target(f"{p} >= {x:.2f}x last-recent", x, _vs(p, "last-recent")) for p, x in SCORING),
    Target("int4 qh2o >= 0.95x float h2o", 0.95, _vs("qh2o", "h2o")),
    Target("int8 h2o (h2o-int8) >= 0.97x float h2o", 0.97, _vs("h2o-int8", "h2o")),
    Target("last-recent vs dense >= 95% of its byte bound", 0.95, _bound_of("last-recent"), percent=True),
    Target("h2o vs dense >= 95% of its byte bound", 0.95, _bound_of("h2o"), percent=True),
    Target("dense end-to-end (1x2048+64) >= 1.00x HF dynamic", 1.0, e2e_ratio, batch=1, prompt=2048),
    Target("dense prefill tok/s (4096) >= HF dynamic's", 1.0, prefill_ratio, prompt=4096, per_mode=False),
)


@dataclass
class TargetResult:
    label: str
    threshold: float
    mode: str
    figures: dict[str, float]  # configuration -> figure
    note: str = ""  # where the named configuration was not run
    percent: bool = False

    @property
    def met(self) -> bool | None:
        """Every figure at or above the threshold (None: nothing measured)."""
        return all(f >= self.threshold for f in self.figures.values()) if self.figures else None


def evaluate_targets(results: dict[str, list[PolicyRun]], targets: tuple[Target, ...] = TARGETS) -> list[TargetResult]:
    """Each target in each mode the runs have (the eager one only where `per_mode` is False)."""
    out = []
    modes = list(dict.fromkeys(m for runs in results.values() for m in modes_of(runs)))
    for t in targets:
        named = {
            name: runs
            for name, runs in results.items()
            if runs
            and (t.batch is None or runs[0].batch == t.batch)
            and (t.prompt is None or runs[0].prompt == t.prompt)
        }
        note = "" if named or (t.batch is None and t.prompt is None) else "not run there; from every configuration"
        chosen = named or results
        for mode in modes if t.per_mode else modes[:1]:
            figures = {name: t.figure(by_key(runs), mode) for name, runs in chosen.items()}
            kept = {name: f for name, f in figures.items() if f is not None}
            out.append(TargetResult(t.label, t.threshold, mode, kept, note, t.percent))
    return out


def format_targets(results: list[TargetResult]) -> list[str]:
    """One line per target: per mode, met or missed with the figure of each configuration."""
    lines: dict[str, list[str]] = {}
    for r in results:
        verdict = {True: "met", False: "missed", None: "not measured"}[r.met]
        figures = ", ".join(f"{name} {f:.1%}" if r.percent else f"{name} {f:.3f}x" for name, f in r.figures.items())
        lines.setdefault(r.label, []).append(f"{r.mode} {verdict}" + (f" ({figures})" if figures else ""))
    notes = {r.label: r.note for r in results}
    return [
        f"{label}: " + "; ".join(parts) + (f" [{notes[label]}]" if notes[label] else "")
        for label, parts in lines.items()
    ]
