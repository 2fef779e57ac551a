"""Export litkv's pass-key recall examples and reference logits for `scripts/compare_kvpress.py`.

Runs under the litkv environment (imports litkv). Writes, into `--out`:

- `recall_examples.json`: the examples `litkv evaluate` builds (`RecallTask.examples` with the same
  length, depths, cases per depth and seed), as token ids with `answer_start`, `depth` and `key`;
- `reference_logits.safetensors`: `ids` `(1, T)`, a window of the checkpoint's filler text, and
  `logits` `(1, T, padded_vocab_size)`, litkv's float32 logits on it (full causal forward, no cache),
  so that the Hugging Face twin built by `compare_kvpress.py` can be checked against litkv.

    python scripts/export_recall_examples.py --out out/kvpress_compare
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from litkv.checkpoints.checkpoint import default_checkpoint_dir, load_model, load_tokenizer
from litkv.cli.evaluate_cmd import DEFAULT_DEPTHS
from litkv.eval.recall import RecallTask

EXAMPLES_FILE = "recall_examples.json"
REFERENCE_FILE = "reference_logits.safetensors"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", type=Path, default=None, help="default: the model shipped with litkv")
    parser.add_argument("--out", type=Path, default=Path("out/kvpress_compare"), help="output directory")
    parser.add_argument("--length", type=int, default=1024, help="tokens per recall example (and logit window)")
    parser.add_argument("--cases", type=int, default=10, help="recall examples per depth")
    parser.add_argument("--seed", type=int, default=0, help="seed of the recall examples (litkv evaluate's default)")
    parser.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS), help="needle depths in [0, 1]")
    parser.add_argument("--window_start", type=int, default=0, help="first filler token of the logit window")
    return parser.parse_args()


def export_examples(task: RecallTask, args: argparse.Namespace, path: Path) -> int:
    """Write the recall examples as JSON; returns how many."""
    examples = task.examples(args.length, args.depths, args.cases, args.seed)
    payload = {
        "length": args.length,
        "seed": args.seed,
        "cases_per_depth": args.cases,
        "depths": args.depths,
        "question_ids": task.question_ids,
        "examples": [
            {"ids": ex.ids, "answer_start": ex.answer_start, "depth": ex.depth, "key": ex.key} for ex in examples
        ],
    }
    path.write_text(json.dumps(payload), encoding="utf-8")
    return len(examples)


@torch.inference_mode()
def export_reference(model: torch.nn.Module, task: RecallTask, args: argparse.Namespace, path: Path) -> None:
    """Write a filler window `(1, T)` and litkv's logits on it `(1, T, V)` as safetensors."""
    stop = args.window_start + args.length
    if args.window_start < 0 or stop > len(task.filler_ids):
        raise ValueError(f"window [{args.window_start}, {stop}) is outside the filler's {len(task.filler_ids)} tokens")
    ids = torch.tensor([task.filler_ids[args.window_start : stop]], dtype=torch.long)
    logits = model(ids).float()
    save_file({"ids": ids.contiguous(), "logits": logits.contiguous()}, str(path))


def main() -> None:
    args = parse_args()
    ckpt = default_checkpoint_dir() if args.checkpoint_dir is None else args.checkpoint_dir
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = load_model(ckpt, dtype=torch.float32)
    task = RecallTask.from_checkpoint(ckpt, load_tokenizer(ckpt))
    args.out.mkdir(parents=True, exist_ok=True)
    n = export_examples(task, args, args.out / EXAMPLES_FILE)
    export_reference(model, task, args, args.out / REFERENCE_FILE)
    print(f"wrote {n} examples to {args.out / EXAMPLES_FILE} and litkv logits to {args.out / REFERENCE_FILE}")


if __name__ == "__main__":
    main()
