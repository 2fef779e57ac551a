#!/usr/bin/env python
"""What one-shot `learned` costs at run time against dense and `kvzip`: prefill (with the compression) and
decode, paired, on the real model (issue 58, item 6: prefill <= 1.1x dense, decode >= 0.95x last-recent).

One batch row of `--prompt` random tokens, one thread. Each round runs every row once, in an order that
rotates from round to round, so that all of them see the same load on a shared machine:

- `dense`: the prompt prefilled in chunks of `--chunk_size` into a dense cache, then `--new` greedy tokens;
- `learned`: the same prefill into one-shot `learned` caches of budget `--budget` (the gates the checkpoint
  ships, ranked across layers when they are on one scale), compressed at the end of the prefill
  (`KVCaches.end_prefill`), then the same decode (the compressed cache grows by the new tokens);
- `kvzip`: the same prefill, its context-reconstruction pass (`kvzip_score`) and its compression;
- `last-recent`: a continuous cache of `--budget` slots (4 sinks), the decode reference of the target.

Each row's prefill time runs from the first chunk to the compressed cache (the first token's logits
included); its decode speed is `--new - 1` steps over their time. The table gives the median of the
rounds and each row's median ratio to dense (prefill) and to last-recent (decode), the ratio taken within
each round. Times are the CPU time of the one thread that runs the model (`time.thread_time`: torch runs
on the calling thread with one intra-op thread), so other processes on a shared machine do not count, only
what they do to the caches; `--clock wall` uses `time.perf_counter` instead (for a machine with a core to
spare). A machine whose speed drifts over the minutes between rows (a virtual machine beside others) moves the
rounds' ratios; `--interleaved` then also runs the rows in caches of their own, one prefill chunk of each row at a
time, then one decode step of each row at a time, and gives each row's prefill time against dense's and the
median of its per-step decode ratios.

    nice python scripts/bench_oneshot_cost.py                               # 4,096 tokens, budget 1,024, 5 rounds
    python scripts/bench_oneshot_cost.py --rows dense,learned,last-recent --rounds 1 --interleaved --new 64
    python scripts/bench_oneshot_cost.py --prompt 256 --budget 64 --new 4 --rounds 1 --chunk_size 64   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from litkv import GPT, KVCacheConfig
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.checkpoints.known import model_dir
from litkv.inference.generate import decode_greedy
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_score
from litkv.kvcache.config import ChunkPlan
from litkv.kvcache.kvzip import compress_kvzip
from litkv.modeling.runner import run_chunks

ROWS = ("dense", "learned", "kvzip", "last-recent")
CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="smollm2-135m-instruct", help="a checkpoint directory or known name")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--budget", type=int, default=1024, help="slots per KV head (one-shot budget, last-recent's)")
    p.add_argument("--new", type=int, default=32, help="greedy tokens after the prefill")
    p.add_argument("--chunk_size", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", default=",".join(ROWS), help=f"among {list(ROWS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=list(CLOCKS), default="thread", help="the calling thread's CPU time, or wall")
    p.add_argument("--interleaved", action="store_true", help="also prefill and decode the rows in turn")
    args = p.parse_args(argv)
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown or "dense" not in args.rows.split(","):
        p.error(f"--rows must name dense and any of {list(ROWS)}, got {args.rows!r}")
    return args


def row_config(row: str, args: argparse.Namespace) -> KVCacheConfig:
    """The cache of one row: one-shot rows hold the whole prompt until they compress."""
    room = args.prompt + args.new
    if row == "dense":
        return KVCacheConfig("dense", cache_length=room, chunk_size=args.chunk_size)
    if row == "last-recent":
        chunk = min(args.chunk_size, args.budget)
        return KVCacheConfig("last-recent", cache_length=args.budget, chunk_size=chunk, options={"sinks": 4})
    options = {"mode": "one-shot", "budget": args.budget}
    return KVCacheConfig(row, cache_length=room, chunk_size=args.chunk_size, options=options)


def compress(model: GPT, row: str, ids: torch.Tensor, repeat: RepeatPrompt) -> None:
    """The end of a row's prefill of `ids` into the attached caches: `kvzip`'s pass and compression, `learned`'s."""
    if row == "kvzip":
        kvzip_score(model, [ids[0]], repeat, repeat.prefix_length)
        compress_kvzip(list(model.caches))
    elif row == "learned":
        model.caches.end_prefill()


def prefill(model: GPT, row: str, ids: torch.Tensor, config: KVCacheConfig, repeat: RepeatPrompt) -> torch.Tensor:
    """One row's prefill into the attached caches, compressed (`(1, T, n_embd)` hidden states of the last chunk)."""
    pos = torch.arange(ids.shape[1])[None]
    hidden = run_chunks(model, ids, pos, ChunkPlan.of(config), lm_head=False, last_only=True)
    compress(model, row, ids, repeat)
    return hidden


@torch.inference_mode()
def run_row(
    model: GPT, row: str, ids: torch.Tensor, args: argparse.Namespace, repeat: RepeatPrompt
) -> tuple[float, float]:
    """(prefill seconds including the compression, decode tokens/s) of one row on `ids` `(1, T)`."""
    config = row_config(row, args)
    pos = torch.arange(ids.shape[1])[None]
    with model.kv_caches_attached(config, 1):
        clock = CLOCKS[args.clock]
        start = clock()
        hidden = prefill(model, row, ids, config, repeat)
        model.lm_head(hidden[:, -1:])  # the first token's logits
        prefill_s = clock() - start
        start = clock()
        decode_greedy(model, hidden, pos[:, -1] + 1, args.new)
        decode = clock() - start
    return prefill_s, (args.new - 1) / decode


@torch.inference_mode()
def interleaved(
    model: GPT, rows: list[str], ids: torch.Tensor, args: argparse.Namespace, repeat: RepeatPrompt
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The rows' prefills and decodes taken in turn, each row in caches of its own: the prompt's chunks one of each
    row at a time (a row's compression, and its first token's logits, after its last chunk), then `--new` greedy
    decode steps one of each row at a time, the order rotating. Per row: the prefill's seconds, and each decode
    step's seconds (caches are attached between calls, outside the timed ones)."""
    t, clock = ids.shape[1], CLOCKS[args.clock]
    configs = {row: row_config(row, args) for row in rows}
    caches = {row: model.build_kv_caches(configs[row], 1) for row in rows}
    prefill_s, logits = dict.fromkeys(rows, 0.0), {}
    pos = torch.arange(t)[None]
    for start in range(0, t, args.chunk_size):
        part = slice(start, start + args.chunk_size)
        for row in rows:
            with model.kv_caches_attached(caches[row]):
                begin = clock()
                hidden = run_chunks(model, ids[:, part], pos[:, part], ChunkPlan.of(configs[row]), lm_head=False,
                                    last_only=True)  # fmt: skip
                if part.stop >= t:
                    compress(model, row, ids, repeat)
                    logits[row] = model.lm_head(hidden[:, -1])
                prefill_s[row] += clock() - begin
    decode_rows = [row for row in rows if row != "dense" or "last-recent" not in rows]  # dense: the reference
    times = {row: [] for row in decode_rows}
    for step in range(args.new):
        step_pos = torch.tensor([[t + step]])
        for row in decode_rows[step % len(decode_rows) :] + decode_rows[: step % len(decode_rows)]:
            with model.kv_caches_attached(caches[row]), model.trusted_inputs(t + args.new, no_pads=True):
                begin = clock()
                logits[row] = model(logits[row].argmax(-1)[:, None], step_pos)[:, -1]
                times[row].append(clock() - begin)
    return prefill_s, times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    ckpt = model_dir(args.checkpoint)
    model = load_model(ckpt, dtype=torch.float32)
    if "learned" in args.rows.split(",") and model.eviction_gates is None:
        print(f"error: {ckpt} has no eviction gates for the learned row", file=sys.stderr)
        return 2
    repeat = RepeatPrompt.build(load_tokenizer(ckpt), None)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=gen)
    rows = args.rows.split(",")
    target = getattr(model.eviction_gates, "target", None)
    print(f"{ckpt.name}: prompt {args.prompt}, budget {args.budget}, {args.new} new tokens, chunks of "
          f"{args.chunk_size}, one thread, {args.rounds} rounds, {args.clock} clock; gates {target!r}")  # fmt: skip
    results: dict[str, list[tuple[float, float]]] = {row: [] for row in rows}
    for r in range(args.rounds):
        order = rows[r % len(rows) :] + rows[: r % len(rows)]
        for row in order:
            results[row].append(run_row(model, row, ids, args, repeat))
        line = ", ".join(f"{row} {results[row][-1][0]:.2f} s / {results[row][-1][1]:.2f} tok/s" for row in rows)
        print(f"round {r + 1} ({order[0]} first): {line}", flush=True)
    ref = "last-recent" if "last-recent" in rows else "dense"
    print(f"\n| row | prefill s (median) | prefill / dense | decode tok/s (median) | decode / {ref} |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        pre = statistics.median(p for p, _ in results[row])
        dec = statistics.median(d for _, d in results[row])
        pre_ratio = statistics.median(a[0] / b[0] for a, b in zip(results[row], results["dense"], strict=True))
        dec_ratio = statistics.median(a[1] / b[1] for a, b in zip(results[row], results[ref], strict=True))
        print(f"| {row} | {pre:.2f} | {pre_ratio:.3f}x | {dec:.2f} | {dec_ratio:.3f}x |")
    if args.interleaved:
        prefill_s, times = interleaved(model, rows, ids, args, repeat)
        print(f"\ninterleaved (the chunks, then {args.new} decode steps, one of each row at a time): prefill s and")
        print(f"/ dense; decode ms per step (median) and the median of each step's {ref} time over the row's")
        for row in rows:
            line = f"- {row}: prefill {prefill_s[row]:.2f} s, {prefill_s[row] / prefill_s['dense']:.3f}x"
            if row in times:
                ratio = statistics.median(b / a for a, b in zip(times[row], times[ref], strict=True))
                line += f"; decode {1000 * statistics.median(times[row]):.1f} ms, {ratio:.3f}x"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
