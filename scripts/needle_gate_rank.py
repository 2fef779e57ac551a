#!/usr/bin/env python
"""Where a checkpoint's eviction gates rank a RULER needle: for every (layer, KV head), the rank (0 = kept
first) of the needle's answer tokens by gate logit among the prompt's tokens `sinks .. T - tail` (the ones
that are neither sinks nor near the question), the median over the needle's tokens; then the median of
those ranks and how many (layer, KV head) pairs rank the needle inside `--slots`.

    python scripts/export_ruler_samples.py smollm2-135m-instruct --tasks niah_single_2 --length 4096 \\
        --num_samples 6 --out out/ruler4096.json
    python scripts/needle_gate_rank.py smollm2-135m-instruct --samples out/ruler4096.json --slots 252
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.cli.common import resolve_checkpoint_dir
from litkv.finetune.gate_training import attention_mass


def needle_positions(ids: list[int], answer: list[int]) -> list[int]:
    """The positions of the first occurrence of `answer` in `ids` (ValueError when absent)."""
    for start in range(len(ids) - len(answer) + 1):
        if ids[start : start + len(answer)] == answer:
            return list(range(start, start + len(answer)))
    raise ValueError(f"the answer's tokens {answer} do not occur in the prompt")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="checkpoint directory (with eviction gates) or a known model's name")
    p.add_argument("--samples", type=Path, required=True, help="scripts/export_ruler_samples.py's JSON")
    p.add_argument("--sample", type=int, default=0)
    p.add_argument("--slots", type=int, default=252, help="slots the gates fill (cache - recent - sinks)")
    p.add_argument("--tail", type=int, default=300, help="last tokens left out (recent window, question)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_checkpoint_dir(args.checkpoint_dir)
    model, tokenizer = load_model(path), load_tokenizer(path)
    gates = model.eviction_gates
    if gates is None:
        raise SystemExit(f"{path} has no eviction gates")
    sample = json.loads(args.samples.read_text(encoding="utf-8"))["samples"][args.sample]
    answer = tokenizer.processor.encode(" " + sample["references"][0]).ids[1:]  # the digits, without the space
    needle = needle_positions(sample["ids"], answer)
    ids = torch.tensor([sample["ids"]])
    lo, hi = gates.sinks, ids.shape[1] - args.tail
    ranks = []
    with torch.no_grad():
        for layer, (keys_pre, _) in enumerate(attention_mass(model, ids, gates.window)):
            logits = gates.logits(layer, keys_pre)[0]  # (G, T)
            for head in range(logits.shape[0]):
                order = logits[head, lo:hi].argsort(descending=True) + lo
                rank = {int(pos): r for r, pos in enumerate(order)}
                ranks.append(statistics.median_low(rank[p] for p in needle if lo <= p < hi))
    print(f"needle at tokens {needle[0]}-{needle[-1]} of {ids.shape[1]}; ranked among {hi - lo} tokens")
    print(f"median rank over {len(ranks)} (layer, KV head) pairs: {statistics.median(ranks)}; "
          f"inside {args.slots} slots: {sum(r < args.slots for r in ranks)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
