"""Decode speed and GPU memory in bf16: litkv against transformers' dynamic and static caches on the same
random weights, then the policy table; markdown on stdout (scripts/gpu_check.sh appends it to its report).

SmolLM2-135M architecture (random weights written once by `litkv.eval.peers.prepare_weights`, loaded by litkv
and by `LlamaForCausalLM`, both moved to the device in `--dtype`). Per prompt length (batch 1, greedy):

- `prefill s`: a generation of one token; `decode tok/s`: `(new - 1)` over the time of a generation of
  `new` tokens minus the one-token generation; both the best of `--repeats` after one untimed warm-up;
- `peak MiB`: `torch.cuda.max_memory_allocated` during the timed generation, minus the weights;
- rows: litkv dense, litkv dense with `compile=True`, transformers `DynamicCache`, transformers
  `StaticCache` with its forward compiled (`litkv.eval.peers.load_hf`: fullgraph, static shapes); `same tokens`: the
  greedy tokens equal litkv dense's (bf16 rounding may part them after a near tie).

The policy table: every policy of `--policies` with `--cache-length` slots at a `--policy-prompt` prompt: prefill s,
decode tok/s, cache MiB (the caches' own `nbytes()`: codes, scales and offsets of int4 included) and peak MiB.

`--device cpu --quick` runs the whole script on the CPU in seconds (what the tests can check without a GPU).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import litkv
from litkv.eval.peers import hf_generate, load_hf, load_lit, prepare_weights
from litkv.modeling.config import KVCacheConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
POLICIES = "h2o,last-recent,tova,snapkv,knorm,keydiff,qh2o"


class _Sink:
    """A transformers streamer that keeps the new tokens (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(value.detach().reshape(-1).cpu())

    def end(self) -> None:
        pass

    def tokens(self) -> list[int]:
        return [int(t) for call in self.calls[1:] for t in call]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Timing = tuple[float, float, float, list[int]]


def _timed(run: Callable[[int], list[int]], new: int, repeats: int, device: torch.device) -> Timing:
    """(prefill s, decode tok/s, peak MiB, tokens) of `run(n_new)`; one warm-up of each length first."""
    run(1), run(new)
    prefill, total, peak, tokens = float("inf"), float("inf"), 0.0, []
    for _ in range(repeats):
        for n in (1, new):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            _sync(device)
            start = time.perf_counter()
            out = run(n)
            _sync(device)
            elapsed = time.perf_counter() - start
            if n == 1:
                prefill = min(prefill, elapsed)
            else:
                total, tokens = min(total, elapsed), out
                if device.type == "cuda":
                    peak = max(peak, (torch.cuda.max_memory_allocated(device) - base) / 2**20)
    return prefill, (new - 1) / max(total - prefill, 1e-9), peak, tokens


def _litkv_run(model: litkv.GPT, prompt: torch.Tensor, cfg: KVCacheConfig, compile: bool) -> Callable[[int], list[int]]:
    def run(n: int) -> list[int]:
        with torch.inference_mode():
            return litkv.generate(model, [prompt[0]], max_new_tokens=n, kv_cache=cfg, compile=compile)[0].tolist()

    return run


def _hf_run(model: torch.nn.Module, prompt: torch.Tensor, static: bool) -> Callable[[int], list[int]]:
    def run(n: int) -> list[int]:
        sink = _Sink()
        hf_generate(model, prompt, n, sink, static_len=prompt.shape[1] + n if static else None)
        return sink.tokens()

    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--prompts", default="512,4096,16384", help="comma-separated prompt lengths")
    parser.add_argument("--new", type=int, default=64, help="new tokens per timed generation")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=1024, help="litkv prefill chunk size")
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--cache-length", type=int, default=1024, help="slots of the policy table's caches")
    parser.add_argument("--policy-prompt", type=int, default=4096)
    parser.add_argument("--no-compile", action="store_true", help="no compiled rows")
    parser.add_argument("--quick", action="store_true", help="2 layers, prompts 32/64, 4 new tokens, 16 slots")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new, args.repeats, args.cache_length, args.policy_prompt = "32,64", 4, 1, 16, 64
        args.chunk_size = 16
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config = litkv.Config.from_name("SmolLM2-135M", **({"n_layer": 2} if args.quick else {}))
    prompts = [int(p) for p in args.prompts.split(",")]
    config.block_size = max(config.block_size, max(prompts) + args.new)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, lit_dir = prepare_weights(config, 0, Path(tmp))
        model = load_lit(config, lit_dir, litkv.GPT).to(device, dtype)
        hf = load_hf(hf_dir).to(device, dtype)
        hf_static = load_hf(hf_dir, static_compile=not args.no_compile).to(device, dtype)
    gen = torch.Generator().manual_seed(0)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"### decode, {args.dtype}, {device_name}, batch 1, {args.new} new tokens\n")
    print("| prompt | peer | prefill s | decode tok/s | peak MiB | same tokens |\n|---|---|---|---|---|---|")
    for n in prompts:
        prompt = torch.randint(0, config.vocab_size, (1, n), generator=gen).to(device)
        dense = KVCacheConfig("dense", cache_length=n + args.new, chunk_size=min(args.chunk_size, n))
        rows: list[tuple[str, Callable[[int], list[int]]]] = [("litkv dense", _litkv_run(model, prompt, dense, False))]
        if not args.no_compile:
            rows.append(("litkv dense compiled", _litkv_run(model, prompt, dense, True)))
        rows.append(("hf DynamicCache", _hf_run(hf, prompt, False)))
        static = "hf StaticCache" + ("" if args.no_compile else " compiled")
        rows.append((static, _hf_run(hf_static, prompt, True)))
        reference: list[int] | None = None
        for name, run in rows:
            try:
                prefill, tok_s, peak, tokens = _timed(run, args.new, args.repeats, device)
            except (RuntimeError, ValueError) as err:  # out of memory, an unsupported kernel: say so, go on
                print(f"| {n} | {name} | failed: {str(err).splitlines()[0][:120]} | - | - | - |")
                continue
            reference = tokens if reference is None else reference
            same = "yes" if tokens == reference else "no"
            print(f"| {n} | {name} | {prefill:.3f} | {tok_s:.1f} | {peak:.0f} | {same} |")
    _policy_table(args, model, config, device)


def _policy_table(args: argparse.Namespace, model: litkv.GPT, config: litkv.Config, device: torch.device) -> None:
    n = args.policy_prompt
    print(f"\n### policies, prompt {n}, {args.cache_length} slots, {args.dtype}\n")
    print("| policy | prefill s | decode tok/s | cache MiB | peak MiB |\n|---|---|---|---|---|")
    prompt = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1)).to(device)
    for policy in ["dense", *args.policies.split(",")]:
        length = n + args.new if policy == "dense" else args.cache_length
        cfg = KVCacheConfig(policy, cache_length=length, chunk_size=min(args.chunk_size, args.cache_length))
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # qh2o says it stores int4
            caches = model.build_kv_caches(cfg, 1)
        mib = sum(cache.nbytes() for cache in caches) / 2**20
        del caches
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prefill, tok_s, peak, _ = _timed(_litkv_run(model, prompt, cfg, False), args.new, args.repeats, device)
        except (RuntimeError, ValueError) as err:
            print(f"| {policy} | failed: {str(err).splitlines()[0][:120]} | - | - | - |")
            continue
        print(f"| {policy} | {prefill:.3f} | {tok_s:.1f} | {mib:.2f} | {peak:.0f} |")


if __name__ == "__main__":
    main()
