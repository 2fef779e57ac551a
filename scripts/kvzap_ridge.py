#!/usr/bin/env python
"""Held-out error of the KVzap fit against the ridge strength, from two saved states of one fit (no model run).

`--train` is an earlier state of the fit (`scripts/fit_kvzap.py` copies nothing: copy `OUT/sums.safetensors`
aside after some windows), `--whole` a later one; the windows in `--whole` and not in `--train` are the
held-out set. For each ridge (relative to the mean diagonal of `X^T X`, as `litkv.finetune.lstsq.RIDGE`) it
prints the held-out mean squared error of log KVzip+ for the key gates and the hidden-state surrogate.

    python scripts/kvzap_ridge.py --train out/kvzap_eval1/sums.safetensors --whole out/kvzap_fit/sums.safetensors
"""

from __future__ import annotations

import argparse
from pathlib import Path

from litkv.finetune.kvzap_fit import KVzapSums


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--train", type=Path, required=True)
    p.add_argument("--whole", type=Path, required=True)
    p.add_argument("--ridges", type=float, nargs="+", default=[1e-6, 1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0])
    args = p.parse_args()
    train = KVzapSums.load(args.train)
    test = KVzapSums.load(args.whole).minus(train)
    print(f"train windows {train.windows}, held-out windows {test.windows}")
    print("| ridge | key: train MSE | key: held-out MSE | hidden: train MSE | hidden: held-out MSE |")
    print("|---:|---:|---:|---:|---:|")
    for ridge in args.ridges:
        key, hidden = train.keys.solve(ridge), train.solve_hidden(ridge)
        row = [train.keys.mse(*key), test.keys.mse(*key), train.hidden_mse(*hidden), test.hidden_mse(*hidden)]
        print(f"| {ridge:g} | " + " | ".join(f"{v:.4f}" for v in row) + " |")


if __name__ == "__main__":
    main()
