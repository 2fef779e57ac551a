"""Export litkv's offline RULER samples (token ids, references) to JSON, for peers run in their own
environment (`scripts/kvpress_ruler.py`): the same prompts, token for token, as `litkv evaluate --tasks`.

    python scripts/export_ruler_samples.py smollm2-135m-instruct --tasks niah_single_2,niah_multikey_1 \\
        --length 1024 --num_samples 8 --out out/ruler_samples.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.cli.common import resolve_checkpoint_dir
from litkv.eval.ruler import NiahFormat, generate_samples, word_list

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="checkpoint directory or a known model's name")
    p.add_argument("--tasks", default="niah_single_2,niah_multikey_1")
    p.add_argument("--length", type=int, default=1024, help="tokens per sample, prompt and answer")
    p.add_argument("--num_samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text_file", type=Path, default=REPO / "litkv" / "assets" / "default" / "heldout.txt")
    p.add_argument("--out", type=Path, default=Path("out/ruler_samples.json"))
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(resolve_checkpoint_dir(args.checkpoint_dir))
    words = word_list(args.text_file.read_text(encoding="utf-8"))
    tasks = args.tasks.split(",")
    samples = generate_samples(tasks, tokenizer, words, args.length, args.num_samples, args.seed, NiahFormat())
    rows = [
        {"task": s.task, "ids": list(s.ids), "references": s.references, "max_new_tokens": s.max_new_tokens}
        for task in samples.values()
        for s in task
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"length": args.length, "seed": args.seed, "samples": rows}))
    print(f"wrote {len(rows)} samples to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
