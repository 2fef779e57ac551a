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

With `--compare_lora`, it trains instead gates alone and gates with LoRA adapters (`--learn.lora true`),
same data, steps, engine and caches, and compares them at the budgets: KL to the *base* dense model
(the teacher; `litkv evaluate`'s KL would be to the retrofitted model's own dense run), perplexity, top-1
agreement with the base and pass-key recall (two seeds); plus the retrofitted model's dense KL to the
base (what the adapters cost without eviction).

Usage::

    nice python scripts/learn_eviction.py --threads 1                    # the shipped result
    nice python scripts/learn_eviction.py --steps 2 --recall_cases 2 --tag smoke
    nice python scripts/learn_eviction.py --threads 1 --compare_lora --steps 100 --engine chunked --tag lora
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
import torch.nn.functional as F

from litkv.checkpoints.checkpoint import default_checkpoint_dir, load_model, load_tokenizer
from litkv.cli.evaluate_cmd import evaluate
from litkv.cli.finetune_cmd import finetune
from litkv.core.tokens import encode_plain
from litkv.eval.evaluate import text_windows
from litkv.eval.recall import RECALL_FILE, RecallFormat
from litkv.finetune.learn_eviction import LOG_FILE
from litkv.inference.generate import forward_chunked
from litkv.kvcache.config import KVCacheConfig

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
    p.add_argument("--compare_lora", action="store_true", help="gates alone against gates + LoRA adapters")
    p.add_argument("--lora_lr", type=float, default=1e-3, help="--learn.lora_lr (with --compare_lora)")
    p.add_argument("--lora_r", type=int, default=8, help="--lora.r (with --compare_lora)")
    p.add_argument("--lora_targets", default="[attn.qkv, attn.proj]", help="--lora.targets (with --compare_lora)")
    p.add_argument("--batch_size", type=int, default=4, help="--learn.batch_size")
    return p.parse_args(argv)


def train(text: Path, method: str, args: argparse.Namespace, out: Path) -> tuple[Path, float]:
    """`method`: distill, regress, or lora (distill with --learn.lora true)."""
    lora = ["--learn.lora", "true", "--learn.lora_lr", str(args.lora_lr), "--lora.r", str(args.lora_r),
            "--lora.alpha", str(2 * args.lora_r), "--lora.targets", args.lora_targets]  # fmt: skip
    argv = [
        "--learn_eviction", "true", "--kv_cache.policy", "learned", "--data.path", str(text),
        "--data.seq_length", "1024", "--data.recall_share", str(args.recall_share), "--data.val_fraction", "0",
        "--learn.method", "distill" if method == "lora" else method, "--learn.steps", str(args.steps),
        "--learn.engine", args.engine, "--learn.batch_size", str(args.batch_size), "--out_dir", str(out),
        "--overwrite", "true", *(lora if method == "lora" else []),
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
        overwrite=True,  # a rerun replaces this script's own earlier results
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


@torch.inference_mode()
def kl_to_base(base: Path, checkpoint: Path, budgets: Sequence[int], num_windows: int) -> dict[int, dict[str, float]]:
    """Per budget (and `0`: the model's own dense run), on the held-out windows `litkv evaluate` scores:
    the mean KL(base dense || `checkpoint` with a `learned` cache of that budget, chunks of 64) per token,
    and the top-1 agreement with the base."""
    tokenizer = load_tokenizer(base)
    fmt = RecallFormat.load(base / RECALL_FILE)
    teacher, student = load_model(base), load_model(checkpoint)
    length = min(fmt.context_length, teacher.config.block_size)
    ids = torch.tensor(encode_plain(tokenizer, (base / fmt.filler_file).read_text(encoding="utf-8")))
    windows = text_windows(ids, length, num_windows)[:, :-1]
    dense = KVCacheConfig(policy="dense", cache_length=length, chunk_size=64)
    ref = F.log_softmax(forward_chunked(teacher, windows, dense).float(), dim=-1)
    out = {}
    for budget in [0, *budgets]:
        cfg = dense if budget == 0 else KVCacheConfig(policy="learned", cache_length=budget, chunk_size=64)
        logp = F.log_softmax(forward_chunked(student, windows, cfg).float(), dim=-1)
        kl = F.kl_div(logp, ref, log_target=True, reduction="sum") / logp.shape[0] / logp.shape[1]
        top1 = (logp.argmax(-1) == ref.argmax(-1)).float().mean()
        out[budget] = {"kl_to_base": float(kl), "top1_base": float(top1)}
    return out


def compare_lora(args: argparse.Namespace, text: Path, base: Path, out: Path) -> None:
    """Gates alone against gates + LoRA adapters: same data, steps, engine and caches (module docstring)."""
    report: dict[str, Any] = {"settings": vars(args) | {"out_dir": str(args.out_dir)}, "train_seconds": {}, "rows": []}
    for method in ("distill", "lora"):
        ckpt = out / method / "final"
        if not (args.reuse and (ckpt / LOG_FILE).is_file()):
            ckpt, seconds = train(text, method, args, out / method)
            report["train_seconds"][method] = round(seconds, 1)
        name = "gates + LoRA" if method == "lora" else "gates"
        main_rows = rows(run_evaluate(ckpt, ["learned"], args, 0, out / f"eval_{method}"), name)
        held = rows(run_evaluate(ckpt, ["learned"], args, args.heldout_seed, out / f"eval_{method}_heldout"), name)
        kl = kl_to_base(base, ckpt, args.budgets, args.num_windows)
        for row, other in zip(main_rows, held, strict=True):
            row["recall_heldout"] = other["recall"]
            row.update(kl[0 if row["policy"] == "dense" else row["budget"]])
            row["policy"] = f"{name}, dense" if row["policy"] == "dense" else name
        report["rows"] += main_rows
    (out / "compare_lora.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    lines = ["| model | budget | KL to base dense | top-1 vs base | ppl | recall | recall (seed "
             f"{args.heldout_seed}) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["rows"]:
        lines.append(
            f"| {r['policy']} | {r['budget']} | {r['kl_to_base']:.4f} | {r['top1_base']:.3f} | {r['ppl']:.3f} | "
            f"{r['recall']:.2f} | {r['recall_heldout']:.2f} |"
        )
    print("\n".join(lines))
    print(f"train seconds: {report['train_seconds']}; {out / 'compare_lora.json'}")


def main(argv: Sequence[str] | None = None) -> None:
    import adapt_to_budget  # scripts/ is on sys.path when this file runs as a script

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out_dir / args.tag
    base = default_checkpoint_dir()
    text = adapt_to_budget.write_training_text(args.out_dir / "kjv_train.txt", base)
    if args.compare_lora:
        compare_lora(args, text, base, out)
        return
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
