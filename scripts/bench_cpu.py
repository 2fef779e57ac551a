"""Decode speed a CPU user would choose: litkv with quantised weights and KV caches beside llama.cpp.

Two parts, each one run (every figure in a table comes from the same process and the same machine
state; on a shared machine, say how loaded it was):

- `peers`: llama.cpp (`llama-cpp-python` in its own environment, run as a subprocess on the same GGUF
  file, with its f16 / q8_0 / q4_0 KV caches; `scripts/bench_llamacpp.py`'s worker) beside litkv on
  the checkpoint converted from that file, with float32 / int8 / int4 weights (`--quantize`) x float /
  int8 / int4 KV storage, dense and h2o, greedy, at each prompt length: prefill tok/s, decode tok/s
  (median over `--repeats`), and each litkv row's bytes per decode step and the tok/s that the memory
  bandwidth measured in the same run allows (`litkv.eval.bandwidth`). `--cpu_kernel both` adds each quantised-weights
  row through PyTorch's packed kernels (`litkv.modeling.quant_rows` off: "(packed kernels)" rows); `--compile
  both` each row also through `torch.compile` ("(compiled)" rows, compiled before the timed runs).
- `kv`: the KV cache alone at long contexts: decode steps of the real model (float32 weights) with
  every layer's cache filled with `--cached` random tokens (no prefill: the state is written directly),
  dense and h2o, float / int8 / int4 storage, and the same at `--slots` slots; the ratio of each
  quantised row to the float row of its policy and length. Every row is timed once per round and the
  rounds alternate (`--repeats`, the median round); `--cpu_kernel both` adds each quantised storage
  through the PyTorch path (`int8-torch`: `litkv.kvcache.kernels.cpu_decode` off), the kernel's reference.
  Under the table, per quantised storage, the ceiling of its dense ratio at `--cached` tokens: the float step
  over the rest of a step (the dense float step at `--slots` slots) plus its KV bytes at the bandwidth.
- `kl`: quality of the quantised weights: KL to the float32 model per token and top-1 agreement,
  teacher-forced on windows of the shipped held-out text; `--decode`: through decode steps (the C products' path,
  each quantised row also with float32 rows), not one forward per window, and each quantised KV storage of
  `--storages` with float32 weights, through the C decode kernel and through the PyTorch path.

    python scripts/bench_cpu.py peers --checkpoint_dir smollm2-135m-instruct \\
        --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --llamacpp_python ../venv-llamacpp/bin/python
    python scripts/bench_cpu.py kv --checkpoint_dir smollm2-135m-instruct --cached 16384 --repeats 3 --cpu_kernel both
    python scripts/bench_cpu.py kl --checkpoint_dir smollm2-135m-instruct --weights int8,int4,int4-g64
    python scripts/bench_cpu.py kl --checkpoint_dir smollm2-135m-instruct --weights int8,int4 --decode
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import product
from pathlib import Path

import torch
from bench_llamacpp import run_llamacpp

from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.checkpoints.runtime import load_for_inference
from litkv.cli.common import resolve_checkpoint_dir
from litkv.eval.bandwidth import measure_bandwidth
from litkv.inference.generate import generate
from litkv.kvcache.caches import KVCaches
from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.kernels import cpu_decode
from litkv.modeling import quant_rows
from litkv.modeling.model import GPT

STORAGE_BYTES = {"float": 4.0, "int8": 1.0 + 4 / 64, "int4": 0.5 + 4 / 64}  # per number, 16-bit scale+offset


def weights_read(model: GPT) -> int:
    """Bytes of the weights a decode step reads: every parameter but the token embedding (one row read)."""
    return sum(p.nbytes for name, p in model.named_parameters() if "wte" not in name)


def step_bytes(model: GPT, storage: str, attended: float) -> float:
    """Bytes a decode step reads: the weights once and `attended` cached tokens' keys and values."""
    c = model.config
    return weights_read(model) + 2 * c.n_layer * c.n_query_groups * c.head_size * attended * STORAGE_BYTES[storage]


def run_litkv(model: GPT, ids: list[int], new: int, config: KVCacheConfig, compile: bool) -> tuple[float, float]:
    """Prefill tok/s and decode tok/s of one greedy generation (`on_tokens` stamps each token)."""
    stamps: list[float] = []

    def stamp(_tokens: torch.Tensor) -> None:
        stamps.append(time.perf_counter())

    start = time.perf_counter()
    generate(model, [torch.tensor(ids)], new + 1, config, on_tokens=stamp, compile=compile)
    return len(ids) / (stamps[0] - start), new / (stamps[-1] - stamps[0])


def variants(args: argparse.Namespace, quant: str) -> list[tuple[str, bool, bool]]:
    """The `peers` variants of a `quant` weights row: (label, `quant_rows.CPU_KERNEL`, compiled): the C products,
    PyTorch's packed kernels (`--cpu_kernel off`), or both (float weights: the first only), each eager, compiled
    (`--compile on`: `generate(..., compile=True)`) or both."""
    kernels = {"on": [("", True)], "off": [(" (packed kernels)", False)]}
    chosen = kernels["on"] if quant == "none" else kernels.get(args.cpu_kernel, kernels["on"] + kernels["off"])
    modes = {"off": [("", False)], "on": [(" (compiled)", True)]}
    modes["both"] = modes["off"] + modes["on"]
    return [(k + m, kernel, compiled) for (k, kernel), (m, compiled) in product(chosen, modes[args.compile])]


def peers(args: argparse.Namespace, bandwidth: float) -> None:
    """The `peers` table, one per prompt length."""
    models = {q: load_for_inference(args.checkpoint_dir, "32-true", "cpu", args.threads, q)[0] for q in args.weights}
    text = (Path(__file__).resolve().parents[1] / "litkv" / "assets" / "default" / "heldout.txt").read_text()
    text_ids = load_tokenizer(args.checkpoint_dir).encode(text).tolist()
    for prompt in args.prompts:
        ids = (text_ids * (prompt // len(text_ids) + 1))[:prompt]
        rows: dict[str, list[tuple[float, float]]] = {}
        info: dict[str, float] = {}
        for _ in range(args.repeats):
            for kv in args.kv_types if args.llamacpp_python else []:
                r = run_llamacpp(args.llamacpp_python, args.gguf, ids, args.new_tokens, kv, args.threads)
                rows.setdefault(f"llama.cpp Q4_1 weights, {kv} KV", []).append(
                    (prompt / r["prefill_s"], len(r["steps"]) / sum(r["steps"]))
                )
                print(f"# llama.cpp {kv}: {rows[f'llama.cpp Q4_1 weights, {kv} KV'][-1]}", flush=True)
            for quant, model in models.items():
                for (label, kernel, compiled), policy in product(variants(args, quant), args.policies):
                    for storage in args.storages:
                        length = prompt + args.new_tokens + 1 if policy == "dense" else args.slots
                        cfg = KVCacheConfig(policy=policy, cache_length=length, storage=storage)
                        name = f"litkv {quant} weights{label}, {policy} {storage} KV"
                        quant_rows.CPU_KERNEL = kernel
                        if compiled and name not in rows:  # the first call compiles: untimed
                            run_litkv(model, ids, 2, cfg, True)
                        rows.setdefault(name, []).append(run_litkv(model, ids, args.new_tokens, cfg, compiled))
                        quant_rows.CPU_KERNEL = True
                        print(f"# {name}: {rows[name][-1]}", flush=True)
                        attended = prompt + args.new_tokens / 2 if policy == "dense" else args.slots
                        info[name] = step_bytes(model, storage, attended)
        print(f"\nprompt {prompt} tokens, {args.new_tokens} new, {args.threads} thread(s), median of {args.repeats}")
        print("| row | prefill tok/s | decode tok/s | vs llama.cpp f16 | MB/step | bound tok/s | of bound |")
        print("|---|---|---|---|---|---|---|")
        ref = next((statistics.median(d for _, d in r) for n, r in rows.items() if n.endswith("f16 KV")), None)
        for name, runs in rows.items():
            prefill, decode = statistics.median(p for p, _ in runs), statistics.median(d for _, d in runs)
            cells = [f"{prefill:.0f}", f"{decode:.1f}", f"{decode / ref:.2f}" if ref else "-"]
            if name in info:
                bound = bandwidth / info[name]
                cells += [f"{info[name] / 1e6:.0f}", f"{bound:.1f}", f"{decode / bound:.0%}"]
            else:
                cells += ["-", "-", "-"]
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def fill(model: GPT, config: KVCacheConfig, cached: int, seed: int) -> KVCaches:
    """Caches of `config` on `model` whose first `cached` slots of every layer hold random tokens
    (keys and values N(0, 1), positions `0 .. cached - 1`), written straight into storage."""
    gen = torch.Generator().manual_seed(seed)
    caches = KVCaches(model.build_kv_caches(config, batch_size=1))
    c = model.config
    for cache in caches:
        shape = (1, c.n_query_groups, cached, c.head_size)
        cache.storage.write_range(0, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        cache.positions[:, :, :cached] = torch.arange(cached)
        cache.num_filled = cached
    model.set_kv_caches(caches)
    return caches


def time_steps(model: GPT, cached: int, steps: int) -> float:
    """Median seconds of a decode step (one token, position `cached` onwards) over `steps` steps."""
    times = []
    token = torch.tensor([[1]])
    with torch.no_grad(), model.trusted_inputs(cached + steps):
        for i in range(steps + 1):
            start = time.perf_counter()
            logits = model(token, torch.tensor([[cached + i]]))
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def kv_rows(args: argparse.Namespace) -> list[tuple[int, str, str]]:
    """The `kv` table's rows: (cached tokens, policy, storage); a quantised storage also as `STORAGE-torch`
    (the PyTorch path, `cpu_decode.CPU_KERNEL` off) with `--cpu_kernel both`."""
    storages = []
    for storage in args.storages:
        if storage == "float" or args.cpu_kernel != "off":
            storages.append(storage)
        if storage != "float" and args.cpu_kernel != "on":
            storages.append(f"{storage}-torch")
    return [
        (cached, policy, storage)
        for cached in (args.cached, args.slots)
        for policy in args.policies
        for storage in storages
    ]


def kv(args: argparse.Namespace, bandwidth: float) -> None:
    """The `kv` table: float / int8 / int4 storage at `--cached` tokens and at `--slots` slots, every row
    timed once per round, rounds alternated (`--repeats`), the median round per row."""
    model, _ = load_for_inference(args.checkpoint_dir, "32-true", "cpu", args.threads, args.weights[0])
    rows = kv_rows(args)
    times: dict[tuple[int, str, str], list[float]] = {row: [] for row in rows}
    for _ in range(args.repeats):
        for row in rows:
            cached, policy, storage = row
            cpu_decode.CPU_KERNEL = not storage.endswith("-torch")
            length = cached + args.steps + 1 if policy == "dense" else cached
            config = KVCacheConfig(policy=policy, cache_length=length, storage=storage.removesuffix("-torch"))
            fill(model, config, cached, 0)
            times[row].append(time_steps(model, cached, args.steps))
            model.set_kv_caches(None)
    cpu_decode.CPU_KERNEL = True
    print(f"\nKV cache alone: {args.weights[0]} weights, {args.threads} thread(s), median of {args.steps} steps, "
          f"median of {args.repeats} alternated round(s)")  # fmt: skip
    print("| cached tokens | policy | storage | decode tok/s | vs float | MB/step | bound tok/s | of bound |")
    print("|---|---|---|---|---|---|---|---|")
    for cached, policy, storage in rows:
        tok_s = 1 / statistics.median(times[cached, policy, storage])
        ref = 1 / statistics.median(times[cached, policy, "float"]) if (cached, policy, "float") in times else None
        nbytes = step_bytes(model, storage.removesuffix("-torch"), cached)
        ratio = f"{tok_s / ref:.2f}" if ref else "-"
        bound = bandwidth / nbytes
        print(f"| {cached} | {policy} | {storage} | {tok_s:.1f} | {ratio} | {nbytes / 1e6:.0f} | {bound:.1f} "
              f"| {tok_s / bound:.0%} |", flush=True)  # fmt: skip
    print_ceilings(args, model, times, bandwidth)


def print_ceilings(
    args: argparse.Namespace, model: GPT, times: dict[tuple[int, str, str], list[float]], bandwidth: float
) -> None:
    """Per quantised storage, the most its dense step at `--cached` tokens could gain on float's with its KV pass at
    the memory's pace: the float step over (the rest of a step, taken as the dense float step at `--slots` slots,
    plus the storage's KV bytes at `--cached` at the bandwidth). An estimate: the quantised step's own extra work
    (quantising the new token) is left out."""
    short, long = (args.slots, "dense", "float"), (args.cached, "dense", "float")
    if short not in times or long not in times:
        return
    rest, float_step = statistics.median(times[short]), statistics.median(times[long])
    for storage in (s for s in args.storages if s != "float"):
        kv_bytes = step_bytes(model, storage, args.cached) - weights_read(model)
        ceiling = float_step / (rest + kv_bytes / bandwidth)
        print(f"ceiling: dense {storage} at {args.cached} cached tokens, its KV pass at the memory's pace: "
              f"{ceiling:.2f}x float (rest of the step {rest * 1e3:.1f} ms, KV {kv_bytes / 1e6:.0f} MB)")  # fmt: skip


def kl(args: argparse.Namespace, _bandwidth: float) -> None:
    """The `kl` table: mean KL(float || quantised) per token and top-1 agreement with the float model,
    teacher-forced over `--windows` windows of `--window` tokens of the shipped held-out text: one forward per
    window (the prefill's path), or with `--decode` one decode step per token after a `--prefix`-token prefill (the
    decode path: the C products, each quantised row also with float32 rows, `quant_rows.INT8_ACTIVATIONS` off)."""
    text = (Path(__file__).resolve().parents[1] / "litkv" / "assets" / "default" / "heldout.txt").read_text()
    ids = torch.tensor(load_tokenizer(args.checkpoint_dir).encode(text).tolist())
    starts = torch.linspace(0, len(ids) - args.window, args.windows).long().tolist()
    batch = torch.stack([ids[s : s + args.window] for s in starts])
    runs = [("none", True)] + [(w, True) for w in args.weights if w != "none"]
    if args.decode:
        runs += [(w, False) for w in args.weights if w != "none"]
    logp = {}
    for quant, int8_rows in runs:
        quant_rows.INT8_ACTIVATIONS = int8_rows
        model, _ = load_for_inference(args.checkpoint_dir, "32-true", "cpu", args.threads, quant)
        label = quant if int8_rows or quant == "none" else f"{quant} (float32 rows)"
        with torch.no_grad():
            logits = _decode_logits(model, batch, args.prefix) if args.decode else model(batch)
        logp[label] = torch.log_softmax(logits.double(), dim=-1)
    quant_rows.INT8_ACTIVATIONS = True
    if args.decode:  # quantised KV storages, float32 weights: the C decode kernel, then the PyTorch path
        model, _ = load_for_inference(args.checkpoint_dir, "32-true", "cpu", args.threads, "none")
        for storage, kernel in product((s for s in args.storages if s != "float"), (True, False)):
            cpu_decode.CPU_KERNEL = kernel
            with torch.no_grad():
                logits = _decode_logits(model, batch, args.prefix, storage)
            logp[f"none, {storage} KV ({'C kernel' if kernel else 'PyTorch path'})"] = torch.log_softmax(
                logits.double(), dim=-1
            )
        cpu_decode.CPU_KERNEL = True
    how = f"decode steps after a {args.prefix}-token prefill" if args.decode else "one forward per window"
    print(f"\nKL to the float32 model: {args.windows} windows of {args.window} tokens, teacher-forced, {how}")
    print(f"(the decode steps' rows quantised to int8 on this CPU: {quant_rows.rows_quantized()})")
    print("| weights | KL(float || quantised) nats/token | top-1 agreement |")
    print("|---|---|---|")
    ref = logp["none"]
    for quant, lp in logp.items():
        kl_tok = (ref.exp() * (ref - lp)).sum(dim=-1).mean().item()
        agree = (ref.argmax(-1) == lp.argmax(-1)).double().mean().item()
        print(f"| {quant} | {kl_tok:.5f} | {agree:.1%} |")


def _decode_logits(model: GPT, batch: torch.Tensor, prefix: int, storage: str = "float") -> torch.Tensor:
    """`(B, W - prefix, vocab)` logits: a dense cache of `storage`, the first `prefix` tokens of each row as one
    prefill, then every next token of `batch` `(B, W)` as one decode step (teacher-forced)."""
    rows, width = batch.shape
    positions = torch.arange(width).expand(rows, width)
    with model.kv_caches_attached(KVCacheConfig("dense", cache_length=width, storage=storage), rows):
        out = [model(batch[:, :prefix], positions[:, :prefix])[:, -1:]]
        for t in range(prefix, width - 1):
            out.append(model(batch[:, t : t + 1], positions[:, t : t + 1]))
    return torch.cat(out, dim=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("peers", "kv", "kl"))
    p.add_argument("--checkpoint_dir", type=Path, required=True, help="a checkpoint directory or a known name")
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF file llama.cpp reads (peers)")
    p.add_argument("--llamacpp_python", default=None, help="python of an environment with llama-cpp-python")
    p.add_argument("--prompts", default="512,3500", help="prompt lengths, comma-separated (peers)")
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--slots", type=int, default=512, help="h2o slots (peers); the short length (kv)")
    p.add_argument("--cached", type=int, default=16384, help="cached tokens (kv)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per row (kv)")
    p.add_argument("--window", type=int, default=512, help="tokens per window (kl)")
    p.add_argument("--windows", type=int, default=4, help="windows (kl)")
    p.add_argument("--decode", action="store_true", help="kl: teacher-forced decode steps, not one forward")
    p.add_argument("--prefix", type=int, default=64, help="kl --decode: tokens prefilled before the decode steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--weights", default="none,int8,int4", help="litkv --quantize values (kv: the first)")
    p.add_argument("--storages", default="float,int8,int4")
    p.add_argument("--policies", default="dense,h2o")
    p.add_argument("--kv_types", default="f16,q8_0,q4_0", help="llama.cpp KV cache types")
    p.add_argument(
        "--cpu_kernel",
        choices=("on", "off", "both"),
        default="on",
        help="kv: quantised KV through the CPU decode kernel, the PyTorch path (STORAGE-torch rows), or both; "
        "peers: quantised weights' decode rows through the C products, PyTorch's packed kernels, or both",
    )
    p.add_argument(
        "--compile",
        choices=("off", "on", "both"),
        default="off",
        help="peers: litkv's decode steps eager, through torch.compile ('(compiled)' rows, compiled before the "
        "timed runs), or both",
    )
    args = p.parse_args(argv)
    args.prompts = [int(x) for x in args.prompts.split(",")]
    for name in ("weights", "storages", "policies", "kv_types"):
        setattr(args, name, getattr(args, name).split(","))
    if args.part == "peers" and args.llamacpp_python and args.gguf is None:
        p.error("--llamacpp_python needs --gguf")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.checkpoint_dir = resolve_checkpoint_dir(args.checkpoint_dir)
    bandwidth = measure_bandwidth(2**29, threads=args.threads)
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s ({args.threads} thread(s), measured in this run)")
    {"peers": peers, "kv": kv, "kl": kl}[args.part](args, bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
