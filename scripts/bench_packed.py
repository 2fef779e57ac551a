"""A step of `litkv serve`'s batch that feeds a prompt chunk and decodes the other rows: separate calls (the
chunk at batch one, then the decode step) against one packed call (`RowBatch.packed_step`), on
SmolLM2-135M's shapes; and the linear layers' cost per row at several row counts.

Run on one torch thread (`--threads`), alternating the two ways, medians of `--reps`. Random weights of the
preset's shapes (the arithmetic is that of the real checkpoint's; the tokens do not matter). Prints each
step's time both ways and their ratio, the products the packed call shared, and a table of the linear
layers' microseconds per row.

With `--loop CHECKPOINT` (a converted chat checkpoint): instead, a closed loop of `--clients` conversations
through the server's engine in process (`--max_batch 8`, h2o), each client sending its next turn when its
reply ends, packing off and on alternated `--reps` times: time to first token p50 / max per turn, and
whether the replies are equal.

    nice python scripts/bench_packed.py --rows 2 8 16 --chunks 64 256 --reps 5
    nice python scripts/bench_packed.py --loop smollm2-135m-instruct --reps 2
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch

from litkv.modeling.config import Config, KVCacheConfig
from litkv.modeling.model import GPT
from litkv.modeling.runner import ChunkPlan
from litkv.serve.batch import RowBatch
from litkv.serve.rounding import matmul_layers


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="SmolLM2-135M", help="a LitGPT preset name (random weights)")
    p.add_argument("--rows", type=int, nargs="+", default=[2, 8, 16], help="decode rows of the step")
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 256], help="prompt chunk widths")
    p.add_argument("--cache_length", type=int, default=256, help="h2o slots per row")
    p.add_argument("--reps", type=int, default=5, help="timed steps per way and setting")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--linear_rows", type=int, nargs="+", default=[1, 2, 8, 16, 64, 256, 600])
    p.add_argument("--loop", help="a checkpoint (name or path): the closed-loop TTFT comparison instead")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    return p.parse_args()


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def setting(model: GPT, m: int, t: int, cache_length: int, reps: int) -> tuple[float, float, list[list[int]], int]:
    """Medians (s) of a step of `m` decode rows and a `t`-token chunk, separate and packed; the packs; step rows."""
    kv = KVCacheConfig(policy="h2o", cache_length=cache_length, chunk_size=min(t, cache_length))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = RowBatch(model, kv, m + 1)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.padded_vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(vocab, (n,), generator=gen).tolist()

    for row in range(m + 1):
        batch.clear(row)
        batch.prefill(row, ids(32), ChunkPlan(32, 32))
    tokens: list[int | None] = [*ids(m), None]

    def separate() -> None:
        batch.prefill(m, ids(t), ChunkPlan(t, t))
        batch.step(tokens, [batch.next_pos(r) for r in range(m + 1)])

    def packed() -> None:
        batch.packed_step(tokens, [batch.next_pos(r) for r in range(m + 1)], [(m, ids(t))])

    separate(), packed()  # warm: the probe measures its counts on the first packed call
    a, b = [], []
    for _ in range(reps):
        a.append(timed(separate))
        b.append(timed(packed))
    return statistics.median(a), statistics.median(b), batch.last_packs, batch.last_step_rows


@torch.inference_mode()
def linear_costs(model: GPT, counts: list[int], reps: int) -> list[tuple[int, float]]:
    """Microseconds per row of one block's linear layers (every distinct one, as many as the block has) times
    the layers, at each row count."""
    block = model.transformer.h[0]
    layers = [block.attn.qkv, block.attn.proj, *(m for m in block.mlp.modules() if isinstance(m, torch.nn.Linear))]
    out = []
    for n in counts:
        xs = [torch.randn(n, layer.in_features) for layer in layers]

        def run(xs: list[torch.Tensor] = xs) -> None:
            for layer, x in zip(layers, xs, strict=True):
                layer(x)

        run()
        best = statistics.median(timed(run) for _ in range(max(reps, 3)))
        out.append((n, best * model.config.n_layer / n * 1e6))
    return out


WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "a",
    "cat",
    "sleeps",
    "near",
    "the",
    "warm",
    "fire",
    "in",
    "winter",
    "and",
]


def closed_loop(engine: object, clients: int, turns: int, seed: int) -> tuple[list[list[float]], list]:
    """`clients` conversations of `turns` turns (20-word messages, 8-token greedy replies), each next turn sent
    when its reply ends: TTFT (s, from submit to the first text) per turn, and every reply's ids."""
    from litkv.serve import TurnRequest, TurnResult
    from litkv.serve.scheduler import Job

    sched, msgs = engine.scheduler, [[] for _ in range(clients)]  # type: ignore[attr-defined]
    ttft: list[list[float]] = [[] for _ in range(turns)]
    live: dict[int, tuple[Job, dict, int]] = {}
    replies = []

    def submit(i: int) -> None:
        t = sum(role == "user" for role, _ in msgs[i])
        msgs[i].append(("user", " ".join(WORDS[(3 * i + t + seed) % 9 :][:20])))
        sent, seen = time.perf_counter(), {}

        def emit(kind: str, value: object) -> None:
            if kind == "text":
                seen.setdefault("first", time.perf_counter() - sent)

        live[i] = (Job(TurnRequest(list(msgs[i]), 8), TurnResult(), emit=emit), seen, t)
        sched.submit(live[i][0])

    for i in range(clients):
        submit(i)
    while live:
        sched.step()
        for i, (job, seen, t) in list(live.items()):
            if job.done:
                ttft[t].append(seen.get("first", float("nan")))
                msgs[i].append(("assistant", job.result.content))
                replies.append((i, t, job.result.reply_ids))
                del live[i]
                if t + 1 < turns:
                    submit(i)
    return ttft, sorted(replies)


def loop_main(args: argparse.Namespace) -> None:
    from litkv.checkpoints.checkpoint import load_model, load_tokenizer
    from litkv.checkpoints.download import cache_dir
    from litkv.inference.chat_template import load_format
    from litkv.serve import ConversationStore, Engine

    ckpt = Path(args.loop) if Path(args.loop).is_dir() else cache_dir(args.loop)
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    fmt = load_format(ckpt, tok, None)
    kv = KVCacheConfig(policy="h2o", cache_length=args.cache_length)
    print(f"{ckpt.name}, float32, {torch.get_num_threads()} thread(s), h2o {args.cache_length}, --max_batch 8, "
          f"{args.clients} clients x {args.turns} turns, closed loop")  # fmt: skip
    print("| packing | rep | TTFT p50 by turn (s) | TTFT max by turn (s) | wall (s) |")
    print("|---|---|---|---|---|")
    same = True
    for rep in range(args.reps):
        got = {}
        for packing in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine = Engine(
                    model, tok, kv, ConversationStore(1 << 30, model=model, kv_cache=kv), fmt=fmt, max_batch=8
                )
            engine.batch.packing = packing
            start = time.perf_counter()
            ttft, got[packing] = closed_loop(engine, args.clients, args.turns, rep)
            wall = time.perf_counter() - start
            p50 = " / ".join(f"{statistics.median(x):.2f}" for x in ttft)
            top = " / ".join(f"{max(x):.2f}" for x in ttft)
            print(f"| {'on' if packing else 'off'} | {rep} | {p50} | {top} | {wall:.1f} |", flush=True)
        same = same and got[True] == got[False]
    print(f"replies equal with packing on and off: {same}")


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    if args.loop:
        loop_main(args)
        return
    torch.manual_seed(0)
    model = GPT(Config.from_name(args.preset)).eval()
    print(f"{args.preset} (random weights), float32, {torch.get_num_threads()} thread(s), h2o {args.cache_length}")
    print(f"distinct products: {len(matmul_layers(model.transformer.h))}")
    print("| decode rows | step rows | chunk | separate (ms) | packed (ms) | packed / separate | shared products |")
    print("|---|---|---|---|---|---|---|")
    for m in args.rows:
        for t in args.chunks:
            a, b, packs, step_rows = setting(model, m, t, args.cache_length, args.reps)
            shared = "decode + chunk" if any(len(p) > 1 for p in packs) else "none (two products per layer)"
            print(f"| {m} | {step_rows} | {t} | {a * 1e3:.0f} | {b * 1e3:.0f} | {b / a:.3f} | {shared} |", flush=True)
    print("\n| rows | linear layers, µs per row (all layers) |")
    print("|---|---|")
    for n, us in linear_costs(model, args.linear_rows, args.reps):
        print(f"| {n} | {us:.0f} |", flush=True)


if __name__ == "__main__":
    main()
