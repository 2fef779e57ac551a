#!/usr/bin/env python
"""Train eviction gates for the shipped default model and compare `learned` with the heuristics.

1. Writes the training text (the King James Bible chapters the default model was trained on; the
   held-out chapters, `heldout.txt`, are checked to be the shipped ones and never trained on).
2. `litkv finetune --learn_eviction true --kv_cache.policy learned` twice, same data and steps:
   `--learn.method distill` (DMS-style, through the soft cache) and `--learn.method regress` (the
   Locret/KVzap-style baseline: gates regressed on the dense model's attention mass). Training data:
   1,024-token windows of the training text, `--recall_share` of them pass-key rows (a minority).
3. `litkv evaluate` on the held-out text: `learned` (both gate sets) and every heuristic at the
   budgets, plus recall on a second seed of pass keys (held out: the training keys are drawn from
   other seeds and the evaluation filler is never trained on).
4. Prints one table and the targets, writes `<out_dir>/learn_eviction.json` and `learned.png`
   (loss and kept fraction per step).

Usage::

    nice python scripts/learn_eviction.py --threads 1                    # the shipped result
    nice python scripts/learn_eviction.py --steps 2 --recall_cases 2 --tag smoke
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonargparse
import torch

from litkv.checkpoint import default_checkpoint_dir
from litkv.cli.evaluate_cmd import evaluate
from litkv.config import KVCacheConfig
from litkv.finetune.cli import finetune
from litkv.finetune.learn_eviction import LOG_FILE

HEURISTICS = ["last-recent", "h2o", "tova", "knorm", "keydiff", "snapkv"]
TARGETS = {64: 0.95, 128: 0.99}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out_dir", type=Path, default=Path("out/learned"))
    p.add_argument("--tag", default="default", help="subdirectory of out_dir for this run")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--recall_share", type=float, default=0.2)
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--recall_cases", type=int, default=10, help="pass-key examples per needle depth")
    p.add_argument("--num_windows", type=int, default=4, help="held-out windows for ppl/KL/top-1")
    p.add_argument("--heldout_seed", type=int, default=7, help="seed of the second set of pass keys")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ship", action="store_true", help="copy the distilled gates into litkv/assets/default")
    p.add_argument("--engine", default="whole", help="--learn.engine: whole (the shipped recipe) or chunked")
    p.add_argument("--reuse", action="store_true", help="skip the training of a method whose final/ exists")
    return p.parse_args(argv)


def train(text: Path, method: str, args: argparse.Namespace, out: Path) -> tuple[Path, float]:
    argv = [
        "--learn_eviction", "true", "--kv_cache.policy", "learned", "--data.path", str(text),
        "--data.seq_length", "1024", "--data.recall_share", str(args.recall_share), "--data.val_fraction", "0",
        "--learn.method", method, "--learn.steps", str(args.steps), "--learn.engine", args.engine,
        "--out_dir", str(out),
    ]  # fmt: skip
    print("litkv finetune " + " ".join(argv), flush=True)
    start = time.perf_counter()
    jsonargparse.CLI(finetune, args=argv)
    return out / "final", time.perf_counter() - start


def run_evaluate(checkpoint: Path, policies: list[str], args: argparse.Namespace, seed: int, out: Path) -> list:
    return evaluate(
        checkpoint_dir=checkpoint,
        policies=policies,
        budgets=args.budgets,
        num_windows=args.num_windows,
        recall_cases=args.recall_cases,
        multikey_cases=0,
        decode_tokens=0,
        kv_cache=KVCacheConfig(chunk_size=64),
        seed=seed,
        out_dir=out,
        num_threads=args.threads,
    )


def rows(results: list, name: str | None = None) -> list[dict[str, Any]]:
    return [
        {
            "policy": name if (name and r.policy == "learned") else r.policy,
            "budget": r.cache_length,
            "ppl": r.perplexity,
            "kl": r.kl,
            "top1": r.top1,
            "recall": r.recall_mean,
        }
        for r in results
    ]


def read_log(path: Path) -> list[dict[str, float]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def plot(logs: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, log in logs.items():
        steps = [r["step"] for r in log]
        ax1.plot(steps, [r["fit"] for r in log], label=f"{name} ({'KL' if name == 'distill' else 'MSE'})")
        if name == "distill":
            ax2.plot(steps, [r["keep"] for r in log], label="kept fraction (soft)")
            ax2.plot(steps, [r["target"] for r in log], "--", label="target")
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.legend()
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(all_rows: list[dict[str, Any]]) -> str:
    lines = [
        "| policy | budget | ppl | KL | top-1 | recall | recall (held-out seed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in all_rows:
        lines.append(
            f"| {r['policy']} | {r['budget']} | {r['ppl']:.3f} | {r['kl']:.4g} | {r['top1']:.3f} | "
            f"{r['recall']:.2f} | {r.get('recall_heldout', float('nan')):.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import adapt_to_budget  # scripts/ is on sys.path when this file runs as a script

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out_dir / args.tag
    base = default_checkpoint_dir()
    text = adapt_to_budget.write_training_text(args.out_dir / "kjv_train.txt", base)
    report: dict[str, Any] = {"settings": vars(args) | {"out_dir": str(args.out_dir)}, "train_seconds": {}}
    checkpoints = {}
    for method in ("distill", "regress"):
        if args.reuse and (out / method / "final" / LOG_FILE).is_file():
            checkpoints[method] = out / method / "final"
            continue
        checkpoints[method], seconds = train(text, method, args, out / method)
        report["train_seconds"][method] = round(seconds, 1)
    all_rows = []
    for method, ckpt in checkpoints.items():
        policies = ["learned"] + (HEURISTICS if method == "distill" else [])
        main_rows = rows(run_evaluate(ckpt, policies, args, 0, out / f"eval_{method}"), f"learned ({method})")
        held = rows(run_evaluate(ckpt, policies, args, args.heldout_seed, out / f"eval_{method}_heldout"))
        for row, other in zip(main_rows, held, strict=True):
            row["recall_heldout"] = other["recall"]
        all_rows += [r for r in main_rows if method == "distill" or r["policy"] != "dense"]
    report["rows"] = all_rows
    report["targets"] = targets(all_rows, args.budgets)
    logs = {m: read_log(c / LOG_FILE) for m, c in checkpoints.items()}
    plot(logs, out / "learned.png")
    (out / "learn_eviction.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(table(all_rows))
    print(json.dumps(report["targets"], indent=1))
    print(f"train seconds: {report['train_seconds']}; plot: {out / 'learned.png'}")
    if args.ship:
        shutil.copyfile(checkpoints["distill"] / "eviction_gates.safetensors", base / "eviction_gates.safetensors")
        print(f"shipped the distilled gates to {base}")


def targets(all_rows: list[dict[str, Any]], budgets: Sequence[int]) -> dict[str, Any]:
    """The issue's targets, met or missed, from the table's rows."""
    out: dict[str, Any] = {}
    by = {(r["policy"], r["budget"]): r for r in all_rows}
    for budget in budgets:
        mine = by.get(("learned (distill)", budget))
        base = by.get(("learned (regress)", budget))
        if mine is None:
            continue
        best = min((by[(p, budget)] for p in HEURISTICS if (p, budget) in by), key=lambda r: r["kl"])
        out[f"kl@{budget}"] = {"learned": mine["kl"], "best heuristic": [best["policy"], best["kl"]],
                               "met": mine["kl"] < best["kl"]}  # fmt: skip
        if budget in TARGETS:
            need = TARGETS[budget]
            got = min(mine["recall"], mine["recall_heldout"])
            out[f"recall@{budget}"] = {
                "need": need,
                "got": [mine["recall"], mine["recall_heldout"]],
                "met": got >= need,
            }
        if base is not None:
            out[f"distill vs regress @{budget}"] = {"kl": [mine["kl"], base["kl"]],
                                                    "recall": [mine["recall"], base["recall"]]}  # fmt: skip
    return out


if __name__ == "__main__":
    main()
