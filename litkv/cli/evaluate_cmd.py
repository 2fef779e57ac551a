"""`litkv evaluate`: compare KV cache policies against dense; print a table, write JSON and a PNG plot."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from litkv.checkpoint import check_checkpoint_dir, load_model, load_tokenizer, save_file_atomic
from litkv.cli.common import apply_num_threads, resolve_checkpoint_dir, resolve_device, resolve_dtype
from litkv.config import KVCacheConfig
from litkv.evaluate import DENSE, PolicyResult, evaluate_policies, text_windows
from litkv.recall import RECALL_FILE, RecallTask, encode_plain

__all__ = ["evaluate", "format_table", "plot_results"]

DEFAULT_POLICIES = ("last-recent", "h2o", "qh2o")
DEFAULT_BUDGETS = (64, 128, 256, 512)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_DEFAULT_KV_CACHE = KVCacheConfig(chunk_size=64)  # never mutated; policy and cache_length are set per run


def evaluate(
    checkpoint_dir: Path | None = None,
    text_file: Path | None = None,
    policies: list[str] | None = None,
    budgets: list[int] | None = None,
    window: int | None = None,
    num_windows: int = 4,
    recall_depths: list[float] | None = None,
    recall_cases: int = 4,
    kv_cache: KVCacheConfig = _DEFAULT_KV_CACHE,
    batch_size: int = 4,
    seed: int = 0,
    out_dir: Path = Path("out/evaluate"),
    precision: str | None = None,
    device: str | None = None,
    num_threads: int | None = None,
) -> list[PolicyResult]:
    """Quality of KV cache policies against a dense cache on the same model and text.

    Per (policy, budget): perplexity, mean KL(dense || policy) per token, top-1 agreement with dense,
    and pass-key recall accuracy at several needle depths (when the checkpoint has recall_format.json).

    Args:
        checkpoint_dir: Checkpoint directory. Default: the model shipped with litkv.
        text_file: Text to score. Default: the checkpoint's heldout.txt.
        policies: Policies to compare (default: last-recent, h2o, qh2o); dense is always the reference.
        budgets: Cache lengths to try (default: 64, 128, 256, 512).
        window: Tokens per scored window. Default: the recall task's context length, else the model's.
        num_windows: Number of windows, spread evenly over the text.
        recall_depths: Needle depths in [0, 1] (default: 0, 0.25, 0.5, 0.75, 1).
        recall_cases: Recall examples per depth (0: skip the recall task).
        kv_cache: Other cache settings (chunk_size, sinks, recent, storage, ...); policy and
            cache_length are set per run.
        batch_size: Sequences per forward.
        seed: Seed of the recall examples.
        out_dir: Where to write evaluate.json and evaluate.png.
        precision: "32-true", "bf16-true", ... Default: bf16 on CUDA, else 32.
        device: "cpu", "cuda", ... Default: CUDA if available.
        num_threads: CPU threads for torch. Default: torch's choice (one per core).
    """
    ckpt = check_checkpoint_dir(resolve_checkpoint_dir(checkpoint_dir))
    policies = list(DEFAULT_POLICIES if policies is None else policies)
    budgets = list(DEFAULT_BUDGETS if budgets is None else budgets)
    apply_num_threads(num_threads)
    dev = resolve_device(device)
    model = load_model(ckpt, device=dev, dtype=resolve_dtype(precision, dev))
    tokenizer = load_tokenizer(ckpt)
    task = RecallTask.from_checkpoint(ckpt, tokenizer) if (ckpt / RECALL_FILE).is_file() else None
    if window is None:
        window = min(task.fmt.context_length if task else model.config.block_size, model.config.block_size)
    text_path = _text_path(ckpt, text_file, task)
    ids = torch.tensor(encode_plain(tokenizer, text_path.read_text(encoding="utf-8")), dtype=torch.long)
    windows = text_windows(ids, window, num_windows)
    examples = []
    if task is not None and recall_cases > 0:
        depths = list(DEFAULT_DEPTHS if recall_depths is None else recall_depths)
        examples = task.examples(window, depths, recall_cases, seed)
    elif task is None:
        print(f"note: {ckpt / RECALL_FILE} not found: the recall task is skipped", file=sys.stderr)
    start = time.perf_counter()
    results = evaluate_policies(model, windows, policies, budgets, examples, kv_cache, batch_size, progress=True)
    elapsed = time.perf_counter() - start
    print(format_table(results))
    print(
        f"{num_windows} windows of {window} tokens from {text_path.name}; {len(examples)} recall examples; "
        f"chunk_size {kv_cache.chunk_length}; {elapsed:.0f} s"
    )
    _write_outputs(Path(out_dir), results, _run_info(ckpt, text_path, window, num_windows, len(examples), kv_cache))
    return results


def _text_path(ckpt: Path, text_file: Path | None, task: RecallTask | None) -> Path:
    if text_file is not None:
        path = Path(text_file)
        if not path.is_file():
            raise FileNotFoundError(f"text file {str(path)!r} does not exist")
        return path
    path = ckpt / (task.fmt.filler_file if task else "heldout.txt")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint directory {str(ckpt)!r} has no {path.name}: pass --text_file")
    return path


def _run_info(
    ckpt: Path, text: Path, window: int, num_windows: int, n_examples: int, kv_cache: KVCacheConfig
) -> dict[str, object]:
    return {
        "checkpoint_dir": str(ckpt),
        "text_file": str(text),
        "window": window,
        "num_windows": num_windows,
        "recall_examples": n_examples,
        "kv_cache_template": {
            f.name: getattr(kv_cache, f.name)
            for f in dataclasses.fields(kv_cache)
            if f.name not in ("policy", "cache_length")
        },
    }


def _write_outputs(out_dir: Path, results: Sequence[PolicyResult], info: dict[str, object]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {**info, "results": [r.to_dict() for r in results]}
    json_path = out_dir / "evaluate.json"
    save_file_atomic(json_path, lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8"))
    png_path = out_dir / "evaluate.png"
    try:
        plot_results(results, png_path)
    except ImportError:
        print("note: matplotlib is not installed: no plot (pip install 'litkv[plot]')", file=sys.stderr)
        print(f"wrote {json_path}")
        return
    print(f"wrote {json_path} and {png_path}")


def format_table(results: Sequence[PolicyResult]) -> str:
    """A fixed-width table: one row per (policy, budget), recall per depth and its mean."""
    depths = sorted({d for r in results for d in r.recall})
    head = ["policy", "budget", "cache MiB", "ppl", "KL", "top-1"]
    head += [f"rec@{d:g}" for d in depths] + (["recall"] if depths else [])
    rows = []
    for r in results:
        budget = f"{r.cache_length} (full)" if r.policy == DENSE else str(r.cache_length)
        row = [r.policy, budget, f"{r.cache_bytes / 2**20:.2f}", f"{r.perplexity:.3f}", f"{r.kl:.3g}", f"{r.top1:.3f}"]
        row += [_fmt(r.recall.get(d, math.nan)) for d in depths] + ([_fmt(r.recall_mean)] if depths else [])
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    return "\n".join(_align(row, widths) for row in [head, *rows])


def _align(cells: Sequence[str], widths: Sequence[int]) -> str:
    """First cell left-aligned, the others right-aligned."""
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def plot_results(results: Sequence[PolicyResult], path: Path) -> None:
    """Quality against cache budget, one line per policy (dense: dashed reference). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("perplexity", "perplexity"), ("kl", "KL(dense || policy) per token"), ("top1", "top-1 agreement")]
    if any(r.recall for r in results):
        metrics.append(("recall_mean", "pass-key recall (mean over depths)"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), squeeze=False)
    dense = next((r for r in results if r.policy == DENSE), None)
    budgets = sorted({r.cache_length for r in results if r.policy != DENSE})
    for ax, (attr, title) in zip(axes[0], metrics, strict=True):
        for policy in dict.fromkeys(r.policy for r in results if r.policy != DENSE):
            rows = sorted((r for r in results if r.policy == policy), key=lambda r: r.cache_length)
            ax.plot([r.cache_length for r in rows], [getattr(r, attr) for r in rows], marker="o", label=policy)
        if dense is not None:
            ax.axhline(getattr(dense, attr), color="black", linestyle="--", linewidth=1, label="dense")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("cache budget (slots per layer and KV head)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    save_file_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
