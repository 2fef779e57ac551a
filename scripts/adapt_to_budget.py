#!/usr/bin/env python
"""Fine-tune the shipped default model with an evicting KV cache in place, against a dense-cache control.

1. Writes the training text: the King James Bible chapters the default model was trained on
   (`scripts/train_default_model.py`'s split; the held-out chapters, `heldout.txt`, are checked to be
   exactly the shipped ones and are never trained on).
2. `litkv finetune --config CONFIG`: the recipe, with the policy and budget in place (chunked,
   gradients through the cache), on the training mix (text + pass-key recall + digit-copy rows).
3. The control: the same run, same steps, data and learning rate, with a dense cache.
4. `litkv evaluate` on the shipped model and on both fine-tuned models, at the budget and with dense:
   perplexity, KL(dense || policy), top-1 agreement, pass-key recall on the held-out text.

Prints one table and the targets, writes ``<out_dir>/<policy>_<budget>/adapt.json`` and ``adapt.png``.

Usage::

    nice python scripts/adapt_to_budget.py --config configs/adapt_h2o_256.yaml --threads 1
    nice python scripts/adapt_to_budget.py --config configs/adapt_h2o_256.yaml --max_steps 2 --tag smoke
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonargparse
import torch
import yaml

from litkv.cli.evaluate_cmd import evaluate
from litkv.cli.finetune_cmd import finetune
from litkv.eval.evaluate import PolicyResult
from litkv.kvcache.config import KVCacheConfig

ROOT = Path(__file__).resolve().parents[1]
#: "Clearly less": the control's gain is at most this share of the adapted model's gain.
CONTROL_SHARE = 0.5
TARGETS = {"recall_gain": 0.3, "kl_fall": 0.3, "dense_ppl_change": 0.05}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "adapt_h2o_256.yaml", help="litkv finetune YAML")
    p.add_argument("--out_dir", type=Path, default=Path("out/adapt"))
    p.add_argument("--tag", default=None, help="run name (default: <policy>_<budget>)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--mode", choices=("lora", "full"), default=None, help="override the config's mode")
    p.add_argument("--max_steps", type=int, default=None, help="override train.max_steps")
    p.add_argument("--lr", type=float, default=None, help="override train.lr (min_lr scales with it)")
    p.add_argument("--text", type=Path, default=None, help="training text (default: the KJV training chapters)")
    p.add_argument("--checkpoint_dir", type=Path, default=None, help="override the config's checkpoint_dir")
    p.add_argument("--recall_cases", type=int, default=20, help="recall examples per needle depth")
    p.add_argument("--num_windows", type=int, default=8, help="held-out windows for ppl/KL/top-1")
    p.add_argument("--skip_control", action="store_true", help="no dense-cache control run")
    p.add_argument("--plot_from", type=Path, nargs="+", default=None, metavar="JSON",
                   help="only draw one plot (--plot_out) of these runs' adapt.json, then exit")  # fmt: skip
    p.add_argument("--plot_out", type=Path, default=Path("out/adapt/adapt.png"))
    p.add_argument("--diagnose", type=Path, nargs="+", default=None, metavar="DIR",
                   help="only print where the pass key survives in these checkpoints' caches, then exit")  # fmt: skip
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ training data
def _train_default_model() -> Any:
    """`scripts/train_default_model.py` as a module (its corpus functions)."""
    spec = importlib.util.spec_from_file_location("train_default_model", ROOT / "scripts" / "train_default_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def write_training_text(path: Path, checkpoint_dir: Path, heldout_every: int = 60) -> Path:
    """Write the KJV training chapters of the default model to `path`; check the held-out split.

    Raises:
        RuntimeError: the held-out chapters differ from the checkpoint's `heldout.txt`, or one of
            them appears among the training chapters.
    """
    tdm = _train_default_model()
    chapters = tdm.kjv_chapters(tdm.kjv_lines())
    train, heldout = tdm.split_corpus(chapters, heldout_every)
    if heldout != (checkpoint_dir / "heldout.txt").read_text(encoding="utf-8"):
        raise RuntimeError(f"the held-out chapters differ from {checkpoint_dir / 'heldout.txt'}: not the same split")
    held = {c for i, c in enumerate(chapters) if i % heldout_every == heldout_every // 2}
    trained = {c for i, c in enumerate(chapters) if i % heldout_every != heldout_every // 2}
    if held & trained:
        raise RuntimeError(f"{len(held & trained)} held-out chapters also appear among the training chapters")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(train, encoding="utf-8")
    print(f"training text: {len(chapters) - len(held)} chapters ({len(train):,} characters) -> {path}; "
          f"{len(held)} held-out chapters excluded")  # fmt: skip
    return path


# ------------------------------------------------------------------------------------------------ runs
def load_config(path: Path) -> dict[str, Any]:
    """The recipe (a `litkv finetune` YAML)."""
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict) or "kv_cache" not in config or "train" not in config:
        raise ValueError(f"{path} is not a litkv finetune config with kv_cache and train sections")
    return config


def finetune_argv(
    args: argparse.Namespace, config: dict[str, Any], text: Path, out_dir: Path, dense: bool
) -> list[str]:
    """The `litkv finetune` arguments of the recipe (or of its dense control)."""
    argv = ["--config", str(args.config), "--data.path", str(text), "--out_dir", str(out_dir), "--overwrite", "true"]
    if args.checkpoint_dir is not None:
        argv += ["--checkpoint_dir", str(args.checkpoint_dir)]
    if args.mode is not None:
        argv += ["--mode", args.mode]
    if args.max_steps is not None:
        argv += ["--train.max_steps", str(args.max_steps)]
        argv += ["--eval.interval", str(min(config.get("eval", {}).get("interval", 50), args.max_steps))]
    if args.lr is not None:
        ratio = config["train"].get("min_lr", 0.0) / config["train"]["lr"]
        argv += ["--train.lr", str(args.lr), "--train.min_lr", f"{args.lr * ratio:.6g}"]
    if dense:
        length = config["data"]["seq_length"]
        argv += ["--kv_cache.policy", "dense", "--kv_cache.cache_length", str(length), "--kv_cache.options", "{}"]
    return argv


def run_finetune(argv: list[str]) -> float:
    """Run `litkv finetune` in this process; returns the seconds it took."""
    print("litkv finetune " + " ".join(argv), flush=True)
    start = time.perf_counter()
    jsonargparse.CLI(finetune, args=argv)
    return time.perf_counter() - start


def run_evaluate(checkpoint_dir: Path, kv: dict[str, Any], args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """`litkv evaluate` of `checkpoint_dir` at the recipe's policy and budget (and dense)."""
    start = time.perf_counter()
    results: list[PolicyResult] = evaluate(
        checkpoint_dir=checkpoint_dir,
        policies=[kv["policy"]],
        budgets=[kv["cache_length"]],
        num_windows=args.num_windows,
        recall_cases=args.recall_cases,
        multikey_cases=0,
        decode_tokens=0,
        kv_cache=KVCacheConfig(chunk_size=kv.get("chunk_size")),
        policy_options={kv["policy"]: kv["options"]} if kv.get("options") else None,
        out_dir=out_dir,
        num_threads=args.threads,
        overwrite=True,  # a rerun replaces this script's own earlier results
    )
    dense, policy = results[0], results[1]
    return {
        "checkpoint_dir": str(checkpoint_dir),
        "dense_ppl": dense.perplexity,
        "dense_recall": dense.recall_mean,
        "policy_ppl": policy.perplexity,
        "kl": policy.kl,
        "top1": policy.top1,
        "recall": policy.recall_mean,
        "recall_per_depth": {f"{d:g}": a for d, a in policy.recall.items()},
        "digits_kept": needle_digits_kept(checkpoint_dir, kv),
        "seconds": round(time.perf_counter() - start, 1),
    }


@torch.inference_mode()
def needle_digits_kept(checkpoint_dir: Path, kv: dict[str, Any], per_depth: int = 4) -> dict[str, list[float]]:
    """Where the pass key survives: for needle depths 0, 0.25, 0.5, 0.75, the mean number of the
    needle's digit tokens (both copies of the key) that each layer's cache holds, in its fullest KV
    head, when the question arrives (the prompt up to the question run chunk by chunk through `kv`).

    Returns:
        ``{depth: [mean digit tokens held, per layer]}``.
    """
    from litkv.checkpoints.checkpoint import load_model, load_tokenizer
    from litkv.core.tokens import encode_plain
    from litkv.eval.recall import RecallTask
    from litkv.kvcache.config import ChunkPlan
    from litkv.modeling.runner import run_chunks

    model, tokenizer = load_model(checkpoint_dir).eval(), load_tokenizer(checkpoint_dir)
    task = RecallTask.from_checkpoint(checkpoint_dir, tokenizer)
    cache = KVCacheConfig(**kv)
    length = task.fmt.context_length
    out: dict[str, list[float]] = {}
    for ex in task.examples(length, [0.0, 0.25, 0.5, 0.75], per_depth, seed=0):
        needle = encode_plain(tokenizer, task.fmt.needle.format(key=ex.key))
        answer = len(ex.ids) - ex.answer_start
        start = round(ex.depth * (length - len(needle) - len(task.question_ids) - answer))
        digits = {
            start + i for i, t in enumerate(needle) if any(c.isdigit() for c in tokenizer.decode(torch.tensor([t])))
        }
        question = ex.answer_start - len(task.question_ids)
        ids = torch.tensor([ex.ids[:question]])
        with model.kv_caches_attached(cache, 1) as caches:
            run_chunks(model, ids, torch.arange(question)[None], ChunkPlan.of(cache), last_only=True)
            held = [max(len(digits & set(row.tolist())) for row in c.positions[0]) for c in caches]
        sums = out.setdefault(f"{ex.depth:g}", [0.0] * len(held))
        out[f"{ex.depth:g}"] = [a + b / per_depth for a, b in zip(sums, held, strict=True)]
    return out


def format_digits_kept(name: str, kept: dict[str, list[float]]) -> str:
    """One line per depth: digit tokens of the key held per layer."""
    return "\n".join(
        f"{name}: needle depth {d}: key digit tokens held at the question, per layer: "
        + " ".join(f"{v:.1f}" for v in layers)
        for d, layers in kept.items()
    )


# --------------------------------------------------------------------------------------------- report
def assess(base: dict[str, Any], adapted: dict[str, Any], control: dict[str, Any] | None) -> dict[str, Any]:
    """The targets: recall gain, KL fall, control gains clearly less, dense perplexity kept."""

    def gains(m: dict[str, Any]) -> dict[str, float]:
        return {
            "recall_gain": m["recall"] - base["recall"],
            "kl_fall": (base["kl"] - m["kl"]) / base["kl"],
            "dense_ppl_change": m["dense_ppl"] / base["dense_ppl"] - 1.0,
        }

    g = gains(adapted)
    out: dict[str, Any] = {"adapted": g, "control": None if control is None else gains(control)}
    met = {
        "recall_gain": g["recall_gain"] >= TARGETS["recall_gain"],
        "kl_fall": g["kl_fall"] >= TARGETS["kl_fall"],
        "dense_ppl_change": abs(g["dense_ppl_change"]) <= TARGETS["dense_ppl_change"],
    }
    if control is not None:
        c = out["control"]
        met["control_gains_less"] = all(
            c[k] <= CONTROL_SHARE * g[k] and g[k] > 0 for k in ("recall_gain", "kl_fall")
        )  # fmt: skip
    out["met"] = met
    return out


def format_table(rows: dict[str, dict[str, Any]], kv: dict[str, Any]) -> str:
    """One fixed-width table: a row per model."""
    name = f"{kv['policy']}@{kv['cache_length']}"
    head = ["model", "steps", "dense ppl", f"{name} ppl", "KL(dense||policy)", "top-1", f"recall {name}",
            "dense recall"]  # fmt: skip
    lines = [head]
    for label, m in rows.items():
        numbers = [m["dense_ppl"], m["policy_ppl"]]
        lines.append([label, str(m.get("steps", 0)), *(f"{v:.3f}" for v in numbers), f"{m['kl']:.4g}",
                      f"{m['top1']:.3f}", f"{m['recall']:.2f}", f"{m['dense_recall']:.2f}"])  # fmt: skip
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in lines
    )


def format_targets(verdict: dict[str, Any]) -> str:
    """The targets, measured value and met/missed."""
    g, c, met = verdict["adapted"], verdict["control"], verdict["met"]
    lines = [
        f"recall gain at the budget: {g['recall_gain']:+.2f} (target >= +{TARGETS['recall_gain']}): "
        f"{'met' if met['recall_gain'] else 'MISSED'}",
        f"KL(dense || policy) fall: {g['kl_fall']:+.1%} (target >= {TARGETS['kl_fall']:.0%}): "
        f"{'met' if met['kl_fall'] else 'MISSED'}",
        f"dense perplexity change: {g['dense_ppl_change']:+.2%} (target within {TARGETS['dense_ppl_change']:.0%}): "
        f"{'met' if met['dense_ppl_change'] else 'MISSED'}",
    ]
    if c is not None:
        lines.append(
            f"dense control: recall gain {c['recall_gain']:+.2f}, KL fall {c['kl_fall']:+.1%}, dense ppl change "
            f"{c['dense_ppl_change']:+.2%} (target: both gains at most {CONTROL_SHARE:.0%} of the adapted model's): "
            f"{'met' if met['control_gains_less'] else 'MISSED'}"
        )
    return "\n".join(lines)


def read_losses(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """`train_loss` and `val_loss` by step from the run's CSV log (the newest version)."""
    logs = sorted((run_dir / "logs" / "finetune").glob("version_*/metrics.csv"), key=lambda p: p.stat().st_mtime)
    out: dict[str, list[tuple[int, float]]] = {"train_loss": [], "val_loss": []}
    if not logs:
        return out
    with logs[-1].open(encoding="utf-8") as fp:
        for row in csv.DictReader(fp):
            for key in out:
                if row.get(key):
                    out[key].append((int(row["step"]), float(row[key])))
    return out


def plot(rows: dict[str, dict[str, Any]], losses: dict[str, dict[str, list]], kv: dict[str, Any], path: Path) -> None:
    """Recall and KL at the budget and dense perplexity per model, and the training losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = f"{kv['policy']} @ {kv['cache_length']} slots"
    labels = list(rows)
    colors = (["#888888"] + ["#d62728", "#1f77b4", "#ff9896", "#aec7e8", "#2ca02c", "#98df8a"] * 2)[: len(rows)]
    fig, axes = plt.subplots(1, 4, figsize=(17 + 1.2 * max(len(rows) - 3, 0), 3.8))
    panels = [("recall", f"pass-key recall, {name}"), ("kl", f"KL(dense || {kv['policy']}) per token"),
              ("dense_ppl", "perplexity, dense cache")]  # fmt: skip
    for ax, (key, title) in zip(axes[:3], panels, strict=True):
        values = [rows[label][key] for label in labels]
        bars = ax.bar(labels, values, color=colors)
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, labelrotation=15 if len(rows) > 3 else 0)
        if key == "recall":
            ax.set_ylim(0, 1.1)
        if key == "dense_ppl":
            ax.set_ylim(min(values) * 0.9, max(values) * 1.05)
    ax = axes[3]
    for (label, run), color in zip(losses.items(), colors[1:], strict=False):
        steps, values = zip(*run["train_loss"], strict=True) if run["train_loss"] else ((), ())
        ax.plot(steps, values, color=color, alpha=0.8, label=f"{label} (train)")
        if run["val_loss"]:
            vs, vv = zip(*run["val_loss"], strict=True)
            ax.plot(vs, vv, "o--", color=color, label=f"{label} (val, own cache)")
    ax.set_title("fine-tuning loss", fontsize=10)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_suffix(report: dict[str, Any]) -> str:
    """`" (MODE, lr LR)"` of a run, from the adapted checkpoint's `hyperparameters.yaml` (what it trained with)."""
    hparams_file = Path(report["models"]["adapted"]["checkpoint_dir"]) / "hyperparameters.yaml"
    if hparams_file.is_file():
        hparams = yaml.safe_load(hparams_file.read_text(encoding="utf-8"))
        return f" ({hparams['mode']}, lr {hparams['train']['lr']:g})"
    return f" ({report['mode']}, lr {report['lr']:g})"


def plot_reports(reports: Sequence[Path], path: Path) -> None:
    """One plot of several runs' `adapt.json` (same policy, budget and evaluation settings): the shipped
    model once, then each run's adapted model and control, labelled with the run's mode and learning rate."""
    rows: dict[str, dict[str, Any]] = {}
    losses: dict[str, dict[str, list]] = {}
    for report_path in reports:
        report = json.loads(Path(report_path).read_text(encoding="utf-8"))
        cfg = report["config"]
        suffix = _run_suffix(report)
        rows.setdefault("shipped", report["models"]["shipped"])
        for label, model in report["models"].items():
            if label != "shipped":
                rows[label + suffix] = model
                losses[label + suffix] = report["losses"].get(label, {"train_loss": [], "val_loss": []})
    plot(rows, losses, cfg["kv_cache"], path)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> None:
    """Fine-tune with the policy, fine-tune with dense (control), evaluate all, report."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.plot_from:
        plot_reports(args.plot_from, args.plot_out)
        return
    config = load_config(args.config)
    kv, steps = config["kv_cache"], args.max_steps or config["train"]["max_steps"]
    if args.diagnose:
        for directory in args.diagnose:
            print(format_digits_kept(str(directory), needle_digits_kept(directory, kv)))
        return
    base_dir = Path(args.checkpoint_dir or config["checkpoint_dir"])
    run_dir = args.out_dir / (args.tag or f"{kv['policy']}_{kv['cache_length']}")
    start, seconds = time.perf_counter(), {}
    text = args.text or write_training_text(args.out_dir / "kjv_train.txt", base_dir)
    rows: dict[str, dict[str, Any]] = {"shipped": run_evaluate(base_dir, kv, args, run_dir / "eval_shipped")}
    seconds["evaluate_shipped"] = rows["shipped"]["seconds"]
    losses: dict[str, dict[str, list]] = {}
    runs = [("adapted", False)] + ([] if args.skip_control else [("dense control", True)])
    for label, dense in runs:
        out = run_dir / ("control" if dense else "policy")
        seconds[f"finetune_{label}"] = round(run_finetune(finetune_argv(args, config, text, out, dense)), 1)
        rows[label] = {**run_evaluate(out / "final", kv, args, run_dir / f"eval_{out.name}"), "steps": steps}
        seconds[f"evaluate_{label}"] = rows[label]["seconds"]
        losses[label] = read_losses(out)
    seconds["total"] = round(time.perf_counter() - start, 1)
    verdict = assess(rows["shipped"], rows["adapted"], rows.get("dense control"))
    print(format_table(rows, kv))
    print("\n".join(format_digits_kept(label, m["digits_kept"]) for label, m in rows.items()))
    print(format_targets(verdict))
    print(f"wall clock: {seconds['total'] / 60:.1f} min ({json.dumps(seconds)})")
    report = {
        "command": "python scripts/adapt_to_budget.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": config,
        "mode": args.mode or config["mode"],
        "lr": args.lr or config["train"]["lr"],
        "threads": args.threads,
        "recall_cases_per_depth": args.recall_cases,
        "num_windows": args.num_windows,
        "models": rows,
        "targets": TARGETS,
        "control_share": CONTROL_SHARE,
        "verdict": verdict,
        "seconds": seconds,
        "losses": losses,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "adapt.json").write_text(json.dumps(report, indent=2, default=_plain) + "\n", encoding="utf-8")
    plot(rows, losses, kv, run_dir / "adapt.png")
    print(f"wrote {run_dir / 'adapt.json'} and {run_dir / 'adapt.png'}")


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


if __name__ == "__main__":
    main()
