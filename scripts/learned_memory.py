"""Peak memory of one gate-training step on the real model: the chunked gradient engine against the
whole-sequence pass, at several sequence lengths.

Each (engine, length) runs in a fresh process: load the model (float32), build one batch of random
token ids, reset the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`, Linux), run one
`distill` step (forward, backward, Adam step) and read the peak (`VmHWM` in `/proc/self/status`). The
figure is that peak, in MiB, for the whole process (weights, libraries, host tapes, the step's
graph), and `step`: the peak minus the resident memory just before the step. CPU only.

    nice python scripts/learned_memory.py --threads 1 --lengths 1024 2048 4096 8192 --whole 1024 2048
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODEL = "smollm2-135m-instruct"


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class _Stop(Exception):
    """Raised to end a step after its first backward chunks (`--backward_chunks`)."""


def _stop_after(count: int) -> None:
    """End the chunked engine's backward after `count` chunks. The chunks run last to first, and the
    first of them holds the longest teacher context: the step's peak is reached there (the tapes are
    allocated whole during the recording)."""
    import litkv.gradient.distill as distill

    real, done = distill._chunk, []

    def chunk(*args: object) -> float:
        if len(done) == count:
            raise _Stop
        done.append(1)
        return real(*args)

    distill._chunk = chunk


def one(engine: str, length: int, cache_length: int, chunk: int, threads: int, backward_chunks: int) -> dict:
    """One training step in this process; its peak memory and time."""
    import torch

    from litkv.checkpoints.checkpoint import load_model
    from litkv.cli.common import resolve_checkpoint_dir
    from litkv.finetune.gate_training import GateTrainArgs, _step_loss
    from litkv.gates.gate import EvictionGates
    from litkv.kvcache.config import KVCacheConfig

    torch.set_num_threads(threads)
    model = load_model(resolve_checkpoint_dir(MODEL))
    model.eviction_gates = None
    model.requires_grad_(False)
    c = model.config
    args = GateTrainArgs(steps=10, batch_size=1, engine=engine, target_keep=0.125, ramp=0.0)
    gates = EvictionGates.create(c.n_layer, c.n_query_groups, c.head_size, args.window, args.sinks, args.init_bias)
    for tensor in gates.parameters():
        tensor.requires_grad_(True)
    optimizer = torch.optim.Adam(gates.parameters(), lr=args.lr)
    ids = torch.randint(0, c.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    kv = KVCacheConfig(policy="learned", cache_length=min(cache_length, length), chunk_size=chunk)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_mib("VmRSS")
    start = time.perf_counter()
    if engine == "chunked" and backward_chunks:
        _stop_after(backward_chunks)
    try:
        loss, kl, keep = _step_loss(model, gates, ids, ids.clone(), args, 0, kv)
        optimizer.step()
    except _Stop:
        loss = keep = float("nan")
    seconds = time.perf_counter() - start
    peak = _status_mib("VmHWM")
    partial = backward_chunks if engine == "chunked" and backward_chunks else "all"
    return {"engine": engine, "length": length, "cache_length": kv.cache_length, "chunk": chunk,
            "backward_chunks": partial, "peak_mib": round(peak), "step_mib": round(peak - before),
            "seconds": round(seconds, 1), "loss": loss, "keep": keep}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--whole", type=int, nargs="*", default=[1024, 2048], help="lengths for the whole-sequence pass")
    p.add_argument("--cache_length", type=int, default=512, help="slots of the learned caches (chunked engine)")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backward_chunks", type=int, default=0, help="stop the backward after this many chunks (0: all)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per step before giving up on it")
    p.add_argument("--out", type=Path, default=Path("out/learned_memory.json"))
    p.add_argument("--one", nargs=2, metavar=("ENGINE", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        row = one(args.one[0], int(args.one[1]), args.cache_length, args.chunk, args.threads, args.backward_chunks)
        print(json.dumps(row))
        return
    runs = [("chunked", n) for n in args.lengths] + [("whole", n) for n in args.whole]
    rows = []
    for engine, length in runs:
        cmd = [sys.executable, __file__, "--one", engine, str(length), "--cache_length", str(args.cache_length),
               "--chunk", str(args.chunk), "--threads", str(args.threads), "--backward_chunks",
               str(args.backward_chunks)]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=True)
        except subprocess.TimeoutExpired:
            print(f"{engine} {length}: over {args.timeout} s, stopped")
            continue
        except subprocess.CalledProcessError as err:
            print(f"{engine} {length}: failed: {err.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    by = {(r["engine"], r["length"]): r for r in rows}
    print("| engine | tokens | backward chunks | peak MiB | step MiB | x previous length (peak) | seconds |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        prev = by.get((r["engine"], r["length"] // 2))
        ratio = f"{r['peak_mib'] / prev['peak_mib']:.2f}x" if prev else "-"
        cells = [r["engine"], r["length"], r["backward_chunks"], r["peak_mib"], r["step_mib"], ratio, r["seconds"]]
        print("| " + " | ".join(str(x) for x in cells) + " |")


if __name__ == "__main__":
    main()
