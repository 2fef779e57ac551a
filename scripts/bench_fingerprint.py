"""Cost of `model_fingerprint` (an integer digest of every parameter element, then sha256) for the shipped model.

Prints seconds per billion parameters and bytes/s, next to the memory bandwidth `litkv.eval.bandwidth` measures.
Usage: python scripts/bench_fingerprint.py [--checkpoint litkv/assets/default] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from litkv.checkpoints.checkpoint import load_model
from litkv.eval.bandwidth import measure_bandwidth
from litkv.modeling.fingerprint import _WEIGHT_HASHES, model_fingerprint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="litkv/assets/default")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = load_model(args.checkpoint)
    n = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    best = float("inf")
    for _ in range(args.repeats):
        _WEIGHT_HASHES.pop(model, None)  # force a full hash
        start = time.perf_counter()
        model_fingerprint(model)
        best = min(best, time.perf_counter() - start)
    start = time.perf_counter()
    model_fingerprint(model)
    memo = time.perf_counter() - start
    bw = measure_bandwidth(nbytes=2**28)
    dtype = next(model.parameters()).dtype
    print(f"params {n:,} ({nbytes / 1e6:.1f} MB, {dtype}), torch threads {torch.get_num_threads()}")
    print(
        f"full hash {best * 1e3:.1f} ms = {best / n * 1e9:.2f} s per billion parameters, {nbytes / best / 1e9:.2f} GB/s"
    )
    print(f"memoised call {memo * 1e6:.0f} us; measured memory bandwidth {bw / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
