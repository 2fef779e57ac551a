"""A slice of the RULER quality table that survives being stopped: one JSON line per (sample, row, budget).

`litkv evaluate --tasks` writes its table when every row is done; on a loaded machine a 4,096-token table
may not finish. This runs the same samples (`litkv.eval.ruler_report.ruler_samples`: the chat template,
the niah wording, the word list) and the same code (dense: `generate`; one-shot policies:
`litkv.eval.oneshot.oneshot_answers`, every budget from one prefill, the context compressed and the
question fed after it unless `--oneshot_compress prompt`), sample by sample with the tasks interleaved,
and appends each answer to `--out` at once; `--summarize` prints the markdown table of what is there.

    python scripts/ruler_slice.py smollm2-135m-instruct --tasks niah_single_1,niah_single_2 --length 4096 \\
        --num_samples 3 --rows dense,kvzip --budgets 2048,1024,512 --out out/slice.jsonl
    python scripts/ruler_slice.py --summarize out/slice.jsonl out/slice2.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.checkpoints.runtime import load_for_inference
from litkv.cli.common import resolve_checkpoint_dir
from litkv.eval.evaluate import DENSE, cache_config
from litkv.eval.oneshot import KVZIP, oneshot_answers
from litkv.eval.ruler import METRICS, TASKS, resolve_tasks
from litkv.eval.ruler_report import ruler_samples
from litkv.inference.chat_template import TemplateFormat, load_format
from litkv.inference.generate import generate
from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.kvcache.config import KVCacheConfig

REPO = Path(__file__).resolve().parents[1]


def summarize(paths: list[Path], common: bool = False) -> str:
    """Markdown tables of what JSONL files hold: per row (and budget) and task, the mean score and the samples it
    is over, then per row the CPU and wall seconds per sample (a one-shot row's budgets share one prefill).
    `common`: only the (task, sample) pairs that every row answered (a stopped run's rows on the same prompts)."""
    cells: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    times: dict[str, dict[tuple[str, int], tuple[float, float]]] = defaultdict(dict)
    lines = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    if common:
        answered: dict[str, set[tuple[str, int]]] = defaultdict(set)
        for r in lines:
            answered[r["row"]].add((r["task"], r["sample"]))
        keep = set.intersection(*answered.values()) if answered else set()
        lines = [r for r in lines if (r["task"], r["sample"]) in keep]
    for r in lines:
        cells[(r["row"], r["budget"])][r["task"]].append(r["score"])
        times[r["row"]][(r["task"], r["sample"])] = (r["cpu_s"], r["wall_s"])
    tasks = sorted({t for per in cells.values() for t in per})
    out = ["| row | budget | " + " | ".join(tasks) + " | mean |", "|---|---:|" + "---:|" * (len(tasks) + 1)]
    for (row, budget), per in cells.items():
        means = [sum(per[t]) / len(per[t]) if per.get(t) else float("nan") for t in tasks]
        shown = [f"{m:.2f} ({len(per.get(t, []))})" for m, t in zip(means, tasks, strict=True)]
        done = [m for m in means if m == m]
        out.append(f"| {row} | {budget} | " + " | ".join(shown) + f" | {sum(done) / len(done):.2f} |")
    out += ["", "| row | samples | CPU s per sample | wall s per sample |", "|---|---:|---:|---:|"]
    for row, per_sample in times.items():
        cpu, wall = zip(*per_sample.values(), strict=True)
        n = len(per_sample)
        out.append(f"| {row} | {n} | {sum(cpu) / n:.0f} ({min(cpu):.0f}-{max(cpu):.0f}) | {sum(wall) / n:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", nargs="?")
    p.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1")
    p.add_argument("--answer_tasks", default=None, help="answer only these of --tasks (same samples)")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--num_samples", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start_sample", type=int, default=0, help="answer samples start_sample..num_samples-1")
    p.add_argument("--text_file", type=Path, default=REPO / "litkv" / "assets" / "default" / "heldout.txt")
    p.add_argument("--rows", default="dense,kvzip", help="dense and one-shot policies, comma-separated")
    p.add_argument("--budgets", default="2048,1024,512")
    p.add_argument("--chunk_size", type=int, default=512)
    p.add_argument("--row_options", type=json.loads, default={}, help='JSON {"tova": {"heads": "all"}}: options')
    p.add_argument("--oneshot_compress", choices=["context", "prompt"], default="context")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("out/ruler_slice.jsonl"))
    p.add_argument("--summarize", type=Path, nargs="+", default=None, help="print the tables of JSONL files, stop")
    p.add_argument("--common", action="store_true", help="--summarize: only prompts that every row answered")
    args = p.parse_args(argv)
    if args.summarize is not None:
        print(summarize(args.summarize, args.common))
        return 0
    ckpt = resolve_checkpoint_dir(args.checkpoint_dir)
    model, _ = load_for_inference(ckpt, "32-true", "cpu", args.threads, "none")
    tokenizer = load_tokenizer(ckpt)
    fmt = load_format(ckpt, tokenizer)
    settings = {"text_file": args.text_file, "num_samples": args.num_samples, "seed": args.seed}
    samples, _, _ = ruler_samples(ckpt, tokenizer, fmt, resolve_tasks(args.tasks), args.length, settings)
    repeat = RepeatPrompt.build(tokenizer, fmt.template if isinstance(fmt, TemplateFormat) else None)
    budgets = [int(b) for b in args.budgets.split(",")]
    template = KVCacheConfig(chunk_size=args.chunk_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    answered = resolve_tasks(args.answer_tasks) if args.answer_tasks else list(samples)
    for i in range(args.start_sample, args.num_samples):
        for task, rows in samples.items():
            if task not in answered:
                continue
            s = rows[i]
            ids = torch.tensor(s.ids, dtype=torch.long)
            metric = METRICS[TASKS[task].metric]
            for row in args.rows.split(","):
                start, cpu = time.perf_counter(), time.process_time()
                if row == DENSE:
                    cfg = cache_config(template, DENSE, args.length)
                    answers = {args.length: generate(model, [ids], s.max_new_tokens, cfg)[0]}
                else:
                    opts = {**args.row_options.get(row, {}), "mode": "one-shot"}
                    configs = {b: cache_config(template, row, args.length, {**opts, "budget": b}) for b in budgets}
                    r = repeat if row == KVZIP else None
                    if args.oneshot_compress == "context":
                        ctx, question = ids[: s.context_length], ids[s.context_length :]
                        got = oneshot_answers(model, [ctx], s.max_new_tokens, configs, r, None, [question])
                    else:
                        got = oneshot_answers(model, [ids], s.max_new_tokens, configs, r)
                    answers = {b: a[0] for b, a in got.items()}
                wall, cpu = time.perf_counter() - start, time.process_time() - cpu
                with args.out.open("a") as f:
                    for budget, out in answers.items():
                        text = tokenizer.decode(out[: s.max_new_tokens])
                        line = {"task": task, "sample": i, "row": row, "budget": budget, "prediction": text}
                        if args.row_options.get(row):
                            line["options"] = args.row_options[row]
                        line.update(score=metric([text], [s.references]), wall_s=round(wall, 1), cpu_s=round(cpu, 1))
                        f.write(json.dumps(line) + "\n")
                print(f"{task} sample {i} {row}: {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
