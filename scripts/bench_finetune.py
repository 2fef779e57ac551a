"""Peak memory and seconds per step of `chunked_loss_backward` against plain autograd through `forward_chunked`.

For T = 2L, 4L, 8L (L = cache_length), one training step (loss + backward, all parameters trainable) on a
randomly initialised small model with an H2O cache, measured in a fresh subprocess per configuration:

- CPU: peak resident memory of the step (``ru_maxrss`` after the steps minus the resident size before
  them); this includes the host tape of the gradient engine, which is also shown on its own;
- CUDA: ``torch.cuda.max_memory_allocated`` minus the memory allocated before the step.

Run: ``python scripts/bench_finetune.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import litkv
from litkv.gradient import chunked_loss_backward

METHODS = ("engine", "autograd")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-14m", help="LitGPT preset name (random weights)")
    parser.add_argument("--cache-length", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--multiples", type=int, nargs="+", default=[2, 4, 8], help="T / cache_length")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (`ru_maxrss` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tape_bytes(model: litkv.GPT, batch_size: int, seq_len: int, dtype: torch.dtype) -> int:
    """Host memory of the engine's tape: keys/values, float32 gradient accumulators, eviction log."""
    c = model.config
    per_token = c.n_query_groups * 2 * c.head_size * (torch.finfo(dtype).bits // 8 + 4) + c.n_query_groups * 2 * 4
    return c.n_layer * batch_size * (seq_len + 1) * per_token


def run_step(
    method: str, model: litkv.GPT, idx: torch.Tensor, targets: torch.Tensor, kv_cache: litkv.KVCacheConfig
) -> float:
    """One loss + backward; returns the loss."""
    if method == "engine":
        return chunked_loss_backward(model, idx, targets, kv_cache)
    logits = litkv.forward_chunked(model, idx, kv_cache)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
    loss.backward()
    return float(loss.detach())


def worker(args: argparse.Namespace) -> dict[str, float]:
    """Measure one (method, T) configuration in this process."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = litkv.GPT.from_name(args.model).to(device=device, dtype=dtype)
    vocab = model.config.vocab_size
    idx = torch.randint(0, vocab, (args.batch_size, args.seq_len), device=device)
    targets = torch.randint(0, vocab, (args.batch_size, args.seq_len), device=device)
    kv_cache = litkv.KVCacheConfig(policy="h2o", cache_length=args.cache_length, chunk_size=args.chunk_size)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = current_rss_bytes()
    peak_before = peak_rss_bytes()
    times = []
    for _ in range(args.steps + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        run_step(args.worker, model, idx, targets, kv_cache)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if cuda else peak_rss_bytes()
    timed = times[1:] or times
    return {
        "peak_mb": (peak - base) / 2**20,
        "seconds": sum(timed) / len(timed),
        "tape_mb": tape_bytes(model, args.batch_size, args.seq_len, dtype) / 2**20,
        # On CPU the delta is only meaningful if nothing before the step peaked higher.
        "stale_peak_mb": 0.0 if cuda else max(0, peak_before - base) / 2**20,
    }


def measure(args: argparse.Namespace, method: str, seq_len: int) -> dict[str, float]:
    """Run `worker` in a fresh subprocess (peak RSS is per process)."""
    command = [sys.executable, __file__, "--worker", method, "--seq-len", str(seq_len)]
    for name in ("model", "cache_length", "chunk_size", "batch_size", "steps", "device", "dtype", "threads"):
        value = getattr(args, name)
        if value is not None:
            command += ["--" + name.replace("_", "-"), str(value)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args)))
        return
    length = args.cache_length
    print(
        f"model={args.model} (random init, all parameters trainable) policy=h2o cache_length={length} "
        f"chunk_size={args.chunk_size} batch_size={args.batch_size} device={args.device} dtype={args.dtype} "
        f"threads={args.threads or torch.get_num_threads()} steps={args.steps} (+1 warm-up)"
    )
    memory = "peak RSS delta" if args.device == "cpu" else "peak CUDA memory delta"
    print(f"memory: {memory} of the step, MiB; engine tape = host keys/values/grad accumulators/eviction log")
    header = (
        f"{'T':>6} {'T/L':>4} | {'engine MiB':>10} {'(tape)':>7} {'s/step':>7} | {'autograd MiB':>12} {'s/step':>7} "
        f"| {'mem ratio':>9} {'time ratio':>10}"
    )
    print(header)
    print("-" * len(header))
    results = {}
    for multiple in args.multiples:
        seq_len = multiple * length
        eng, ref = (measure(args, method, seq_len) for method in METHODS)
        results[multiple] = (eng, ref)
        for name, r in (("engine", eng), ("autograd", ref)):
            if r["stale_peak_mb"] > 0.5 * max(r["peak_mb"], 1.0):
                print(f"warning: {name} T={seq_len}: peak before the step was already {r['stale_peak_mb']:.0f} MiB")
        print(
            f"{seq_len:>6} {multiple:>4} | {eng['peak_mb']:>10.1f} {eng['tape_mb']:>7.1f} {eng['seconds']:>7.2f} | "
            f"{ref['peak_mb']:>12.1f} {ref['seconds']:>7.2f} | {eng['peak_mb'] / ref['peak_mb']:>9.3f} "
            f"{eng['seconds'] / ref['seconds']:>10.2f}"
        )
    lo, hi = min(results), max(results)
    growth = results[hi][0]["peak_mb"] / results[lo][0]["peak_mb"]
    print(f"engine peak {hi}L / {lo}L: {growth:.3f} (target <= 1.3)")
    print(f"engine / autograd peak at {hi}L: {results[hi][0]['peak_mb'] / results[hi][1]['peak_mb']:.3f} (target < 1)")


if __name__ == "__main__":
    main()
