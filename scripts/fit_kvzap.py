#!/usr/bin/env python
"""The full KVzap fit for SmolLM2-135M-Instruct, resumable window by window (`litkv.finetune.kvzap_fit`).

1. **fit**: for each window `0 .. --windows - 1` not yet in `OUT/sums.safetensors`: a retrieval window of
   `--length` tokens (`litkv.finetune.retrieval_data`, from the KJV training chapters, the held-out
   chapters' lines taken out), its log KVzip+ scores, keys and hidden states (`kvzip_records`), added to
   the sums of both inputs; the sums are saved after every window (stop at any time, run again to go on).
   `--stop_after N` stops after N new windows (a session's share).
2. **calibrate** (once every window is in): `--calib_windows` other windows (indices from 100,000), the
   per-head affine map of the key gates' logits onto the target (`affine_calibration`).
3. **eval**: `--eval_windows` windows of `heldout.txt` (never trained on): mean squared error and Spearman
   (per head, pooled over all layers) of the key gates raw and calibrated and of the hidden-state
   surrogate; written to `OUT/report.json` and printed.
4. Writes `OUT/ckpt_raw/`, `OUT/ckpt_cal/` and `OUT/ckpt_hidden/` (the hidden-state input, `input="hidden"`):
   checkpoint directories (the model's files linked, the gates with the weights' fingerprint) that
   `litkv generate --kv-cache learned OUT/ckpt_cal` and `scripts/ruler_slice.py OUT/ckpt_cal` load.

    OMP_NUM_THREADS=1 nice -n 10 python scripts/fit_kvzap.py --out_dir out/kvzap_fit --windows 32
    # the Spearman of the gates so far (and of other gates files beside them), no window added:
    OMP_NUM_THREADS=1 nice -n 10 python scripts/fit_kvzap.py --out_dir out/kvzap_fit --eval_only --partial \
        --calib_windows 1 --eval_windows 1 --eval_length 1024 \
        --compare litkv/assets/gates/smollm2-135m-instruct.safetensors
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from litkv.checkpoints.checkpoint import default_checkpoint_dir, load_model, load_tokenizer, save_gates
from litkv.cli.common import resolve_checkpoint_dir
from litkv.core.tokens import encode_plain
from litkv.finetune.gate_training import evictable
from litkv.finetune.kvzap_fit import KVzapSums, affine_calibration, calibrated, hidden_logits, scale_report
from litkv.finetune.kvzip_target import kvzip_records
from litkv.finetune.retrieval_data import check_source, retrieval_window
from litkv.gates.gate import GATES_FILE, EvictionGates
from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.modeling.fingerprint import model_fingerprint

NAME = "smollm2-135m-instruct"
CALIB_START = 100_000


def records(model, ids: list[int], repeat: RepeatPrompt, window: int, sinks: int):
    """Per layer `(keys_pre (1, G, N, D), hidden (1, N, C), log score (1, G, N))` of the evictable tokens."""
    x = torch.tensor([ids], dtype=torch.long)
    hidden: list[torch.Tensor] = []
    recs = kvzip_records(model, x, repeat, hidden=hidden)
    mask = evictable(x.shape[1], window, sinks, x.device)
    return [(k[:, :, mask], h[:, mask], y[:, :, mask]) for (k, y), h in zip(recs, hidden, strict=True)]


def fit(args, model, lines, tok, repeat, state: Path) -> KVzapSums:
    c = model.config
    sums = KVzapSums.load(state) if state.is_file() else KVzapSums(c.n_layer, c.n_query_groups, c.head_size, c.n_embd)
    todo = [i for i in range(args.windows) if i not in sums.windows][: args.stop_after or None]
    for i in todo:
        start, cpu = time.perf_counter(), time.process_time()
        for layer, (k, h, y) in enumerate(records(model, retrieval_window(lines, tok, args.length, args.seed, i),
                                                   repeat, args.window, args.sinks)):  # fmt: skip
            sums.add(layer, k, h, y)
        sums.windows.append(i)
        sums.save(state)
        mse = sums.keys.mse(*sums.keys.solve())
        print(f"window {i}: {time.perf_counter() - start:.0f} s wall, {time.process_time() - cpu:.0f} s CPU; "
              f"{len(sums.windows)}/{args.windows} in; in-sample MSE (key) {mse:.4f}", flush=True)  # fmt: skip
    return sums


def logits_targets(model, windows, repeat, gates: dict[str, EvictionGates], hidden_gates, args):
    """`(L, G, N)` logits of each of `gates` (by name) and of the hidden surrogate (`"hidden"`), and the
    targets, over `windows` (token lists)."""
    z: dict[str, list[torch.Tensor]] = {name: [] for name in [*gates, "hidden"]}
    y = []
    for ids in windows:
        recs = records(model, ids, repeat, args.window, args.sinks)
        for name, g in gates.items():
            z[name].append(torch.stack([g.logits(layer, k.double())[0] for layer, (k, _, _) in enumerate(recs)]))
        z["hidden"].append(torch.stack([hidden_logits(*hidden_gates, i, h)[0] for i, (_, h, _) in enumerate(recs)]))
        y.append(torch.stack([t[0] for _, _, t in recs]))
    return {name: torch.cat(parts, -1).double() for name, parts in z.items()}, torch.cat(y, -1).double()


def write_checkpoint(base: Path, gates: EvictionGates, out: Path) -> None:
    """A checkpoint directory: the base's files linked, `gates` as its eviction gates."""
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.name != GATES_FILE and not (out / f.name).exists():
            os.symlink(f.resolve(), out / f.name)
    save_gates(gates, out / GATES_FILE)


def training_lines(out_dir: Path) -> list[str]:
    """The generator's source: the KJV training chapters (`OUT/kjv_train.txt`), the held-out lines taken out."""
    import adapt_to_budget  # scripts/ is on sys.path when a script here runs

    heldout = (default_checkpoint_dir() / "heldout.txt").read_text(encoding="utf-8")
    text = adapt_to_budget.write_training_text(out_dir / "kjv_train.txt", default_checkpoint_dir())
    return check_source(text.read_text(encoding="utf-8"), heldout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out_dir", type=Path, default=Path("out/kvzap_fit"))
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=32, help="the gates' recent window (not fitted on)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--stop_after", type=int, default=0, help="stop after this many new windows (0: all)")
    p.add_argument("--calib_windows", type=int, default=2)
    p.add_argument("--eval_windows", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--partial", action="store_true", help="calibrate and evaluate with the windows in so far")
    p.add_argument("--compare", type=Path, nargs="*", default=[], help="other gates files to evaluate beside")
    p.add_argument("--eval_only", action="store_true", help="add no window: calibrate and evaluate (with --partial)")
    p.add_argument("--eval_length", type=int, default=0, help="tokens of a calibration/held-out window (0: --length)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    ckpt = resolve_checkpoint_dir(NAME)
    model = load_model(ckpt)
    model.eviction_gates = None
    weights_id = model_fingerprint(model)["weights"]
    tok = load_tokenizer(ckpt)
    repeat = RepeatPrompt.build(tok, None)  # plain text, as the windows are
    lines = training_lines(args.out_dir)
    heldout = (default_checkpoint_dir() / "heldout.txt").read_text(encoding="utf-8")  # the evaluation's text
    state = args.out_dir / "sums.safetensors"
    sums = KVzapSums.load(state) if args.eval_only else fit(args, model, lines, tok, repeat, state)
    if len(sums.windows) < args.windows and not args.partial:
        print(f"stopped with {len(sums.windows)} of {args.windows} windows in; run again to go on")
        return
    gates = sums.gates(args.window, args.sinks)
    gates.weights = weights_id
    hidden_gates = sums.solve_hidden()
    n = args.eval_length or args.length
    calib = [retrieval_window(lines, tok, n, args.seed, CALIB_START + j) for j in range(args.calib_windows)]
    start = time.perf_counter()
    z, y = logits_targets(model, calib, repeat, {"key": gates}, hidden_gates, args)
    a, c = affine_calibration(z["key"], y)
    cal = calibrated(gates, a, c)
    print(f"calibration: {time.perf_counter() - start:.0f} s; slope a: min {a.min():.3f} median {a.median():.3f} "
          f"max {a.max():.3f}", flush=True)  # fmt: skip
    ids = encode_plain(tok, heldout)
    held = [ids[j * n : (j + 1) * n] for j in range(args.eval_windows)]
    others = {f"compare:{path}": EvictionGates.load(path) for path in args.compare}
    z, y = logits_targets(model, held, repeat, {"key": gates, "key_calibrated": cal, **others}, hidden_gates, args)
    report = {
        "windows": len(sums.windows), "length": args.length, "eval_length": n, "tokens_per_head": int(y.shape[-1]),
        **{name: scale_report(logits, y) for name, logits in z.items()},
        "in_sample_mse_key": sums.keys.mse(*sums.keys.solve()),
    }  # fmt: skip
    (args.out_dir / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    write_checkpoint(ckpt, gates, args.out_dir / "ckpt_raw")
    write_checkpoint(ckpt, cal, args.out_dir / "ckpt_cal")
    hidden = sums.hidden_gates(args.window, args.sinks)
    hidden.weights = weights_id
    write_checkpoint(ckpt, hidden, args.out_dir / "ckpt_hidden")


if __name__ == "__main__":
    main()
