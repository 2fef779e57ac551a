"""Decode and prefill speed on a GPU (issue 44's table): litkv against transformers' dynamic and static caches on
the same random weights, the policy table at batch 1 and 8, and the targets' ratios; markdown on stdout
(scripts/gpu_check.sh appends it to its report).

`--model` is a Llama-family preset (SmolLM2-135M, Llama-3.2-1B): random weights written once by
`litkv.eval.peers.prepare_weights`, loaded by litkv and by `LlamaForCausalLM`, both moved to the device in
`--dtype`. The device's read bandwidth is measured in the same run (best of five `sum`s of a 1 GiB tensor).

The decode table, per prompt length (batch 1, greedy, `--new` tokens):

- `prefill s`: a generation of one token; `decode tok/s`: `(new - 1)` over the time of a generation of `new`
  tokens minus the one-token generation (`nan` when that difference is under 5 % of the time: noise); both the
  best of `--repeats` after one untimed generation of 4 tokens;
- `of bound`: decode tok/s over the bandwidth bound (bandwidth / (weight bytes + the keys and values cached
  halfway through the decode));
- rows: litkv dense eager, litkv dense `compile=True` (one CUDA graph per step on CUDA), transformers
  `DynamicCache`, transformers `StaticCache` with its forward compiled ("reduce-overhead": CUDA graphs);
  `same tokens`: greedy tokens equal litkv dense's (bf16 rounding may part them after a near tie).

The policy table: every policy of `--policies` with `--cache-length` slots at a `--policy-prompt` prompt, for each
batch of `--batches` (`--batch-policies` at batches above 1), against dense and transformers' `DynamicCache` in the
same run: prefill s, decode tok/s, `vs dense` (decode), cache MiB (the caches' `nbytes()`, int4 scales included).
Where qh2o runs it runs twice: with its int4 decode attention on the Triton kernel (CUDA; the PyTorch path elsewhere)
and on the PyTorch path (`qh2o (PyTorch attention)`).
The `learned` policy runs with fresh gates (`EvictionGates.create`: what it costs, not what it keeps).

Last, one line per target of issue 44 with its figure (`met` / `MISSED`).

`--device cpu --quick` runs the whole script on the CPU in seconds (what the tests can check without a GPU): every
row and target of the full run, on a small shape of the preset with its head grouping (`quick_shape`).
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
from litkv.eval.bandwidth import kv_bytes_per_token, weight_bytes
from litkv.eval.peers import hf_generate, load_hf, load_lit, prepare_weights
from litkv.gates.gate import EvictionGates
from litkv.kvcache import quant_attention
from litkv.kvcache.config import KVCacheConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
POLICIES = "last-recent,h2o,tova,snapkv,keydiff,knorm,expected-attention,learned,qh2o"
# qh2o again with its int4 attention on the PyTorch path instead of the Triton kernel (`TRITON_DECODE = False`)
QH2O_TORCH = "qh2o (PyTorch attention)"


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


def device_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Read bandwidth of `device` in bytes/s: the best of `repeats` timed sums of an `nbytes` float32 tensor."""
    x = torch.ones(nbytes // 4, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


Timing = tuple[float, float, list[int]]
Run = Callable[[int], list[int]]


def _timed(run: Run, new: int, repeats: int, device: torch.device) -> Timing:
    """(prefill s, decode tok/s per row, tokens) of `run(n_new)`, after one untimed warm-up of 4 tokens."""
    run(min(new, 4))  # kernels loaded, the compiled step compiled and its CUDA graph recorded
    prefill, total, tokens = float("inf"), float("inf"), []
    for _ in range(repeats):
        for n in (1, new):
            _sync(device)
            start = time.perf_counter()
            out = run(n)
            _sync(device)
            elapsed = time.perf_counter() - start
            if n == 1:
                prefill = min(prefill, elapsed)
            else:
                total, tokens = min(total, elapsed), out
    decode = total - prefill
    # a decode time lost in the timing noise (a loaded machine: the longer run as fast as the one-token one)
    return prefill, (new - 1) / decode if decode > 0.05 * total else float("nan"), tokens


def _litkv_run(model: litkv.GPT, prompts: torch.Tensor, cfg: KVCacheConfig, compile: bool) -> Run:
    def run(n: int) -> list[int]:
        with torch.inference_mode():
            out = litkv.generate(model, list(prompts), max_new_tokens=n, kv_cache=cfg, compile=compile)
        return out[0].tolist()

    return run


def _hf_run(model: torch.nn.Module, prompts: torch.Tensor, static: bool) -> Run:
    def run(n: int) -> list[int]:
        sink = _Sink()
        hf_generate(model, prompts, n, sink, static_len=prompts.shape[1] + n if static else None)
        return sink.tokens()

    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M", help="Llama-family preset (random weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--prompts", default="4096", help="comma-separated prompt lengths of the decode table")
    parser.add_argument("--new", type=int, default=64, help="new tokens per timed generation")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--chunk-size", type=int, default=2048, help="litkv prefill chunk size")
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--batch-policies", default="last-recent,h2o,keydiff,qh2o", help="policies at batch > 1")
    parser.add_argument("--batches", default="1,8", help="batch sizes of the policy table")
    parser.add_argument("--cache-length", type=int, default=4096, help="slots of the policy table's caches")
    parser.add_argument("--policy-prompt", type=int, default=32768)
    parser.add_argument("--no-compile", action="store_true", help="no compiled rows")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the preset's heads at head size 16 (MLP 2x the width), 2 layers, vocabulary 512, prompts 32/64, "
        "4 new tokens, 16 slots, batches 1,2, bandwidth from 64 MiB",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new, args.repeats, args.cache_length, args.policy_prompt = "32,64", 4, 1, 16, 64
        args.chunk_size, args.batches = 16, "1,2"
    return args


def quick_shape(model: str) -> dict[str, int]:
    """`--quick`'s shape of preset `model`: its query and KV heads (the grouping the kernels see) at head size 16,
    an MLP twice the width, 2 layers, a vocabulary of 512 (the CPU dry run of scripts/gpu_check.sh)."""
    n_head = litkv.Config.from_name(model).n_head
    width = 16 * n_head
    return {"n_layer": 2, "vocab_size": 512, "padded_vocab_size": 512, "n_embd": width, "head_size": 16,
            "intermediate_size": 2 * width}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config = litkv.Config.from_name(args.model, **(quick_shape(args.model) if args.quick else {}))
    prompts = [int(p) for p in args.prompts.split(",")]
    config.block_size = max(config.block_size, max(*prompts, args.policy_prompt) + args.new)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, lit_dir = prepare_weights(config, 0, Path(tmp))
        model = load_lit(config, lit_dir, litkv.GPT).to(device, dtype)
        hf = load_hf(hf_dir, device=device).to(device, dtype)
        hf_static = load_hf(hf_dir, static_compile=not args.no_compile, device=device).to(device, dtype)
    model.eviction_gates = EvictionGates.create(config.n_layer, config.n_query_groups, config.head_size, 64, 4).to(
        device
    )
    bandwidth = device_bandwidth(device, 2**26 if args.quick else 2**30)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"## {args.model} ({config.n_layer} layers), {args.dtype}, {name}, read bandwidth {bandwidth / 1e9:.0f} GB/s\n"
    )
    results: dict[str, float] = {}
    _decode_table(args, model, hf, hf_static, bandwidth, results)
    for batch in (int(b) for b in args.batches.split(",")):
        _policy_table(args, model, hf, batch, results)
    _targets(args, results)


def _decode_table(
    args: argparse.Namespace,
    model: litkv.GPT,
    hf: torch.nn.Module,
    hf_static: torch.nn.Module,
    bandwidth: float,
    results: dict[str, float],
) -> None:
    device, config = model.lm_head.weight.device, model.config
    print(f"### decode, batch 1, {args.new} new tokens\n")
    print("| prompt | peer | prefill s | decode tok/s | of bound | same tokens |\n|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    kv_token = kv_bytes_per_token(
        config.n_layer, config.n_query_groups, config.head_size, model.lm_head.weight.element_size()
    )
    for n in prompts_of(args):
        prompt = torch.randint(0, config.vocab_size, (1, n), generator=gen).to(device)
        bound = bandwidth / (weight_bytes(model) + kv_token * (n + args.new / 2))
        dense = KVCacheConfig("dense", cache_length=n + args.new, chunk_size=min(args.chunk_size, n))
        rows: list[tuple[str, Run]] = [("litkv dense", _litkv_run(model, prompt, dense, False))]
        if not args.no_compile:
            rows.append(("litkv dense compiled", _litkv_run(model, prompt, dense, True)))
        rows.append(("hf DynamicCache", _hf_run(hf, prompt, False)))
        rows.append(("hf StaticCache" + ("" if args.no_compile else " compiled"), _hf_run(hf_static, prompt, True)))
        reference: list[int] | None = None
        for peer, run in rows:
            try:
                prefill, tok_s, tokens = _timed(run, args.new, args.repeats, device)
            except (RuntimeError, ValueError) as err:  # out of memory, an unsupported kernel: say so, go on
                print(f"| {n} | {peer} | failed: {str(err).splitlines()[0][:120]} | - | - | - |")
                continue
            reference = tokens if reference is None else reference
            results[f"{n}/{peer}/prefill"], results[f"{n}/{peer}/decode"] = prefill, tok_s
            results[f"{n}/bound"] = bound
            same = "yes" if tokens == reference else "no"
            print(f"| {n} | {peer} | {prefill:.3f} | {tok_s:.1f} | {tok_s / bound:.1%} | {same} |")
    print()


def prompts_of(args: argparse.Namespace) -> list[int]:
    return [int(p) for p in args.prompts.split(",")]


def _policy_table(
    args: argparse.Namespace, model: litkv.GPT, hf: torch.nn.Module, batch: int, results: dict[str, float]
) -> None:
    n, device = args.policy_prompt, model.lm_head.weight.device
    policies = args.policies if batch == 1 else args.batch_policies
    print(f"### policies, batch {batch}, prompt {n}, {args.cache_length} slots, {args.new} new tokens\n")
    print("| policy | prefill s | decode tok/s | vs dense | cache MiB |\n|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (batch, n), generator=gen).to(device)
    names = policies.split(",")
    for policy in ["dense", *names, *([QH2O_TORCH] if "qh2o" in names else []), "hf DynamicCache"]:
        mib = float("nan")
        if policy == "hf DynamicCache":
            run = _hf_run(hf, prompts, False)
        else:
            length = n + args.new if policy == "dense" else args.cache_length
            kind = "qh2o" if policy == QH2O_TORCH else policy
            cfg = KVCacheConfig(kind, cache_length=length, chunk_size=min(args.chunk_size, args.cache_length))
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # qh2o says it stores int4
                mib = sum(cache.nbytes() for cache in model.build_kv_caches(cfg, batch)) / 2**20
            run = _litkv_run(model, prompts, cfg, False)
            run = _without_triton(run) if policy == QH2O_TORCH else run
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prefill, tok_s, _ = _timed(run, args.new, args.repeats, device)
        except (RuntimeError, ValueError) as err:
            print(f"| {policy} | failed: {str(err).splitlines()[0][:120]} | - | - | - |")
            continue
        tok_s *= batch
        results[f"b{batch}/{policy}/prefill"], results[f"b{batch}/{policy}/decode"] = prefill, tok_s
        ratio = tok_s / results.get(f"b{batch}/dense/decode", float("nan"))
        print(f"| {policy} | {prefill:.3f} | {tok_s:.1f} | {ratio:.2f}x | {mib:.1f} |")
    print()


def _without_triton(run: Run) -> Run:
    """`run` with quantised decode attention on the PyTorch path (no Triton kernel) on every device."""

    def wrapped(n: int) -> list[int]:
        quant_attention.TRITON_DECODE = False
        try:
            return run(n)
        finally:
            quant_attention.TRITON_DECODE = True

    return wrapped


def _targets(args: argparse.Namespace, results: dict[str, float]) -> None:
    """One line per target of issue 44 that this run measured: the figure, then met / MISSED."""
    lines: list[tuple[str, float, float]] = []  # (what, figure, target)

    def ratio(a: str, b: str) -> float:
        return results.get(a, float("nan")) / results.get(b, float("nan"))

    for n in prompts_of(args):
        compiled, static = f"{n}/litkv dense compiled/decode", f"{n}/hf StaticCache compiled/decode"
        lines.append((f"{n}: compiled dense / hf StaticCache compiled (decode)", ratio(compiled, static), 1.0))
        lines.append((f"{n}: compiled dense / bandwidth bound", ratio(compiled, f"{n}/bound"), 0.4))
        lines.append(
            (
                f"{n}: eager dense / hf DynamicCache (decode)",
                ratio(f"{n}/litkv dense/decode", f"{n}/hf DynamicCache/decode"),
                1.0,
            )
        )
    for batch in (int(b) for b in args.batches.split(",")):
        want = 1.15 if batch == 1 else 2.0
        policies = (args.policies if batch == 1 else args.batch_policies).split(",")
        for policy in policies:
            lines.append(
                (
                    f"b{batch}: {policy} / dense (decode)",
                    ratio(f"b{batch}/{policy}/decode", f"b{batch}/dense/decode"),
                    want,
                )
            )
        if "qh2o" in policies and "h2o" in policies:
            lines.append(
                (f"b{batch}: qh2o / h2o (decode)", ratio(f"b{batch}/qh2o/decode", f"b{batch}/h2o/decode"), 1.0)
            )
        if "qh2o" in policies:  # not a target of the issue: what the Triton kernel gives qh2o (CUDA only)
            kernel = args.device.startswith("cuda")  # elsewhere both rows take the PyTorch path: timing noise
            gain = ratio(f"b{batch}/qh2o/decode", f"b{batch}/{QH2O_TORCH}/decode") if kernel else float("nan")
            lines.append((f"b{batch}: qh2o with the Triton kernel / with PyTorch attention (decode)", gain, 1.0))
    hf_prefill = "b1/hf DynamicCache/prefill"
    for policy, most in (("dense", 1.3), ("h2o", 1.6), ("tova", 1.6), ("snapkv", 1.6)):
        figure = ratio(f"b1/{policy}/prefill", hf_prefill)
        lines.append(
            (f"prefill {args.policy_prompt}: {policy} / hf DynamicCache (time, at most {most})", -figure, -most)
        )
    print("### targets of issue 44\n")
    for what, figure, target in lines:
        verdict = "not measured" if figure != figure else ("met" if figure >= target else "MISSED")
        print(f"- {what}: {abs(figure):.2f} (target {abs(target):.2f}): {verdict}")


if __name__ == "__main__":
    main()
