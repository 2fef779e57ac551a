"""Decode speed of the KV cache policies against the memory-bandwidth bound, SmolLM2-135M architecture.

Random weights (LM head tied to the embedding, as in SmolLM2), float32 on CPU. For each
configuration (batch x prompt length) every policy runs `litkv.generate` on the same prompts (greedy)
with streamed steps timed: prefill is the time to the first token; decode tokens/s is `batch x steps`
over the steps' time. The policies' generations run interleaved, one decode step of each in turn (each
in its own thread on its own copy of the model sharing the weights, handing over at every streamed
token), so that all of them see the same load on a shared machine; a step's time runs from its
policy's turn to its token.

Bytes a decode step reads: the weights once, plus every row's cached keys and values (`cache_length`
slots for an evicting policy, counted from the cache's own `nbytes()` so that int4 scales and offsets
count; the tokens cached halfway through the decode for dense). The machine's memory bandwidth is
measured in the same run with the same thread count (`litkv.bandwidth.measure_bandwidth`: best of
five sums of a 1 GiB tensor, before and after each configuration; the better of the two counts), so
that each row shows:

- `vs dense`: decode tokens/s over dense's; `byte bound`: dense's bytes per step over the policy's
  (the speed-up that reading fewer bytes allows); `of bound`: the first over the second;
- `bound tok/s` = bandwidth / bytes per step (x batch) and `of bw`: decode tokens/s over it.

    nice python scripts/bench_policies.py                      # 1x4096, 4x4096, 1x16384, every policy
    nice python scripts/bench_policies.py --configs 1x4096     # one configuration
    python scripts/bench_policies.py --quick                   # a smoke test (well under a minute)
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from litkv import GPT, Config, KVCacheConfig, generate
from litkv.bandwidth import bound_tokens_per_s, bytes_per_step, measure_bandwidth, weight_bytes
from litkv.learned import EvictionGates

POLICIES = (
    "dense", "last-recent", "h2o", "qh2o", "tova", "knorm", "keydiff", "snapkv", "expected-attention", "learned"
)  # fmt: skip
EXTRA_POLICIES = ("h2o-int4",)  # h2o with int4 storage (qh2o also weighs the quantisation error)
# name: (batch, prompt length, new tokens)
CONFIGS = {"1x4096": (1, 4096, 128), "4x4096": (4, 4096, 64), "1x16384": (1, 16384, 32)}
QUICK_CONFIGS = {"1x256": (1, 256, 8), "2x256": (2, 256, 8)}


@dataclass
class PolicyRun:
    """One policy's measurement in one configuration."""

    policy: str
    batch: int
    prompt: int
    new_tokens: int
    prefill_s: float
    decode_tok_s: float
    cache_bytes: int  # keys and values held by the caches (all layers, all rows; scales included)
    step_bytes: float  # bytes one decode step reads
    bound_tok_s: float  # bandwidth / step_bytes x batch


def policy_config(name: str, args: argparse.Namespace, prompt: int, new: int, head_size: int) -> KVCacheConfig:
    """The cache of policy `name`: dense holds the whole sequence (one prefill chunk), the others
    `cache_length` slots (prefill in chunks of `chunk_size`)."""
    chunk = min(args.chunk_size, args.cache_length)
    group = min(args.quant_group_size, head_size)
    if name == "dense":
        return KVCacheConfig("dense", cache_length=prompt + new, chunk_size=chunk, prefill_length=prompt)
    if name == "last-recent":
        return KVCacheConfig(name, cache_length=args.cache_length, chunk_size=chunk, options=dict(sinks=4))
    if name in ("qh2o", "h2o-int4"):
        policy = "h2o" if name == "h2o-int4" else name
        return KVCacheConfig(
            policy, cache_length=args.cache_length, chunk_size=chunk, storage="int4", quant_group_size=group
        )
    return KVCacheConfig(name, cache_length=args.cache_length, chunk_size=chunk)


def cached_tokens(config: KVCacheConfig, prompt: int, new: int) -> float:
    """Tokens a row's step attends to, halfway through the decode."""
    return float(min(config.cache_length, prompt + new / 2))


class Turns:
    """Round-robin turns between the threads of `n` generations: one runs while the others wait."""

    def __init__(self, n: int) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.active = set(range(n))
        self.n = n

    def wait(self, i: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == i)

    def hand_over(self, i: int, finished: bool = False) -> None:
        """Give the turn to the next active generation after `i` (`finished`: `i` leaves the round)."""
        with self.cond:
            if finished:
                self.active.discard(i)
            following = [(i + k) % self.n for k in range(1, self.n + 1)]
            self.turn = next((j for j in following if j in self.active), -1)
            self.cond.notify_all()


@dataclass
class Timing:
    """One generation's prefill seconds and decode step seconds (each from its turn to its token)."""

    prefill_s: float = 0.0
    steps: list[float] = field(default_factory=list)


Runner = Callable[[Callable[[torch.Tensor], None]], object]


def _worker(i: int, turns: Turns, run: Runner, out: list[Timing | BaseException | None]) -> None:
    """Thread body: run generation `i` in its turns, timing the prefill and each step's own time."""
    timing = Timing()
    clock = {"start": 0.0, "resumed": 0.0}

    def on_tokens(tokens: torch.Tensor) -> None:
        now = time.perf_counter()
        if clock["resumed"] == 0.0:
            timing.prefill_s = now - clock["start"]
        else:
            timing.steps.append(now - clock["resumed"])
        turns.hand_over(i)
        turns.wait(i)
        clock["resumed"] = time.perf_counter()

    try:
        turns.wait(i)
        clock["start"] = time.perf_counter()
        run(on_tokens)
        out[i] = timing
    except BaseException as exc:  # re-raised by `interleaved`
        out[i] = exc
    finally:
        turns.hand_over(i, finished=True)


def interleaved(runs: list[Runner]) -> list[Timing]:
    """Run generations one streamed step each in turn; `runs[i](on_tokens)` runs generation `i`."""
    turns = Turns(len(runs))
    out: list[Timing | BaseException | None] = [None] * len(runs)
    threads = [threading.Thread(target=_worker, args=(i, turns, run, out)) for i, run in enumerate(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in out:
        if isinstance(result, BaseException):
            raise result
    return out  # type: ignore[return-value]


def policy_model(model: GPT) -> GPT:
    """A copy of `model` with its own modules and state, sharing the weights (one per policy thread)."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def step_bytes_of(model: GPT, config: KVCacheConfig, batch: int, prompt: int, new: int) -> tuple[int, float]:
    """(bytes the caches hold, bytes a decode step reads) for policy `config` on `batch` rows."""
    with torch.inference_mode():
        cache_bytes = sum(c.nbytes() for c in model.build_kv_caches(config, batch))
    per_slot = cache_bytes / (batch * config.cache_length)
    return cache_bytes, bytes_per_step(weight_bytes(model), per_slot, cached_tokens(config, prompt, new), batch)


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}x" if den > 0 else "-"


def table_rows(runs: list[PolicyRun]) -> list[list[str]]:
    """Rows of one configuration's table; ratios against dense and last-recent of the same configuration."""
    by_name = {r.policy: r for r in runs}
    dense, recent = by_name.get("dense"), by_name.get("last-recent")
    rows = []
    for r in runs:
        speed = r.decode_tok_s / dense.decode_tok_s if dense else 0.0
        byte_bound = dense.step_bytes / r.step_bytes if dense else 0.0
        rows.append(
            [
                r.policy,
                f"{r.prefill_s:.1f}",
                f"{r.decode_tok_s:.2f}",
                f"{speed:.2f}x" if dense else "-",
                f"{byte_bound:.2f}x" if dense else "-",
                f"{speed / byte_bound:.0%}" if dense else "-",
                _ratio(r.decode_tok_s, recent.decode_tok_s) if recent else "-",
                f"{r.step_bytes / 1e6:.0f}",
                f"{r.bound_tok_s:.1f}",
                f"{r.decode_tok_s / r.bound_tok_s:.0%}",
                f"{r.cache_bytes / 2**20:.2f}",
            ]
        )
    return rows


HEADER = [
    "policy",
    "prefill s",
    "decode tok/s",
    "vs dense",
    "byte bound",
    "of bound",
    "vs last-recent",
    "MB/step",
    "bound tok/s",
    "of bw",
    "cache MiB",
]


def format_table(runs: list[PolicyRun]) -> str:
    """Markdown table of one configuration (see the module docstring for the columns)."""
    rows = table_rows(runs)
    widths = [max(len(row[i]) for row in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(HEADER, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(runs: list[PolicyRun]) -> list[str]:
    """The issue's target ratios of one configuration (h2o vs last-recent, int4 vs float h2o)."""
    by_name = {r.policy: r for r in runs}
    out = []
    pairs = [("h2o", "last-recent", 0.95), ("qh2o", "h2o", 0.9), ("h2o-int4", "h2o", 0.9)]
    for a, b, target in pairs:
        if a in by_name and b in by_name:
            ratio = by_name[a].decode_tok_s / by_name[b].decode_tok_s
            verdict = "met" if ratio >= target else "NOT met"
            out.append(f"{a} / {b} decode: {ratio:.2f}x (target >= {target}x: {verdict})")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M", help="LitGPT config name (random weights)")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated BATCHxPROMPT among {list(CONFIGS)} or any other BxT (default: all three)",
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="override every configuration's new tokens")
    parser.add_argument("--cache-length", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256, help="prefill chunk size of the evicting policies")
    parser.add_argument("--quant-group-size", type=int, default=64, help="int4 group size (<= head size)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"among {list(POLICIES + EXTRA_POLICIES)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (and for the bandwidth measurement)")
    parser.add_argument("--compile", action="store_true", help="generate(..., compile=True), one warm-up call each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None, help="also write the runs as JSON here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 1x256 and 2x256, 8 new tokens, 64 slots, chunks 32, pythia-14m unless --model is given",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.cache_length, args.chunk_size = 64, 32
        if args.model == parser.get_default("model"):
            args.model = "pythia-14m"
        if args.configs == parser.get_default("configs"):
            args.configs = ",".join(QUICK_CONFIGS)
    return args


def resolve(args: argparse.Namespace) -> tuple[dict[str, tuple[int, int, int]], list[str]]:
    """The configurations `{name: (batch, prompt, new tokens)}` and policies asked for; ValueError naming
    a bad one."""
    configs = {}
    for name in args.configs.split(","):
        known = {**CONFIGS, **QUICK_CONFIGS}
        if name in known:
            b, t, new = known[name]
        else:
            b_str, _, t_str = name.partition("x")
            if not (b_str.isdigit() and t_str.isdigit() and int(b_str) > 0 and int(t_str) > 0):
                raise ValueError(f"--configs entries must be BATCHxPROMPT like 1x4096, got {name!r}")
            b, t, new = int(b_str), int(t_str), 64
        configs[name] = (b, t, args.new_tokens if args.new_tokens is not None else new)
        if configs[name][2] < 2:
            raise ValueError(f"--new-tokens must be >= 2 (a decode speed needs two steps), got {configs[name][2]}")
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES + EXTRA_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {list(POLICIES + EXTRA_POLICIES)}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.compile and "compile" not in inspect.signature(generate).parameters:
        raise ValueError("--compile: litkv.generate has no compile option in this version")
    return configs, policies


def build_model(name: str, seed: int) -> GPT:
    """Random weights, LM head tied to the embedding (SmolLM2 ties them; where the shapes differ, untied)."""
    torch.manual_seed(seed)
    model = GPT(Config.from_name(name)).eval()
    if model.lm_head.weight.shape == model.transformer.wte.weight.shape:
        model.lm_head.weight = model.transformer.wte.weight
    c = model.config  # random eviction gates for `learned` (its speed does not depend on what they learned)
    gates = EvictionGates.create(c.n_layer, c.n_query_groups, c.head_size, window=16, sinks=4)
    gates.weight.normal_()
    model.eviction_gates = gates
    return model


def run_config(
    model: GPT, spec: tuple[int, int, int], policies: list[str], args: argparse.Namespace
) -> list[PolicyRun]:
    """Every policy on the same prompts of configuration `spec` = (batch, prompt, new tokens), interleaved
    (`bound_tok_s` left 0: `with_bound` sets it)."""
    b, t, new = spec
    prompts = torch.randint(0, model.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(args.seed))
    configs = [policy_config(p, args, t, new, model.config.head_size) for p in policies]
    models = [policy_model(model) for _ in policies]
    options = {"compile": True} if args.compile else {}
    if args.compile:  # one untimed warm-up call per policy with the timed call's shapes (compiles)
        for m, config in zip(models, configs, strict=True):
            generate(m, list(prompts), min(new, 4), config, **options)

    def runner(m: GPT, config: KVCacheConfig) -> Runner:
        return lambda on_tokens: generate(m, list(prompts), new, config, on_tokens=on_tokens, **options)

    timings = interleaved([runner(m, c) for m, c in zip(models, configs, strict=True)])
    runs = []
    for policy, config, timing in zip(policies, configs, timings, strict=True):
        if not timing.steps:
            raise RuntimeError(f"{policy} generated {len(timing.steps) + 1} tokens; a decode speed needs 2 or more")
        cache_bytes, step = step_bytes_of(model, config, b, t, new)
        tok_s = b * len(timing.steps) / sum(timing.steps)
        runs.append(PolicyRun(policy, b, t, new, timing.prefill_s, tok_s, cache_bytes, step, 0.0))
    return runs


def with_bound(runs: list[PolicyRun], bandwidth: float) -> list[PolicyRun]:
    """Set each run's bound tokens/s from the measured `bandwidth` (bytes/s)."""
    for r in runs:
        r.bound_tok_s = bound_tokens_per_s(bandwidth, r.step_bytes, r.batch)
    return runs


def main(argv: list[str] | None = None) -> dict[str, list[PolicyRun]]:
    args = parse_args(argv)
    configs, policies = resolve(args)
    torch.set_num_threads(args.threads)
    model = build_model(args.model, args.seed)
    gib = 2**28 if args.quick else 2**30
    bandwidth = measure_bandwidth(gib, threads=args.threads)
    bandwidths = {}
    print(
        f"{args.model} (random weights, tied LM head, float32, {model.lm_head.weight.device.type}, {args.threads} "
        f"threads{', compiled' if args.compile else ''}): cache_length {args.cache_length} (dense: the whole "
        f"sequence, one prefill chunk), prefill chunks of {min(args.chunk_size, args.cache_length)}; "
        f"weights {weight_bytes(model) / 1e6:.0f} MB; memory bandwidth before the runs {bandwidth / 1e9:.1f} GB/s "
        f"(sum of {gib // 2**20} MiB, best of 5)"
    )
    results = {}
    for name, spec in configs.items():
        print(f"{name}: {len(policies)} policies, interleaved ...", file=sys.stderr, flush=True)
        runs = run_config(model, spec, policies, args)
        after = measure_bandwidth(gib, threads=args.threads)
        bandwidths[name] = max(bandwidth, after)  # best of the measurements before and after the config
        results[name] = with_bound(runs, bandwidths[name])
        bandwidth = after
        b, t, new = spec
        print(
            f"\nbatch {b} x {t} tokens, {new} new tokens; memory bandwidth {bandwidths[name] / 1e9:.1f} GB/s "
            "(best of the measurements before and after):\n"
        )
        print(format_table(results[name]))
        for line in summary(results[name]):
            print(line)
        sys.stdout.flush()
    if args.json_out is not None:
        out = {"bandwidth": bandwidths, "configs": {k: [asdict(r) for r in v] for k, v in results.items()}}
        args.json_out.write_text(json.dumps(out, indent=2))
    return results


if __name__ == "__main__":
    main()
