#!/usr/bin/env python
"""Where a decode step's time goes, per policy: `torch.profiler` over greedy decode steps of SmolLM2-135M's
shape (random weights, float32, the CPU), the top operators by self CPU time per step, and each policy's
operators against a reference policy's (what its step costs beyond the reference's, by operator).

For each policy in turn: a prompt of `--prompt` random tokens prefilled in chunks of `--chunk` into a cache of
`--cache_length` slots (dense: the whole sequence), `--warmup` untimed steps, then `--steps` steps under the
profiler. The step's time is the calling thread's CPU time (`time.thread_time`, median of `--rounds` runs of
`--steps` steps, unprofiled), so a loaded machine moves it less than wall time; the operators' times are the
profiler's self CPU times in the profiled run (slower than the unprofiled one), whose sum is less than that
run's step (Python and dispatch between operators belong to no operator: the `unattributed` line).

    OMP_NUM_THREADS=1 python scripts/profile_decode.py --policies last-recent,h2o,snapkv,expected-attention
    python scripts/profile_decode.py --policies last-recent,h2o --layers 2 --prompt 96 --cache_length 64   # quick
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from litkv import GPT, Config, KVCacheConfig
from litkv.gates.gate import EvictionGates
from litkv.inference.generate import decode_greedy
from litkv.kvcache.config import ChunkPlan
from litkv.modeling.runner import run_chunks
from litkv.modeling.weight_layout import columns_contiguous

Ops = dict[str, tuple[float, float]]  # operator -> (self CPU ms per step, calls per step)
Run = tuple[float, float, Ops]  # (median ms per step, the profiled run's ms per step, its operators)


def build_model(args: argparse.Namespace) -> GPT:
    """SmolLM2-135M's shape (or `--layers` of it) with random weights and random eviction gates (`learned`)."""
    overrides = {} if args.layers is None else {"n_layer": args.layers}
    config = Config.from_name("SmolLM2-135M", **overrides)
    torch.manual_seed(args.seed)
    model = GPT(config).eval()
    gen = torch.Generator().manual_seed(args.seed)
    weight = torch.randn(config.n_layer, config.n_query_groups, config.head_size, generator=gen)
    model.eviction_gates = EvictionGates(weight, torch.randn(weight.shape[:2], generator=gen), 32, 4)
    return columns_contiguous(model)


def cache_config(policy: str, args: argparse.Namespace) -> KVCacheConfig:
    """Dense holds the whole sequence; the others `--cache_length` slots (last-recent with 4 sinks, as
    `scripts/bench_policies.py`)."""
    chunk = min(args.chunk, args.cache_length)
    if policy == "dense":
        return KVCacheConfig("dense", cache_length=args.prompt + args.warmup + args.steps * (args.rounds + 1) + 1,
                             chunk_size=chunk)  # fmt: skip
    options = {"sinks": 4} if policy == "last-recent" else {}
    return KVCacheConfig(policy, cache_length=args.cache_length, chunk_size=chunk, options=options)


@contextmanager
def prefilled(model: GPT, policy: str, args: argparse.Namespace) -> Iterator[tuple[torch.Tensor, int]]:
    """The model with `policy`'s caches holding the prompt: yields (the last hidden state, the next position)."""
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(args.prompt)[None]
    cfg = cache_config(policy, args)
    with torch.inference_mode(), model.kv_caches_attached(cfg, 1):
        hidden = run_chunks(model, ids, pos, ChunkPlan.of(cfg), lm_head=False, last_only=True)
        yield hidden, args.prompt


def profile_policy(model: GPT, policy: str, args: argparse.Namespace) -> Run:
    """(median thread-CPU ms per step, the profiled run's, operators per step) of `policy`'s decode steps."""
    with prefilled(model, policy, args) as (hidden, start):
        at = torch.tensor([start])
        decode_greedy(model, hidden, at, args.warmup)
        at = at + args.warmup
        per_step = []
        for _ in range(args.rounds):
            t = time.thread_time()
            decode_greedy(model, hidden, at, args.steps + 1)  # the first of the steps is the given token's
            per_step.append(1000 * (time.thread_time() - t) / args.steps)
            at = at + args.steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t = time.thread_time()
            decode_greedy(model, hidden, at, args.steps + 1)
            profiled = 1000 * (time.thread_time() - t) / args.steps
    ops = {e.key: (e.self_cpu_time_total / 1000 / args.steps, e.count / args.steps) for e in prof.key_averages()}
    return statistics.median(per_step), profiled, ops


def top_table(policy: str, run: Run, n: int) -> str:
    """The `n` operators with the most self CPU time per step, and what no operator accounts for."""
    step_ms, profiled, ops = run
    rows = sorted(ops.items(), key=lambda kv: -kv[1][0])[:n]
    attributed = sum(ms for ms, _ in ops.values())
    lines = [f"### {policy}: {step_ms:.1f} ms per step (thread CPU, median; {profiled:.1f} profiled)", "",
             "| operator | ms per step | calls per step |", "|---|---:|---:|"]  # fmt: skip
    lines += [f"| `{name}` | {ms:.2f} | {calls:.0f} |" for name, (ms, calls) in rows]
    lines.append(f"| unattributed (Python, dispatch) | {max(profiled - attributed, 0.0):.2f} | |")
    return "\n".join(lines)


def diff_table(reference: str, ref: Run, policy: str, run: Run, n: int) -> str:
    """`policy`'s step against `reference`'s: the step and the `n` operators whose time differs most."""
    (ref_ms, _, ref_ops), (ms, _, ops) = ref, run
    names = sorted(set(ref_ops) | set(ops), key=lambda k: -abs(ops.get(k, (0, 0))[0] - ref_ops.get(k, (0, 0))[0]))
    lines = [f"### {policy} against {reference}: {ms:.1f} against {ref_ms:.1f} ms per step "
             f"({ref_ms / ms:.3f}x its speed)", "",
             f"| operator | {reference} ms | {policy} ms | difference | calls {reference} / {policy} |",
             "|---|---:|---:|---:|---|"]  # fmt: skip
    for name in names[:n]:
        (a, ca), (b, cb) = ref_ops.get(name, (0.0, 0.0)), ops.get(name, (0.0, 0.0))
        lines.append(f"| `{name}` | {a:.2f} | {b:.2f} | {b - a:+.2f} | {ca:.0f} / {cb:.0f} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default="last-recent,h2o,tova,knorm,keydiff,snapkv,expected-attention,learned")
    p.add_argument("--reference", default="last-recent", help="the policy the others are compared with")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--cache_length", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset's 30 (a quick run)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="operators per table")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    policies = args.policies.split(",")
    if args.reference not in policies:
        policies.insert(0, args.reference)
    runs = {policy: profile_policy(model, policy, args) for policy in policies}
    print(f"SmolLM2-135M shape ({model.config.n_layer} layers), random weights, float32, {args.threads} thread(s), "
          f"prompt {args.prompt}, {args.cache_length} slots (dense: all), {args.steps} profiled steps\n")  # fmt: skip
    for policy, run in runs.items():
        print(top_table(policy, run, args.top), end="\n\n")
    for policy, run in runs.items():
        if policy != args.reference:
            print(diff_table(args.reference, runs[args.reference], policy, run, args.top), end="\n\n")


if __name__ == "__main__":
    main()
