"""Export litkv's offline RULER samples (token ids, where the context ends, references) to JSON, for peers
run in their own environment (`scripts/kvpress_ruler.py`): the same prompts, token for token, as
`litkv evaluate --tasks` makes them (the checkpoint's chat template unless `--chat_template false`, its
niah wording, the word list of `--text_file`).

    python scripts/export_ruler_samples.py smollm2-135m-instruct --tasks niah_single_2,niah_multikey_1 \\
        --length 4096 --num_samples 2 --out out/ruler_samples.json

`--keep task:sample,...` writes only those samples (of the same `--tasks` and `--num_samples`: a task's
samples depend on its index in `--tasks`), each with its index as `sample`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.cli.common import resolve_checkpoint_dir
from litkv.eval.ruler import resolve_tasks
from litkv.eval.ruler_report import ruler_samples
from litkv.inference.chat_template import load_format

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="checkpoint directory or a known model's name")
    p.add_argument("--tasks", default="niah_single_2,niah_multikey_1")
    p.add_argument("--length", type=int, default=1024, help="tokens per sample, prompt and answer")
    p.add_argument("--num_samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text_file", type=Path, default=REPO / "litkv" / "assets" / "default" / "heldout.txt")
    p.add_argument("--chat_template", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--keep", default=None, help="only these samples, e.g. niah_single_1:0,niah_single_2:10")
    p.add_argument("--out", type=Path, default=Path("out/ruler_samples.json"))
    args = p.parse_args(argv)
    ckpt = resolve_checkpoint_dir(args.checkpoint_dir)
    tokenizer = load_tokenizer(ckpt)
    fmt = load_format(ckpt, tokenizer, {"auto": None, "true": True, "false": False}[args.chat_template])
    settings = {"text_file": args.text_file, "num_samples": args.num_samples, "seed": args.seed}
    samples, _, _ = ruler_samples(ckpt, tokenizer, fmt, resolve_tasks(args.tasks), args.length, settings)
    keep = None if args.keep is None else {(k.split(":")[0], int(k.split(":")[1])) for k in args.keep.split(",")}
    rows = [
        {
            "task": s.task,
            "sample": i,
            "ids": list(s.ids),
            "context_length": s.context_length,
            "references": s.references,
            "max_new_tokens": s.max_new_tokens,
        }
        for task in samples.values()
        for i, s in enumerate(task)
        if keep is None or (s.task, i) in keep
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"length": args.length, "seed": args.seed, "format": fmt.name, "samples": rows}))
    print(f"wrote {len(rows)} samples to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
