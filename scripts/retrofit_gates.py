#!/usr/bin/env python
"""A DMS-style retrofit of SmolLM2-135M-Instruct through its cache, starting from fitted key-input gates
(issue 58, item 3), resumable.

1. **data**: `--windows` retrieval windows of `--length` tokens (`litkv.finetune.retrieval_data`, the
   generator of the KVzap fit, from the KJV training chapters with the held-out lines taken out; seed
   `--seed`), decoded and written to `OUT/retrofit_train.txt` (once).
2. **retrofit**: `litkv finetune --learn_eviction true` on that text with `--learn.init checkpoint` (the
   one-scale key-input gates of the checkpoint given, one bias shift to a `--keep` share; soft eviction trains
   key-input gates only, so not the hidden-state gates litkv ships: `scripts/fit_kvzap.py`'s `OUT/ckpt_raw`),
   `--learn.lora true` (r 8, alpha 16 on the attention's qkv and output projections), the soft eviction at the
   target keep `--keep` from step 0 (`--learn.ramp 0`), the base model with its adapters off as teacher, through
   the chunked gradient engine and `learned` caches with room for every token (chunks of 128). A checkpoint every
   `--interval` steps; run the same command again to go on from the last one (`--resume`). Output:
   `OUT/run/final`, a checkpoint directory (merged weights, gates) that `litkv generate --kv-cache learned
   OUT/run/final` and `scripts/ruler_slice.py OUT/run/final` load by path.

    OMP_NUM_THREADS=1 nice -n 5 python scripts/retrofit_gates.py out/kvzap_fit/ckpt_raw --out_dir out/retrofit \
        --steps 60
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jsonargparse
import torch

from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.cli.common import resolve_checkpoint_dir
from litkv.cli.finetune_cmd import finetune
from litkv.finetune.retrieval_data import retrieval_window

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fit_kvzap import training_lines  # noqa: E402  (scripts/: the KVzap fit's source text)

NAME = "smollm2-135m-instruct"


def write_data(out: Path, windows: int, length: int, seed: int) -> Path:
    """`OUT/retrofit_train.txt`: the decoded windows, written once."""
    path = out / "retrofit_train.txt"
    if path.is_file():
        return path
    ckpt = resolve_checkpoint_dir(NAME)
    tok = load_tokenizer(ckpt)
    lines = training_lines(out)
    parts = [tok.decode(torch.tensor(retrieval_window(lines, tok, length, seed, i))) for i in range(windows)]
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def last_checkpoint(run: Path) -> Path | None:
    steps = sorted(run.glob("step-*")) if run.is_dir() else []
    return steps[-1] if steps else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint directory of SmolLM2-135M-Instruct with key-input gates")
    p.add_argument("--out_dir", type=Path, default=Path("out/retrofit"))
    p.add_argument("--windows", type=int, default=200)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--keep", type=float, default=0.25, help="the soft eviction's target keep share")
    p.add_argument("--lr", type=float, default=0.01, help="the gates' Adam learning rate")
    p.add_argument("--lora_lr", type=float, default=5e-4)
    p.add_argument("--interval", type=int, default=10, help="a resumable checkpoint every this many steps")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    data = write_data(args.out_dir, args.windows, args.length, args.seed)
    run = args.out_dir / "run"
    argv = ["--checkpoint_dir", str(resolve_checkpoint_dir(args.checkpoint)), "--data.path", str(data),
            "--data.seq_length", str(args.length), "--data.val_fraction", "0", "--learn_eviction", "true",
            "--kv_cache.policy", "learned", "--kv_cache.cache_length", str(args.length),
            "--kv_cache.chunk_size", "128", "--learn.init", "checkpoint", "--learn.lora", "true",
            "--lora.r", "8", "--lora.alpha", "16", "--lora.targets", "[attn.qkv, attn.proj]",
            "--learn.steps", str(args.steps), "--learn.batch_size", str(args.batch_size),
            "--learn.target_keep", str(args.keep), "--learn.ramp", "0", "--learn.lr", str(args.lr),
            "--learn.lora_lr", str(args.lora_lr), "--learn.checkpoint_interval", str(args.interval),
            "--out_dir", str(run)]  # fmt: skip
    resume = last_checkpoint(run)
    if resume is not None:
        argv += ["--resume", str(resume)]
    print("litkv finetune " + " ".join(argv), flush=True)
    jsonargparse.CLI(finetune, args=argv)


if __name__ == "__main__":
    main()
