#!/usr/bin/env python
"""Fit the eviction gates litkv ships for SmolLM2-135M-Instruct (`litkv/assets/gates/NAME.safetensors`).

1. Writes the training text: the King James Bible chapters the default model was trained on (natural
   text); the held-out chapters (`litkv/assets/default/heldout.txt`, the filler of the evaluation's
   RULER samples and the text of its KL rows) are excluded and checked to be.
2. `litkv finetune NAME --learn_eviction true --learn.method lstsq`: the gates in closed form from the
   dense model's attention (`litkv.finetune.lstsq`), on `--sequences` windows of `--seq_length` tokens,
   `--recall_share` of them pass-key rows (`litkv.eval.recall`'s format, not RULER's tasks); with
   `--target kvzip`, from the log KVzip+ scores of a reconstruction pass instead (KVzap's target,
   `litkv.finetune.kvzip_target`). Prints the fit's wall and CPU time.
3. With `--ship`, copies the gates into the package; `litkv download NAME` (or any command given the
   name) then adds them to the converted checkpoint, and `load_model` checks their fingerprint.

    python scripts/learn_real_gates.py --ship          # the shipped gates (about 40 min on 2 busy cores)
    python scripts/learn_real_gates.py --sequences 2 --seq_length 256 --out_dir out/smoke
    nice python scripts/learn_real_gates.py --target kvzip --sequences 4 --threads 2 --out_dir out/kvzap_gates

Evaluate them with `litkv evaluate` (docs/learned.md, "Gates for the real model").
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import jsonargparse
import torch

from litkv.checkpoints.checkpoint import default_checkpoint_dir
from litkv.checkpoints.download import SHIPPED_GATES
from litkv.cli.common import resolve_checkpoint_dir
from litkv.cli.finetune_cmd import finetune
from litkv.gates.gate import GATES_FILE

REPO = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m-instruct"


def main(argv: Sequence[str] | None = None) -> None:
    import adapt_to_budget  # scripts/ is on sys.path when this file runs as a script

    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out_dir", type=Path, default=Path("out/real_gates"))
    p.add_argument("--sequences", type=int, default=32, help="training windows (2 per step)")
    p.add_argument("--seq_length", type=int, default=2048)
    p.add_argument("--recall_share", type=float, default=0.2)
    p.add_argument("--target", choices=["attention", "kvzip"], default="attention", help="--learn.target")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--ship", action="store_true", help=f"copy the gates to litkv/{SHIPPED_GATES}/{NAME}.safetensors")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = adapt_to_budget.write_training_text(args.out_dir / "kjv_train.txt", default_checkpoint_dir())
    recall_format = default_checkpoint_dir() / "recall_format.json"
    cli = [
        "--checkpoint_dir", str(resolve_checkpoint_dir(NAME)),
        "--learn_eviction", "true", "--kv_cache.policy", "learned",
        "--data.path", str(text), "--data.seq_length", str(args.seq_length), "--data.val_fraction", "0",
        "--data.recall_share", str(args.recall_share), "--data.recall_format", str(recall_format),
        "--learn.method", "lstsq", "--learn.target", args.target,
        "--learn.steps", str(max(1, args.sequences // 2)), "--learn.batch_size", "2",
        "--out_dir", str(args.out_dir / "lstsq"), "--overwrite", "true",
    ]  # fmt: skip
    print("litkv finetune " + " ".join(cli), flush=True)
    start, cpu = time.perf_counter(), time.process_time()
    jsonargparse.CLI(finetune, args=cli)
    final = args.out_dir / "lstsq" / "final"
    print(f"fitted in {time.perf_counter() - start:.0f} s wall, {time.process_time() - cpu:.0f} s CPU: {final}")
    if args.ship:
        target = REPO / "litkv" / SHIPPED_GATES / f"{NAME}.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(final / GATES_FILE, target)
        print(f"shipped: {target}")


if __name__ == "__main__":
    main()
