"""Decode speed on a CPU: litkv against llama.cpp on the same GGUF checkpoint, in the same run.

llama.cpp (through `llama-cpp-python`) runs in its own environment, as a subprocess started with
`--llamacpp_python`; litkv runs in this process on the checkpoint `litkv convert` (or `litkv download`)
made of the same GGUF file. Both decode greedily from the same token ids, one row, with the same
thread count, and every measurement alternates between the two (llama.cpp, litkv, llama.cpp, ...) so
that both see the same load on a shared machine.

Rows:

- llama.cpp with its `f16`, `q8_0` and `q4_0` KV caches (weights as in the GGUF file: Q4_1, embedding
  Q8_0; a quantised V cache needs flash attention, so every llama.cpp row runs with it);
- litkv (float32 weights, dequantised by the converter): `dense`, `h2o` with `--cache_length` slots,
  and `h2o` on `int8` and `int4` storage.

Decode tok/s is the number of decode steps over their time (the prompt's prefill is timed apart and
printed as prefill tok/s). The memory bandwidth is measured in the same run (`litkv.eval.bandwidth`) and
each litkv row shows the bytes a step reads (weights + cache) and the tok/s that bandwidth allows.

    python3 -m venv ../venv-llamacpp    # llama.cpp is built from source; GGML_NATIVE=OFF: the native build
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_INT8=OFF" \\
        ../venv-llamacpp/bin/pip install llama-cpp-python==0.3.36   # (dies with SIGILL on some VMs)
    litkv download smollm2-135m-instruct
    python scripts/bench_llamacpp.py --gguf ~/.cache/litkv/gguf/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --checkpoint_dir smollm2-135m-instruct \\
        --llamacpp_python ../venv-llamacpp/bin/python --prompts 512,4096 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.cli.common import resolve_checkpoint_dir
from litkv.eval.bandwidth import measure_bandwidth
from litkv.inference.generate import generate
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.weight_layout import columns_contiguous

# Runs inside the llama.cpp environment: argv[1] is a JSON job; prints one JSON line with the timings.
LLAMACPP_WORKER = r"""
import json, sys, time
import llama_cpp, numpy
job = json.loads(sys.argv[1])
types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=job["threads"],
                      n_threads_batch=job["threads"], n_batch=512, type_k=types[job["kv"]],
                      type_v=types[job["kv"]], flash_attn=True, verbose=False, logits_all=False)
ids = job["ids"]
t0 = time.perf_counter(); llm.eval(ids); t1 = time.perf_counter()
out, steps = [], []
for _ in range(job["new"]):
    last = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # the logits of the last token evaluated
    tok = int(numpy.ctypeslib.as_array(last, shape=(llm.n_vocab(),)).argmax())  # greedy
    out.append(tok)
    s = time.perf_counter(); llm.eval([tok]); steps.append(time.perf_counter() - s)
print(json.dumps({"prefill_s": t1 - t0, "steps": steps, "tokens": out, "version": llama_cpp.__version__}))
"""


def run_llamacpp(python: str, gguf: Path, ids: list[int], new: int, kv: str, threads: int) -> dict:
    """One llama.cpp generation in its own environment; the worker's JSON result."""
    job = {"gguf": str(gguf), "ids": ids, "new": new, "kv": kv, "threads": threads, "n_ctx": len(ids) + new + 16}
    proc = subprocess.run([python, "-c", LLAMACPP_WORKER, json.dumps(job)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed ({kv}): {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def litkv_config(name: str, prompt: int, new: int, cache_length: int) -> KVCacheConfig:
    """`dense` (room for prompt and reply), or `h2o[-int8|-int4]` with `cache_length` slots."""
    if name == "dense":
        return KVCacheConfig(policy="dense", cache_length=prompt + new)
    storage = name.split("-")[1] if "-" in name else "float"
    return KVCacheConfig(policy="h2o", cache_length=min(cache_length, prompt + new), storage=storage)


def run_litkv(model: torch.nn.Module, ids: list[int], new: int, config: KVCacheConfig) -> dict:
    """One greedy litkv generation: prefill time (to the first token) and each decode step's time."""
    stamps: list[float] = []
    start = time.perf_counter()
    out = generate(model, [torch.tensor(ids)], new + 1, config, on_tokens=lambda _t: stamps.append(time.perf_counter()))
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"prefill_s": stamps[0] - start, "steps": steps, "tokens": out[0].tolist()}


def step_bytes(model: torch.nn.Module, config: KVCacheConfig, prompt: int, new: int) -> float:
    """Bytes one decode step reads: every weight once, plus the cached keys and values (mean over the decode)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    per_token = 2 * cfg.n_layer * cfg.n_query_groups * cfg.head_size
    bytes_per = {"float": 4.0, "int8": 1.0 + 8 / 64, "int4": 0.5 + 8 / 64}[config.storage]
    tokens = prompt + new / 2 if config.policy == "dense" else config.cache_length
    return weights + per_token * tokens * bytes_per


def summarize(runs: list[dict]) -> tuple[float, float]:
    """Median decode tok/s and median prefill tok/s over repeated runs (`steps`, `prefill_s`, `n`)."""
    decode = statistics.median(len(r["steps"]) / sum(r["steps"]) for r in runs)
    prefill = statistics.median(r["n"] / r["prefill_s"] for r in runs)
    return decode, prefill


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True, help="the GGUF file llama.cpp reads")
    p.add_argument("--checkpoint_dir", type=Path, required=True, help="litkv's conversion of the same file")
    p.add_argument("--llamacpp_python", default=None, help="python of an environment with llama-cpp-python")
    p.add_argument("--prompts", default="512,4096", help="prompt lengths, comma-separated")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--cache_length", type=int, default=512, help="slots of the h2o rows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv_types", default="f16,q8_0,q4_0", help="llama.cpp KV cache types")
    p.add_argument("--policies", default="dense,h2o,h2o-int8,h2o-int4", help="litkv rows")
    p.add_argument("--json_out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.checkpoint_dir = resolve_checkpoint_dir(args.checkpoint_dir)  # a known model's name works too
    model = columns_contiguous(load_model(args.checkpoint_dir, device=torch.device("cpu"), dtype=torch.float32))
    bandwidth = measure_bandwidth(threads=args.threads)
    text = (Path(__file__).resolve().parents[1] / "litkv" / "assets" / "default" / "heldout.txt").read_text()
    text_ids = load_tokenizer(args.checkpoint_dir).encode(text).tolist()
    results: dict[str, dict] = {}
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s ({args.threads} threads)")
    for prompt in (int(x) for x in args.prompts.split(",")):
        ids = (text_ids * (prompt // len(text_ids) + 1))[:prompt]  # natural text, repeated if short
        rows: dict[str, list[dict]] = {}
        for _ in range(args.repeats):
            for kv in args.kv_types.split(",") if args.llamacpp_python else []:
                r = run_llamacpp(args.llamacpp_python, args.gguf, ids, args.new_tokens, kv, args.threads)
                rows.setdefault(f"llama.cpp {kv}", []).append({**r, "n": prompt})
            for name in args.policies.split(","):
                cfg = litkv_config(name, prompt, args.new_tokens, args.cache_length)
                run = run_litkv(model, ids, args.new_tokens, cfg)
                rows.setdefault(f"litkv {name}", []).append({**run, "n": prompt})
        print(f"\nprompt {prompt} tokens, {args.new_tokens} new, {args.threads} threads, median of {args.repeats}")
        print("| row | decode tok/s | vs llama.cpp f16 | prefill tok/s | MB/step | bound tok/s |")
        print("|---|---|---|---|---|---|")
        ref = summarize(rows["llama.cpp f16"])[0] if "llama.cpp f16" in rows else None
        for name, runs in rows.items():
            decode, prefill = summarize(runs)
            ratio = f"{decode / ref:.2f}" if ref else "-"
            mb, bound = "-", "-"
            if name.startswith("litkv"):
                nbytes = step_bytes(model, litkv_config(name[6:], prompt, args.new_tokens, args.cache_length),
                                    prompt, args.new_tokens)  # fmt: skip
                mb, bound = f"{nbytes / 1e6:.0f}", f"{bandwidth / nbytes:.1f}"
            print(f"| {name} | {decode:.1f} | {ratio} | {prefill:.0f} | {mb} | {bound} |")
            results[f"{prompt}/{name}"] = {"decode_tok_s": decode, "prefill_tok_s": prefill}
        if "llama.cpp f16" in rows and "litkv dense" in rows:
            theirs, ours = rows["llama.cpp f16"][0]["tokens"], rows["litkv dense"][0]["tokens"]
            same = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), len(theirs))
            print(f"greedy tokens: llama.cpp f16 (Q4_1) and litkv dense (dequantized) agree on the first {same}")
        sys.stdout.flush()
    if args.json_out:
        args.json_out.write_text(json.dumps({"bandwidth": bandwidth, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
