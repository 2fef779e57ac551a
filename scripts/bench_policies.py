"""Decode speed and cache memory of the KV cache policies on the SmolLM2-135M architecture.

Random weights, float32 on CPU by default. Each policy prefills the same long prompt in chunks
(`KVCacheConfig.chunk_bounds`), then decodes greedily. The policies' prefill chunks and decode steps
are interleaved (one chunk or step of each policy in turn; decode in a rotating order), so that all of
them see the same load on a shared machine. Prefill time is the sum of a policy's chunk times; decode
tokens/s is `batch_size / median step time`. Cache bytes are what
the layers' keys and values hold (`KVCache.nbytes()`: scales and offsets included for quantised
storage). Ratios are against dense and h2o measured in the same run.

    nice python scripts/bench_policies.py            # 4,096-token prompt, 128 new tokens, 512 slots
    python scripts/bench_policies.py --quick         # a short run to check that everything works
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from litkv import GPT, Config, KVCacheConfig
from litkv.kvcache.base import KVCache


@dataclass
class Run:
    """One policy's caches and decode state."""

    config: KVCacheConfig
    caches: list[KVCache]
    tokens: torch.Tensor  # (B,) next input tokens
    pos: int
    prefill_s: float
    cache_bytes: int
    step_s: list[float] = field(default_factory=list)


def policy_configs(args: argparse.Namespace, head_size: int) -> dict[str, KVCacheConfig]:
    """The compared caches: dense holds the whole sequence; the others hold `cache_length` slots."""
    chunk = min(args.chunk_size, args.cache_length)
    full = args.prompt_length + args.new_tokens
    group = min(args.quant_group_size, head_size)
    return {
        "dense": KVCacheConfig("dense", cache_length=full, chunk_size=chunk, prefill_length=args.prompt_length),
        "last-recent": KVCacheConfig(
            "last-recent", cache_length=args.cache_length, chunk_size=chunk, options=dict(sinks=4)
        ),
        "h2o": KVCacheConfig("h2o", cache_length=args.cache_length, chunk_size=chunk),
        "qh2o": KVCacheConfig(
            "qh2o", cache_length=args.cache_length, chunk_size=chunk, storage="int4", quant_group_size=group
        ),
    }


@torch.inference_mode()
def prefill_all(model: GPT, idx: torch.Tensor, configs: dict[str, KVCacheConfig]) -> dict[str, Run]:
    """Run the prompt through fresh caches of every policy, chunk by chunk, one chunk of each policy in
    turn (so that all see the same load); returns the runs with their summed chunk times."""
    b, t = idx.shape
    pos = torch.arange(t).expand(b, t)
    caches = {name: model.build_kv_caches(config, b) for name, config in configs.items()}
    chunks = {name: config.chunk_bounds(t) for name, config in configs.items()}
    elapsed = dict.fromkeys(configs, 0.0)
    tokens: dict[str, torch.Tensor] = {}
    for i in range(max(len(c) for c in chunks.values())):
        for name in configs:
            if i >= len(chunks[name]):
                continue
            s, e = chunks[name][i]
            model.set_kv_caches(caches[name])
            start = time.perf_counter()
            hidden = model(idx[:, s:e], pos[:, s:e], lm_head=False)
            if e == t:
                tokens[name] = model.logits(hidden[:, -1]).argmax(dim=-1)
            elapsed[name] += time.perf_counter() - start
            model.set_kv_caches(None)
    return {
        name: Run(config, caches[name], tokens[name], t, elapsed[name], sum(c.nbytes() for c in caches[name]))
        for name, config in configs.items()
    }


@torch.inference_mode()
def decode_step(model: GPT, run: Run) -> None:
    """One greedy decode step of `run` (timed)."""
    model.set_kv_caches(run.caches)
    b = run.tokens.shape[0]
    start = time.perf_counter()
    logits = model(run.tokens[:, None], torch.full((b, 1), run.pos))[:, -1]
    run.tokens = logits.argmax(dim=-1)
    run.step_s.append(time.perf_counter() - start)
    run.pos += 1
    model.set_kv_caches(None)


def tokens_per_s(run: Run) -> float:
    return run.tokens.shape[0] / statistics.median(run.step_s)


def print_table(runs: dict[str, Run]) -> None:
    """Markdown table; ratios against dense and h2o from the same run."""
    dense, h2o = runs.get("dense"), runs.get("h2o")
    header = ["policy", "prefill s", "decode tok/s", "vs dense", "cache MiB", "bytes vs dense", "bytes vs h2o"]
    rows = []
    for name, r in runs.items():
        speed = tokens_per_s(r)
        rows.append(
            [
                name,
                f"{r.prefill_s:.1f}",
                f"{speed:.2f}",
                f"{speed / tokens_per_s(dense):.2f}x" if dense else "-",
                f"{r.cache_bytes / 2**20:.2f}",
                f"{r.cache_bytes / dense.cache_bytes:.3f}x" if dense else "-",
                f"{r.cache_bytes / h2o.cache_bytes:.3f}x" if h2o else "-",
            ]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        print("| " + " | ".join(cells) + " |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M", help="LitGPT config name (random weights)")
    parser.add_argument("--prompt-length", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cache-length", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256, help="prefill chunk size after the first chunk")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--quant-group-size", type=int, default=64, help="qh2o int4 group size (<= head size)")
    parser.add_argument("--policies", default="dense,last-recent,h2o,qh2o")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="512-token prompt, 16 new tokens, 128 slots")
    args = parser.parse_args()
    if args.quick:
        args.prompt_length, args.new_tokens, args.cache_length, args.chunk_size = 512, 16, 128, 64
    return args


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = Config.from_name(args.model)
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (args.batch_size, args.prompt_length))
    print(
        f"{args.model} (random weights, float32, CPU, {torch.get_num_threads()} threads): batch "
        f"{args.batch_size}, prompt {args.prompt_length}, {args.new_tokens} new tokens, cache_length "
        f"{args.cache_length} (dense: {args.prompt_length + args.new_tokens}), prefill chunks "
        f"{args.cache_length} then {args.chunk_size}"
    )
    available = policy_configs(args, config.head_size)
    names = args.policies.split(",")
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ValueError(f"unknown policies {unknown} for this benchmark; choose from {sorted(available)}")
    print("prefill, chunks interleaved ...", file=sys.stderr, flush=True)
    runs = prefill_all(model, idx, {name: available[name] for name in names})
    print(f"decode {args.new_tokens - 1} steps per policy, interleaved ...", file=sys.stderr, flush=True)
    order = list(runs.values())
    for step in range(args.new_tokens - 1):
        shift = step % len(order)
        for run in order[shift:] + order[:shift]:
            decode_step(model, run)
    print_table(runs)


if __name__ == "__main__":
    main()
