"""`litkv bench`: decode speed and peak memory of litkv (dense cache) against Hugging Face
`transformers` and LitGPT (the peers and their timing: `litkv.eval.peers`), each run in a fresh subprocess.

Each row also shows the bytes a decode step reads (weights once, plus the keys and values of the
tokens cached halfway through the decode: `litkv.eval.bandwidth`), the machine's memory bandwidth measured
in the same run with the same thread count, the bound tokens/s they give, and the fraction reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from litkv.core.atomic import write_text_atomic
from litkv.core.validation import is_int
from litkv.eval.bandwidth import bytes_per_step, kv_bytes_per_token, measure_bandwidth
from litkv.eval.peers import COMPILED, PEERS, BenchResult, prepare_weights
from litkv.modeling.quant_weights import layer_quant, parse_quantize, stored_weight_bytes

__all__ = ["bench", "format_table"]

#: This command, read by litkv/__main__.py from the source (never imported for it): `CommandSpec`.
COMMAND = {"name": "bench", "function": "bench"}


def _run_subprocess(args: dict) -> BenchResult:
    code = "from litkv.eval.peers import worker_main; worker_main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, env=os.environ.copy()
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark worker {args['peer']} failed:\n{proc.stderr[-3000:]}")
    return BenchResult(**json.loads(lines[-1][len("RESULT ") :]))


def _median_of(results: list[BenchResult]) -> list[BenchResult]:
    """Per (prompt length, peer), the round of median decode speed (the slower middle one of an even count), in
    first-seen order; a round's figures stay together."""
    rounds: dict[tuple[int, str], list[BenchResult]] = {}
    for r in results:
        rounds.setdefault((r.prompt_len, r.peer), []).append(r)
    return [sorted(runs, key=lambda r: r.decode_tok_s)[(len(runs) - 1) // 2] for runs in rounds.values()]


def _ratio(num: float, den: float, digits: int = 2) -> str:
    return f"{num / den:.{digits}f}" if den > 0 and num > 0 else "-"


def _row(r: BenchResult, ours: BenchResult | None) -> str:
    """One table row; ratios against `ours` (litkv eager at the same prompt length), `-` where unknown."""
    if not r.available:
        return f"| {r.prompt_len} | {r.peer} | {r.note} |" + " - |" * 13
    ref = ours if ours is not None and ours.available else None
    bound = r.bound_tok_s
    peer = r.peer if r.quantize == "none" else f"{r.peer} ({r.quantize} weights)"
    cells = [
        f"{r.prefill_s:.2f}",
        "-" if r.compile_s is None else f"{r.compile_s:.1f}",
        f"{r.decode_tok_s:.1f}",
        f"{r.step_bytes / 1e6:.0f}" if r.step_bytes else "-",
        f"{bound:.1f}" if bound else "-",
        f"{r.decode_tok_s / bound:.0%}" if bound else "-",
        f"{r.peak_mb:.0f}",
        f"{r.generation_mb:.0f}",
        _ratio(ref.decode_tok_s, r.decode_tok_s) if ref else "-",
        _ratio(ref.peak_mb, r.peak_mb) if ref else "-",
        _ratio(ref.generation_mb, max(r.generation_mb, 1.0)) if ref else "-",
        f"{r.end_to_end_s:.2f}",
        _ratio(r.end_to_end_s, ref.end_to_end_s) if ref else "-",
        ("yes" if r.tokens == ref.tokens else "no") if ref else "-",
    ]
    return f"| {r.prompt_len} | {peer} | " + " | ".join(cells) + " |"


def format_table(results: list[BenchResult]) -> str:
    """Markdown table with litkv/peer ratios (speed: higher is better; memory: lower is better).

    `compile s`: compiled peers' compilation time (warm-up call minus the same work timed).
    `MB/step`: bytes a decode step reads (weights + cached keys and values, in 10^6 bytes);
    `bound tok/s`: the measured bandwidth over that; `of bound`: decode tok/s as a fraction of it.
    `peak MB` is the process's peak resident set during generation (weights and libraries included);
    `gen MB` is that peak minus the resident set just before generation (what generating needs); for
    compiled peers both include the warm-up call and its compilation.
    `end to end s`: the prefill and every decode step (the call to its last token); `litkv/peer end to end`: the
    peer's over litkv's (higher: litkv is faster).
    `same tokens`: the greedy tokens equal litkv's (eager) at the same prompt length.
    litkv's rows name their weight quantisation when it is not `none` (`--quantize`); the peers' weights
    are float, so their `same tokens` then compares against the quantised litkv row.
    """
    rows = [
        "| prompt | peer | prefill s | compile s | decode tok/s | MB/step | bound tok/s | of bound | peak MB | gen MB "
        "| litkv/peer tok/s | litkv/peer peak | litkv/peer gen | end to end s | litkv/peer end to end | same tokens |",
        "|" + "---|" * 16,
    ]
    for r in results:
        ours = next((x for x in results if x.peer == "litkv" and x.prompt_len == r.prompt_len), None)
        rows.append(_row(r, ours))
    return "\n".join(rows)


def _check_options(lengths: list[int], max_new_tokens: int, chunk_size: int, threads: int | None, repeats: int) -> None:
    """ValueError naming the option and the value, before any weights are written."""
    if not lengths:
        raise ValueError("prompt_lengths must be a non-empty list of ints >= 1, got []")
    for n in lengths:
        if not is_int(n) or n < 1:
            raise ValueError(f"prompt_lengths must be ints >= 1, got {n!r} in {lengths}")
    if not is_int(max_new_tokens) or max_new_tokens < 2:
        raise ValueError(
            f"max_new_tokens must be an int >= 2 (a decode speed needs a step after the first token), "
            f"got {max_new_tokens!r}"
        )
    for name, value in (("chunk_size", chunk_size), ("repeats", repeats)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if threads is not None and (not is_int(threads) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")


def _step_bytes(model: str, prompt_len: int, new: int, quantize: str = "none") -> float:
    """Bytes a decode step reads halfway through the decode (float32 weights, LM head tied to the embedding).

    `quantize` other than `"none"`: every linear weight (LM head included; int8 under int4) as its stored codes and
    scales (`stored_weight_bytes`) instead of float32; the embedding then adds only the row it reads.
    """
    from litgpt.config import Config

    from litkv.eval.bandwidth import weight_bytes
    from litkv.modeling.model import GPT

    quant = parse_quantize(quantize)
    config = Config.from_name(model)
    with torch.device("meta"):
        meta = GPT(config)
    meta.lm_head.weight = meta.transformer.wte.weight  # tied, as the benchmark's weights are
    weights = weight_bytes(meta)
    if quant.mode != "none":
        for name, linear in ((n, m) for n, m in meta.named_modules() if isinstance(m, torch.nn.Linear)):
            stored = stored_weight_bytes(linear.out_features, linear.in_features, layer_quant(name, quant))
            weights += stored - linear.weight.nbytes
    per_token = kv_bytes_per_token(config.n_layer, config.n_query_groups, config.head_size, 4)
    return bytes_per_step(weights, per_token, prompt_len + new / 2)


def _resolve_peers(peers: list[str] | None, quick: bool) -> list[str]:
    """litkv first (the ratios need it); by default every peer (`quick`: no compiled peer)."""
    if peers is None:
        peers = [p for p in PEERS if not (quick and p in COMPILED)]
    for p in peers:
        if p not in PEERS:
            raise ValueError(f"peers must be among {list(PEERS)}, got {p!r}")
    return ["litkv"] + [p for p in peers if p != "litkv"]


def _measure_all(
    model: str, lengths: list[int], chosen: list[str], new: int, chunk: int, seed: int, threads: int | None,
    weights_dir: Path | None, repeats: int, quantize: str,
) -> list[BenchResult]:  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp) if weights_dir is None else weights_dir / f"{model}-seed{seed}"
        if (workdir / "litgpt" / "model.safetensors").is_file():
            hf_dir, lit_dir = workdir / "hf", workdir / "litgpt"
        else:
            hf_dir, lit_dir = prepare_weights(model, seed, workdir)
        for _ in range(repeats):
            for n in lengths:
                for peer in chosen:
                    args = dict(
                        peer=peer,
                        model=model,
                        hf_dir=str(hf_dir),
                        lit_dir=str(lit_dir),
                        prompt_len=n,
                        new=new,
                        chunk=chunk,
                        seed=seed,
                        threads=threads,
                        quantize=quantize,
                    )
                    r = _run_subprocess(args)
                    what = r.note or f"{r.decode_tok_s:.1f} tok/s, {r.peak_mb:.0f} MB peak"
                    print(f"{peer:>17} prompt={n}: {what}", flush=True)
                    results.append(r)
    return results


def bench(
    model: str = "SmolLM2-135M",
    prompt_lengths: list[int] | None = None,
    max_new_tokens: int = 128,
    peers: list[str] | None = None,
    chunk_size: int = 512,
    seed: int = 0,
    threads: int | None = None,
    json_out: Path | None = None,
    weights_dir: Path | None = None,
    repeats: int = 1,
    quick: bool = False,
    quantize: str = "none",
) -> list[BenchResult]:
    """Greedy decoding speed and peak memory of litkv (dense cache) against HF transformers and LitGPT,
    each as a fraction of the memory-bandwidth bound measured in the same run.

    Args:
        model: LitGPT preset name of a Llama-family architecture (random weights).
        prompt_lengths: prompt lengths to measure (default 512, 2048, 4096).
        max_new_tokens: tokens generated per run.
        peers: which of litkv, litkv-compile, hf, hf-static-compile, litgpt to run (default all; litkv
            always runs, ratios need it). Compiled peers make one untimed warm-up call first.
        chunk_size: litkv prefill chunk size.
        seed: seed of the weights and the prompt.
        threads: torch threads per worker and for the bandwidth measurement (default: torch's default).
        json_out: also write the results as JSON here.
        weights_dir: keep the random weights here and reuse them on the next run (default: a temporary
            directory).
        repeats: rounds over all (length, peer) runs; each row is the round of its median decode speed
            (rounds interleave the peers, so a busy moment of the machine hits them alike).
        quick: a smoke test: prompt 32, 8 new tokens, no compiled peer unless `peers` names one
            (explicit `prompt_lengths` still apply).
        quantize: litkv's own rows load the weights quantised (`"none"`, `"int8"`, `"int4"`, `"int4-gN"`:
            `litkv.modeling.quant_weights`, CPU only); the other peers run the float weights.
    """
    if quick:
        prompt_lengths = [32] if prompt_lengths is None else prompt_lengths
        max_new_tokens = 8
    lengths = [512, 2048, 4096] if prompt_lengths is None else list(prompt_lengths)
    _check_options(lengths, max_new_tokens, chunk_size, threads, repeats)
    parse_quantize(quantize)  # a bad value is refused before any weights are written
    chosen = _resolve_peers(peers, quick)
    gib = 2**28 if quick else 2**30
    bandwidth = measure_bandwidth(gib, threads=threads)
    results = _measure_all(
        model, lengths, chosen, max_new_tokens, chunk_size, seed, threads, weights_dir, repeats, quantize
    )
    bandwidth = max(bandwidth, measure_bandwidth(gib, threads=threads))  # best of before and after
    used = threads or torch.get_num_threads()
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s (sum of {gib // 2**20} MiB, {used} threads)")
    results = _median_of(results)
    for r in results:
        if r.available:
            r.step_bytes, r.bandwidth = _step_bytes(model, r.prompt_len, r.new_tokens, r.quantize), bandwidth
    print(format_table(results))
    if json_out is not None:
        write_text_atomic(json_out, json.dumps([asdict(r) for r in results], indent=2))
    return results
