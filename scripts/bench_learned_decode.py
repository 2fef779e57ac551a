#!/usr/bin/env python
"""Decode speed of `learned` against `last-recent`: batch 1, a 4,096-token prompt, 512 slots, one thread.

The model is the real SmolLM2-135M-Instruct checkpoint (`smollm2-135m-instruct`, when `litkv download`
has put it in the cache; otherwise random weights of its architecture, which decode at the same speed).
The gates are random when the checkpoint has none: `learned`'s speed does not depend on what they
learned. Both policies prefill the same random prompt in chunks of `--chunk_size` and then decode
greedily, one step of each in turn (`bench_policies.interleaved`: two threads, each on its own copy of
the model sharing the weights), so that both see the same load on a shared machine. The runs are
repeated `--rounds` times, the policy that starts alternating. Each round gives each policy's decode
tok/s (steps over the steps' time) and their ratio; the line at the end is the median ratio of the
rounds and the ratio of the summed times, against the target (>= 0.95).

`--profile` also prints the operators that the decode steps of `learned` and `last-recent` spend their
time in (`torch.profiler`, one thread, after the same prefill), to find the learned cache's own work.

    nice python scripts/bench_learned_decode.py                         # the measurement
    nice python scripts/bench_learned_decode.py --rounds 1 --profile    # where the time goes
    python scripts/bench_learned_decode.py --prompt 256 --new 8 --cache_length 64 --rounds 1   # a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from litkv import GPT, Config, KVCacheConfig, generate
from litkv.checkpoints.checkpoint import load_model
from litkv.checkpoints.download import known_checkpoint_dir
from litkv.inference.generate import forward_chunked
from litkv.kvcache.config import ChunkPlan
from litkv.modeling.runner import run_chunks

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a script beside bench_policies.py
from bench_policies import build_model, interleaved, policy_model, with_gates  # noqa: E402

REAL = "smollm2-135m-instruct"
TARGET = 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=REAL, help="a checkpoint directory or a known model's name")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--new", type=int, default=128, help="new tokens per generation")
    p.add_argument("--cache_length", type=int, default=512)
    p.add_argument("--chunk_size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true")
    return p.parse_args(argv)


def load(name: str, seed: int) -> tuple[GPT, str]:
    """The model (with gates: its own, else random ones) and a line saying which weights it has."""
    try:
        path = known_checkpoint_dir(name) or Path(name)
    except FileNotFoundError:  # a known model not downloaded
        path = Path(name)
    if path.is_dir():
        model = load_model(path)
        what = f"{path.name} (real weights)"
    else:
        model = build_model(Config.from_name("SmolLM2-135M"), seed)
        what = f"SmolLM2-135M with random weights ({name} not found)"
    if model.eviction_gates is None:
        with_gates(model, seed)
        what += ", random gates"
    return model, what


def configs(args: argparse.Namespace) -> dict[str, KVCacheConfig]:
    """Both caches: `cache_length` slots, 4 sinks for last-recent (the learned cache's come from the gates)."""
    chunk = min(args.chunk_size, args.cache_length)
    return {
        "learned": KVCacheConfig("learned", cache_length=args.cache_length, chunk_size=chunk),
        "last-recent": KVCacheConfig("last-recent", cache_length=args.cache_length, chunk_size=chunk,
                                     options={"sinks": 4}),
    }  # fmt: skip


def one_round(model: GPT, prompt: torch.Tensor, new: int, order: list[tuple[str, KVCacheConfig]]) -> dict[str, float]:
    """Decode tok/s of each policy of `order`, interleaved step by step."""

    def runner(m: GPT, config: KVCacheConfig):
        return lambda on_tokens: generate(m, [prompt], new, config, on_tokens=on_tokens)

    runs = [runner(policy_model(model), config) for _, config in order]
    timings = interleaved(runs)
    return {name: len(t.steps) / sum(t.steps) for (name, _), t in zip(order, timings, strict=True)}


def profile(model: GPT, prompt: torch.Tensor, cfgs: dict[str, KVCacheConfig], steps: int = 32) -> None:
    """The operators of `steps` decode steps per policy, after the prefill (`torch.profiler`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, config in cfgs.items():
        m = policy_model(model)
        with torch.inference_mode(), m.kv_caches_attached(config, 1):
            ids = prompt[None]
            pos = torch.arange(ids.shape[1])[None]
            logits = run_chunks(m, ids, pos, ChunkPlan.of(config))
            token = logits[:, -1:].argmax(-1)
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(steps):
                    logits = m(token, torch.tensor([[ids.shape[1] + i]]))
                    token = logits[:, -1:].argmax(-1)
        print(f"--- {name}: {steps} decode steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, what = load(args.checkpoint, args.seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt,), generator=torch.Generator().manual_seed(args.seed))
    cfgs = configs(args)
    print(f"{what}; batch 1, prompt {args.prompt}, {args.new} new tokens, {args.cache_length} slots, "
          f"{args.threads} thread(s)")  # fmt: skip
    forward_chunked(model, prompt[None, : min(256, args.prompt)], cfgs["learned"])  # fails early without gates
    ratios, totals = [], {name: 0.0 for name in cfgs}
    for r in range(args.rounds):
        order = list(cfgs.items())[:: 1 if r % 2 == 0 else -1]
        tok_s = one_round(model, prompt, args.new, order)
        ratio = tok_s["learned"] / tok_s["last-recent"]
        ratios.append(ratio)
        for name, value in tok_s.items():
            totals[name] += (args.new - 1) / value
        print(f"round {r + 1} ({order[0][0]} first): learned {tok_s['learned']:.2f} tok/s, last-recent "
              f"{tok_s['last-recent']:.2f} tok/s, ratio {ratio:.3f}", flush=True)  # fmt: skip
    median = statistics.median(ratios)
    pooled = totals["last-recent"] / totals["learned"]
    verdict = "met" if median >= TARGET else "missed"
    print(f"learned / last-recent decode tok/s: median of {args.rounds} rounds {median:.3f}, pooled {pooled:.3f} "
          f"(target >= {TARGET}: {verdict})")  # fmt: skip
    if args.profile:
        profile(model, prompt, cfgs)
    return median


if __name__ == "__main__":
    main()
