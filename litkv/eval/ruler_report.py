"""`litkv evaluate --tasks ...`: the offline RULER tasks (`litkv.eval.ruler`) per policy and budget;
table, JSON, plot."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.checkpoints.runtime import load_for_inference
from litkv.core.atomic import is_temp_name, mark_output_dir, save_dir_atomic, write_atomic
from litkv.core.tokens import encode_plain
from litkv.core.validation import require_file
from litkv.eval.answers import AnswerStore, samples_digest
from litkv.eval.evaluate import DENSE, RulerResult, evaluate_ruler
from litkv.eval.oneshot import KVZIP
from litkv.eval.recall import RECALL_FILE, RecallFormat
from litkv.eval.ruler import (
    FALLBACK_WORDS,
    TASKS,
    Encode,
    NiahFormat,
    RulerSample,
    generate_samples,
    resolve_tasks,
    split_answer_prefix,
    word_list,
)
from litkv.inference.chat_template import Format, TemplateFormat, load_format
from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.kvcache.kvzip import KVzipKVCache
from litkv.kvcache.registry import get_kv_cache_class
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT

if TYPE_CHECKING:
    from lightning.fabric import Fabric

__all__ = [
    "ANSWERS",
    "NEAR_ZERO",
    "chat_encoder",
    "format_ruler_table",
    "near_zero_tasks",
    "needs_text",
    "plot_ruler",
    "ruler_samples",
    "run_ruler",
]

#: The subdirectory of `out_dir` holding each unit's answers (`litkv.eval.answers.AnswerStore`).
ANSWERS = "answers"
# A task on which dense scores below this is marked: it needs a stronger model, not a better policy.
NEAR_ZERO = 0.1


def chat_encoder(fmt: Format) -> Encode | None:
    """A RULER prompt as an instruct model is fed it in chat, as RULER and kvpress do: the context and the
    question as one user message of `fmt`'s chat template, the generation prompt, then the answer's start
    (`split_answer_prefix`) as the first tokens of the reply; the templated text is cut where the question
    starts and each side tokenized apart (kvpress's pipeline: the templated context, then the question, the
    template's end of the turn and the answer's start). None for raw text (each text's own tokens)."""
    if not isinstance(fmt, TemplateFormat):
        return None
    template = fmt.template

    def encode(context: str, question: str) -> tuple[list[int], list[int]]:
        message, prefix = split_answer_prefix(context + question)
        if len(message) < len(context):
            raise ValueError(f"the answer's start {prefix[:40]!r} begins inside the context")
        text = template.render([("user", message)], add_generation_prompt=True)
        at = text.find(message)
        if at < 0 or text.count(message) != 1:
            raise ValueError("the chat template does not write the RULER prompt once and verbatim")
        cut = at + len(context)
        tail = encode_plain(fmt.tokenizer, prefix) if prefix else []
        return encode_plain(fmt.tokenizer, text[:cut]), encode_plain(fmt.tokenizer, text[cut:]) + tail

    return encode


def needs_text(name: str) -> bool:
    """Whether RULER task `name` needs a text for its word list: not a noise-haystack niah (its keys come from
    `FALLBACK_WORDS`) nor fwe (coded random words)."""
    task = TASKS[name]
    return not (task.kind == "fwe" or (task.kind == "niah" and task.haystack == "noise"))


def _words(ckpt: Path, text_file: Path | None, names: Sequence[str]) -> tuple[list[str], str]:
    """The word list and where it came from: `--text_file`, else the checkpoint's heldout.txt, else
    `FALLBACK_WORDS` where no task needs a text (FileNotFoundError naming those that do)."""
    if text_file is not None:
        path = require_file("--text_file", text_file)
        return word_list(path.read_text(encoding="utf-8")), str(path)
    if (ckpt / "heldout.txt").is_file():
        return word_list((ckpt / "heldout.txt").read_text(encoding="utf-8")), str(ckpt / "heldout.txt")
    wanting = [name for name in names if needs_text(name)]
    if wanting:
        raise FileNotFoundError(
            f"RULER task(s) {', '.join(wanting)} draw their haystack from a text, and {str(ckpt)!r} has no "
            "heldout.txt: pass --text_file (any English text)"
        )
    return list(FALLBACK_WORDS), "FALLBACK_WORDS (litkv.eval.ruler)"


def run_ruler(
    ckpt: Path,
    tasks: str | Sequence[str],
    policies: Sequence[str],
    budgets: Sequence[int],
    settings: dict[str, Any],
    fabric: Fabric | None = None,
) -> list[RulerResult]:
    """Generate the samples, score dense and every (policy, budget), print the table, write ruler.json/png.

    `settings`: length (None: the recall format's context length, else the model's), num_samples, seed,
    kv_cache, policy_options, batch_size, text_file, out_dir, precision, device, num_threads, quantize,
    chat_template (None: the checkpoint's template when it has one, each prompt a user message with the
    generation prompt; False: the prompt's text alone), oneshot_compress ("context": one-shot policies
    compress each sample's context and get its question after, as kvpress; "prompt": the whole prompt),
    resume (read the answers `out_dir/answers` holds from a stopped run of the same settings).
    With `fabric` (launched), the units are shared by its processes (`litkv.eval.parallel`); rank 0 prints
    and writes.
    """
    names = resolve_tasks(tasks)
    device = settings["device"] if fabric is None else str(fabric.device)
    runtime = (settings["precision"], device, settings["num_threads"], settings["quantize"])
    model, _ = load_for_inference(ckpt, *runtime)
    tokenizer = load_tokenizer(ckpt)
    recall = RecallFormat.load(ckpt / RECALL_FILE) if (ckpt / RECALL_FILE).is_file() else None
    length = settings["length"] or min(recall.context_length if recall else 10**9, model.config.block_size)
    if not 64 <= length <= model.config.block_size:
        raise ValueError(f"the RULER length must be in [64, {model.config.block_size}] (the model's), got {length}")
    fmt = load_format(ckpt, tokenizer, settings["chat_template"])
    samples, words_from, niah = ruler_samples(ckpt, tokenizer, fmt, names, length, settings)
    repeat = None  # kvzip's reconstruction prompt, in the chat template the prompts are fed in
    if any(p == KVZIP or get_kv_cache_class(p) is KVzipKVCache for p in policies):
        repeat = RepeatPrompt.build(tokenizer, fmt.template if isinstance(fmt, TemplateFormat) else None)
    store = AnswerStore(Path(settings["out_dir"]) / ANSWERS)
    rank0 = fabric is None or fabric.global_rank == 0
    if rank0:  # the directory marked as evaluate's, so that a stopped run can be resumed
        mark_output_dir(settings["out_dir"], "evaluate")
        store.start(_identity(model, samples, policies, budgets, settings), bool(settings.get("resume")))
    if fabric is not None:
        fabric.barrier()
    start = time.perf_counter()
    results = evaluate_ruler(
        model, tokenizer, samples, policies, budgets, settings["kv_cache"], settings["batch_size"], True,
        settings["policy_options"], length, repeat, settings.get("oneshot_compress", "context"), store, fabric,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    if not rank0:
        return results
    print(format_ruler_table(results))
    print(
        f"{settings['num_samples']} samples per task, {length} tokens (prompt + answer), seed {settings['seed']}; "
        f"niah wording: {'the checkpoint recall format' if recall else 'RULER'}; {elapsed:.0f} s"
    )
    info = {
        "command": " ".join(getattr(sys, "orig_argv", sys.argv)),
        "checkpoint_dir": str(ckpt),
        "tasks": names,
        "length": length,
        "num_samples": settings["num_samples"],
        "seed": settings["seed"],
        "words_from": words_from,
        "niah_format": niah.__dict__,
        "oneshot_compress": settings.get("oneshot_compress", "context"),
        "near_zero_dense": near_zero_tasks(results),
        "batch_size": settings["batch_size"],
        "processes": 1 if fabric is None else fabric.world_size,
        "elapsed_s": round(elapsed, 1),
    }
    _write(Path(settings["out_dir"]), results, info)
    return results


def _identity(
    model: GPT, samples: dict[str, list[RulerSample]], policies: Sequence[str], budgets: Sequence[int], settings: dict
) -> dict[str, Any]:
    """What decides a table's answers (`AnswerStore.start` compares it when resuming), as JSON values."""
    identity = {
        "model": model_fingerprint(model),
        "dtype": str(model.lm_head.weight.dtype),
        "samples": samples_digest(samples),
        "policies": list(policies),
        "budgets": list(budgets),
        "policy_options": settings["policy_options"],
        "kv_cache": repr(settings["kv_cache"]),
        "batch_size": settings["batch_size"],
        "oneshot_compress": settings.get("oneshot_compress", "context"),
        "quantize": settings["quantize"],
    }
    return json.loads(json.dumps(identity, default=str))


def ruler_samples(
    ckpt: Path, tokenizer: Any, fmt: Format, names: Sequence[str], length: int, settings: dict[str, Any]
) -> tuple[dict[str, list[RulerSample]], str, NiahFormat]:
    """The samples `litkv evaluate --tasks` scores (the word list, the niah wording and `fmt`'s encoding of
    the checkpoint; `settings`: text_file, num_samples, seed), where the words came from, the niah wording."""
    recall = RecallFormat.load(ckpt / RECALL_FILE) if (ckpt / RECALL_FILE).is_file() else None
    words, words_from = _words(ckpt, settings["text_file"], names)
    niah = NiahFormat.from_recall(recall) if recall else NiahFormat()
    encode = chat_encoder(fmt)
    samples = generate_samples(names, tokenizer, words, length, settings["num_samples"], settings["seed"], niah, encode)
    return samples, words_from, niah


def _write(out_dir: Path, results: Sequence[RulerResult], info: dict[str, Any]) -> None:
    """`ruler.json` and `ruler.png` as the directory `out_dir`, whole or not at all (checked by the command
    before the run: a new, empty or earlier `litkv evaluate` directory; `save_dir_atomic`)."""
    data = {**info, "results": [r.to_dict() for r in results]}
    json_path = out_dir / "ruler.json"
    plotted = []

    def fill(tmp: Path) -> None:
        if (out_dir / ANSWERS).is_dir():  # the units' answers stay beside the table
            temp = lambda _, names: [n for n in names if is_temp_name(n)]  # noqa: E731  (a stopped write)
            shutil.copytree(out_dir / ANSWERS, tmp / ANSWERS, ignore=temp)
        write_atomic(tmp / "ruler.json", lambda f: f.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8"))
        try:
            plot_ruler(results, tmp / "ruler.png")
            plotted.append(True)
        except ImportError:
            print("note: matplotlib is not installed: no plot (pip install 'litkv[plot]')", file=sys.stderr)

    if (out_dir / ANSWERS).is_dir():  # this run's answers, written unit by unit: litkv's, kept in the marker
        mark_output_dir(out_dir, "evaluate", only=ANSWERS)
    save_dir_atomic(out_dir, fill, "evaluate", overwrite=True)
    print(f"wrote {json_path} and {out_dir / 'ruler.png'}" if plotted else f"wrote {json_path}")


def near_zero_tasks(results: Sequence[RulerResult]) -> list[str]:
    """Tasks on which dense scores below `NEAR_ZERO` (none when there is no dense row)."""
    dense = next((r for r in results if r.policy == DENSE), None)
    return [] if dense is None else [t for t, s in dense.scores.items() if s < NEAR_ZERO]


def format_ruler_table(results: Sequence[RulerResult]) -> str:
    """One row per (policy, budget), one column per task (marked * when dense is near zero), and the mean."""
    if not results:
        raise ValueError("format_ruler_table needs at least one result")
    tasks = list(results[0].scores)
    zero = set(near_zero_tasks(results))
    head = ["policy", "budget", *[f"{t}*" if t in zero else t for t in tasks], "mean"]
    rows = []
    for r in results:
        budget = f"{r.cache_length} (full)" if r.policy == DENSE else str(r.cache_length)
        rows.append([r.policy, budget, *[f"{r.scores.get(t, math.nan):.2f}" for t in tasks], f"{r.mean:.2f}"])
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in [head, *rows]]  # fmt: skip
    if zero:
        lines.append(
            f"* dense scores < {NEAR_ZERO:g} on {', '.join(sorted(zero))}: the model cannot do the task; "
            "it needs a stronger model, not a better policy"
        )
    return "\n".join(lines)


def plot_ruler(results: Sequence[RulerResult], path: Path) -> None:
    """Score against cache budget per task (and the mean), one line per policy, dense dashed. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [*results[0].scores, "mean"]
    cols = min(5, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    dense = next((r for r in results if r.policy == DENSE), None)
    zero = set(near_zero_tasks(results))
    budgets = sorted({r.cache_length for r in results if r.policy != DENSE})
    for ax, task in zip(axes.flat, tasks, strict=False):
        for policy in dict.fromkeys(r.policy for r in results if r.policy != DENSE):
            pts = sorted((r.cache_length, _score(r, task)) for r in results if r.policy == policy)
            ax.plot([b for b, _ in pts], [s for _, s in pts], marker="o", label=policy)
        if dense is not None:
            ax.axhline(_score(dense, task), color="black", linestyle="--", linewidth=1, label="dense")
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{task} (dense ~0)" if task in zero else task, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.supxlabel("cache budget (slots per layer and KV head)", fontsize=9)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def _score(result: RulerResult, task: str) -> float:
    return result.mean if task == "mean" else result.scores[task]
