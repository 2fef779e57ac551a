"""A step of `litkv serve`'s batch that feeds a prompt chunk and decodes the other rows: separate calls (the
chunk at batch one, then the decode step) against one packed call (`RowBatch.packed_step`), on
SmolLM2-135M's shapes; and the linear layers' cost per row at several row counts.

Run on one torch thread (`--threads`), alternating the two ways, medians of `--reps`. Random weights of the
preset's shapes (the arithmetic is that of the real checkpoint's; the tokens do not matter). Prints each
step's time both ways and their ratio, the products the packed call shared, and a table of the linear
layers' microseconds per row.

    nice python scripts/bench_packed.py --rows 2 8 16 --chunks 64 256 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

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


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
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
