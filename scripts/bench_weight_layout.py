"""One-row products of a model's linear weights, row-major (as `nn.Linear` stores them) against column-major
(as `litkv.modeling.weight_layout.columns_contiguous` stores them for inference on the CPU), in one run.

For each distinct linear shape of the preset (random weights in `--dtype`, float32 by default, as many copies
as fill `--mbytes`, so that every call reads its weight from memory, as a decode step does), the layouts are
timed in turn over `--repeats` rounds; printed: the median time of one product in each layout, the speed ratio,
and for one row the weight bytes read per second against the machine's memory bandwidth measured in the same
run with the same threads (the physical limit of a weight-streaming product); in float32, also the C product a
decode step takes for a column-major weight (`litkv.modeling.row_linear`, `RowLinear`), timed in the same rounds,
where it applies (a multiple of 16 outputs). Then the same at `--rows` rows (a prefill chunk: compute-bound, the
BLAS packs the weight either way).

    python scripts/bench_weight_layout.py --model SmolLM2-135M --threads 1
    python scripts/bench_weight_layout.py --model SmolLM2-135M --threads 1 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from litgpt import Config

from litkv.eval.bandwidth import measure_bandwidth
from litkv.modeling import row_linear
from litkv.modeling.model import GPT

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M", help="a LitGPT preset name (its linear shapes)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7, help="alternated rounds per layout (median)")
    p.add_argument("--mbytes", type=int, default=256, help="weights streamed per timed round (MB)")
    p.add_argument("--rows", type=int, default=512, help="rows of the second table (a prefill chunk)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    return p.parse_args(argv)


def linear_shapes(name: str) -> list[tuple[int, int]]:
    """The distinct `(out, in)` shapes of the linear layers of preset `name` (built on the meta device)."""
    with torch.device("meta"):
        model = GPT(Config.from_name(name))
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sorted(shapes)  # type: ignore[arg-type]


def time_layouts(
    shape: tuple[int, int], rows: int, mbytes: int, repeats: int, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    """Median seconds of one `rows`-row product with a `shape` weight in `dtype`, read from memory: `row`
    (row-major), `col` (column-major) and, where the C product applies, `c` (column-major, `RowLinear`'s)."""
    out, inp = shape
    size = torch.finfo(dtype).bits // 8
    copies = max(1, mbytes * 2**20 // (out * inp * size))
    row_major = [torch.randn(out, inp, dtype=dtype) for _ in range(copies)]
    col_major = [w.t().contiguous().t() for w in row_major]
    x = torch.randn(rows, 1, inp, dtype=dtype)
    ways = {"row": (F.linear, row_major), "col": (F.linear, col_major)}
    if row_linear.applies(x, col_major[0]) and row_linear.library() is not None:
        ways["c"] = (lambda x, w: row_linear.row_linear(x, w, None), col_major)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    with torch.no_grad():
        for _ in range(repeats):
            for name, (product, weights) in ways.items():
                start = time.perf_counter()
                for w in weights:
                    product(x, w)
                seconds[name].append((time.perf_counter() - start) / copies)
    return {name: statistics.median(times) for name, times in seconds.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    bandwidth = measure_bandwidth(threads=args.threads) / 1e9
    dtype = DTYPES[args.dtype]
    print(
        f"memory bandwidth: {bandwidth:.1f} GB/s ({args.threads} threads); {args.model}'s linear shapes, {args.dtype}"
    )
    for rows in (1, args.rows):
        print(
            "\n| rows | weight (out, in) | row-major us | column-major us | column/row speed | column-major GB/s "
            "| C product us | C/column speed | C product GB/s |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for shape in linear_shapes(args.model):
            times = time_layouts(shape, rows, args.mbytes, args.repeats, dtype)
            row, col, c = times["row"], times["col"], times.get("c")
            print(f"| {rows} | {shape} | {row * 1e6:.1f} | {col * 1e6:.1f} | {row / col:.2f}x "
                  f"| {_read(shape, dtype, col, bandwidth) if rows == 1 else '-'} "
                  f"| {'-' if c is None else f'{c * 1e6:.1f}'} | {'-' if c is None else f'{col / c:.2f}x'} "
                  f"| {'-' if c is None else _read(shape, dtype, c, bandwidth)} |")  # fmt: skip


def _read(shape: tuple[int, int], dtype: torch.dtype, seconds: float, bandwidth: float) -> str:
    """The weight's bytes per second of one product taking `seconds`, and its share of `bandwidth` (GB/s)."""
    gbps = shape[0] * shape[1] * torch.finfo(dtype).bits / 8 / seconds / 1e9
    return f"{gbps:.1f} ({gbps / bandwidth:.0%})"


if __name__ == "__main__":
    main()
