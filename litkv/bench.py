"""Decode benchmark: litkv (dense cache) against Hugging Face `transformers` and LitGPT.

The same random weights (a Llama-family LitGPT preset, SmolLM2-135M by default) are written once in
both formats; each (peer, prompt length) then runs greedy decoding in a fresh subprocess, so peak
memory (the process's resident high-water mark, reset after loading the weights) is measured alone.

Every peer is timed the same way: a timestamp before the call and one at each streamed token
(`on_tokens` for litkv, a streamer for transformers, the generator for LitGPT). Prefill is the time
to the first token; decode tokens/s is the steps between the first and the last token over the time
between them. Compiled peers (`litkv-compile`: `generate(..., compile=True)`; `hf-static-compile`:
transformers with a `StaticCache` and `torch.compile` of the forward, the Hugging Face tutorial's
setup) first make one untimed warm-up call with the same prompt and cache shapes; `compile s` is
that call's time minus what the timed call took for the same work.

Each row also shows the bytes a decode step reads (weights once, plus the keys and values of the
tokens cached halfway through the decode: `litkv.bandwidth`), the machine's memory bandwidth measured
in the same run with the same thread count, the bound tokens/s they give, and the fraction reached.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from litkv.atomic import save_dir_atomic, write_atomic, write_text_atomic
from litkv.bandwidth import bound_tokens_per_s, bytes_per_step, kv_bytes_per_token, measure_bandwidth

if TYPE_CHECKING:
    from litgpt.config import Config

__all__ = ["BenchResult", "bench", "format_table", "hf_generate", "load_hf", "load_lit", "prepare_weights", "run_peer"]

PEERS = ("litkv", "litkv-compile", "hf", "hf-static-compile", "litgpt")
COMPILED = ("litkv-compile", "hf-static-compile")
WARMUP_TOKENS = 4  # new tokens of a compiled peer's untimed warm-up call


@dataclass
class BenchResult:
    """One (peer, prompt length) measurement."""

    peer: str
    prompt_len: int
    new_tokens: int
    prefill_s: float
    decode_tok_s: float
    peak_mb: float
    generation_mb: float
    tokens: list[int]
    compile_s: float | None = None  # compiled peers: warm-up call minus the timed call's same work
    step_bytes: float = 0.0  # bytes one decode step reads (weights + cached keys and values)
    bandwidth: float = 0.0  # bytes/s measured in the same run
    note: str = ""  # why a peer did not run ("not available: ..."); its figures are then 0

    @property
    def available(self) -> bool:
        return not self.note

    @property
    def bound_tok_s(self) -> float:
        """Decode tokens/s if a step only read `step_bytes` at `bandwidth` (0 when either is unknown)."""
        if self.step_bytes <= 0 or self.bandwidth <= 0:
            return 0.0
        return bound_tokens_per_s(self.bandwidth, self.step_bytes)


class PeerUnavailable(RuntimeError):
    """A peer that cannot run in this installation (reported as a row, not an error)."""


def _config(model: str | Config) -> Config:
    """The LitGPT config of preset name `model`, or `model` itself (a preset with overrides)."""
    from litgpt.config import Config

    return Config.from_name(model) if isinstance(model, str) else model


def prepare_weights(model_name: str | Config, seed: int, workdir: Path) -> tuple[Path, Path]:
    """Write random weights for preset `model_name` (a name or a `Config`) as a HF model dir and a LitGPT
    safetensors file."""
    from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = _config(model_name)
    if config.mlp_class_name != "LLaMAMLP" or config.norm_class_name != "RMSNorm" or config.bias:
        raise ValueError(f"the decode benchmark supports Llama-family presets, got {config.name!r}")
    hf_config = LlamaConfig(
        vocab_size=config.padded_vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_query_groups,
        head_dim=config.head_size,
        max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps,
        rope_theta=float(config.rope_base),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    hf_model = LlamaForCausalLM(hf_config)
    hf_dir, lit_dir = workdir / "hf", workdir / "litgpt"
    save_dir_atomic(hf_dir, hf_model.save_pretrained)
    state_dict: dict[str, torch.Tensor] = {}
    hf_weights = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    copy_weights_hf_llama(config, {}, state_dict, hf_weights)
    state_dict = {k: v.contiguous().clone() for k, v in state_dict.items()}
    lit_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(lit_dir / "model.safetensors", lambda tmp: save_file(state_dict, str(tmp)))
    return hf_dir, lit_dir


_BASELINE_MB: list[float] = []


def _reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark of this process (Linux); remember the RSS."""
    write_text_atomic("/proc/self/clear_refs", "5")  # a kernel file: written in place
    _BASELINE_MB.append(_status_mb("VmRSS"))


def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmHWM: peak resident set, VmRSS: current), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def load_lit(model_name: str | Config, lit_dir: Path, cls: type[torch.nn.Module]) -> torch.nn.Module:
    """The weights `prepare_weights` wrote under `lit_dir` in a `cls` (litkv's or LitGPT's `GPT`), eval mode."""
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = cls(_config(model_name))
    model.load_state_dict(load_file(str(lit_dir / "model.safetensors")), assign=True)
    # Share the embedding with the LM head where they are equal (tied weights), as HF does.
    if torch.equal(model.lm_head.weight, model.transformer.wte.weight):
        model.lm_head.weight = model.transformer.wte.weight
    return model.eval()


Timed = tuple[list[float], list[int]]


@dataclass
class _Warmup:
    """Timestamps of a compiled peer's untimed warm-up call (before the call, then one per token)."""

    stamps: list[float]


def _litkv_compile_available() -> bool:
    from litkv import generate

    return "compile" in inspect.signature(generate).parameters


def _time_litkv(
    model_name: str, lit_dir: Path, prompt: torch.Tensor, new: int, chunk: int, compile: bool, warmups: list[_Warmup]
) -> Timed:
    from litkv import GPT, KVCacheConfig, generate

    if compile and not _litkv_compile_available():
        raise PeerUnavailable("not available: litkv.generate has no compile option in this version")
    model = load_lit(model_name, lit_dir, GPT)
    cfg = KVCacheConfig(cache_length=prompt.numel() + new, chunk_size=min(chunk, prompt.numel() + new))
    options = {"compile": True} if compile else {}
    _reset_peak_rss()  # compiled: before the warm-up, so that the peak includes compilation
    if compile:  # same prompt and cache shapes as the timed call, fewer new tokens
        warm = [time.perf_counter()]
        generate(
            model,
            [prompt],
            min(new, WARMUP_TOKENS),
            cfg,
            on_tokens=lambda t: warm.append(time.perf_counter()),
            **options,
        )
        warmups.append(_Warmup(warm))
    stamps = [time.perf_counter()]
    out = generate(model, [prompt], new, cfg, on_tokens=lambda t: stamps.append(time.perf_counter()), **options)
    return stamps, out[0].tolist()


def _time_litgpt(model_name: str, lit_dir: Path, prompt: torch.Tensor, new: int) -> Timed:
    from litgpt.generate.base import generate_fn
    from litgpt.model import GPT as LitGPT

    model = load_lit(model_name, lit_dir, LitGPT)
    model.cos, model.sin = model.rope_cache(device=torch.device("cpu"))  # non-persistent buffers
    model.max_seq_length = prompt.numel() + new
    with torch.device("cpu"):
        model.set_kv_cache(batch_size=1)
    _reset_peak_rss()
    stamps, tokens = [time.perf_counter()], []
    max_returned = prompt.numel() + new
    for token in generate_fn(model, prompt, max_returned, temperature=0.0, include_prompt=False, include_eos=True):
        stamps.append(time.perf_counter())
        tokens.extend(token.view(-1).tolist())
    return stamps, tokens


class _Stamps:
    """A transformers streamer that keeps a timestamp per `put` and the generated tokens.

    `generate` puts the prompt first (before the prefill), then each new token.
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())
        if len(self.stamps) > 1:
            self.tokens.extend(value.view(-1).tolist())

    def end(self) -> None:
        pass


class Streamer(Protocol):
    """What transformers' `generate` calls: `put` with the prompt first (before the prefill), then each
    new token; `end` once done."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


def load_hf(hf_dir: Path, static_compile: bool = False) -> torch.nn.Module:
    """The `LlamaForCausalLM` that `prepare_weights` wrote under `hf_dir` (float32, eval mode); with
    `static_compile`, its forward goes through `torch.compile` (see `_time_hf`)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if static_compile:
        mode = "reduce-overhead" if model.device.type == "cuda" else None
        model.forward = torch.compile(model.forward, mode=mode, fullgraph=True, dynamic=False)
    return model


def hf_generate(
    model: torch.nn.Module, prompts: torch.Tensor, n_new: int, streamer: Streamer, static_len: int | None = None
) -> None:
    """Greedy `n_new` tokens for the equal-length `prompts` (B, T) with transformers' default (dynamic)
    cache, or a fresh `StaticCache` of `static_len` slots."""
    from transformers import StaticCache

    extra = {}
    if static_len is not None:
        extra["past_key_values"] = StaticCache(config=model.config, max_cache_len=static_len)
    with torch.inference_mode():
        model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            streamer=streamer,
            pad_token_id=0,
            **extra,
        )


def _time_hf(hf_dir: Path, prompt: torch.Tensor, new: int, static_compile: bool, warmups: list[_Warmup]) -> Timed:
    """transformers' default (dynamic) cache, or a `StaticCache` with `torch.compile` of the forward.

    The compiled setup is the Hugging Face tutorial's (`fullgraph=True`; CUDA graphs through
    `mode="reduce-overhead"` on a GPU), with `dynamic=False` so that the decode step gets its own
    static-shape graph; each call gets a fresh `StaticCache` of `prompt + new` slots, so the warm-up
    call compiles exactly the graphs the timed call uses.
    """
    model = load_hf(hf_dir, static_compile)
    static_len = prompt.numel() + new if static_compile else None
    _reset_peak_rss()  # compiled: before the warm-up, so that the peak includes compilation
    if static_compile:
        warm = _Stamps()
        hf_generate(model, prompt[None], min(new, WARMUP_TOKENS), warm, static_len)
        warmups.append(_Warmup(warm.stamps))
    timed = _Stamps()
    hf_generate(model, prompt[None], new, timed, static_len)
    return timed.stamps, timed.tokens


def _compile_seconds(warmups: list[_Warmup], prefill: float, step: float) -> float | None:
    """The warm-up call's time minus what the timed call took for the same work (prefill + its steps)."""
    if not warmups:
        return None
    stamps = warmups[-1].stamps
    return (stamps[-1] - stamps[0]) - (prefill + step * (len(stamps) - 2))


def run_peer(
    peer: str, model_name: str, hf_dir: Path, lit_dir: Path, prompt_len: int, new: int, chunk: int, seed: int
) -> BenchResult:
    """Measure one peer in this process (meant to run in a fresh subprocess).

    A peer that cannot run here (`litkv-compile` before `generate` has `compile`) comes back as a row
    whose `note` says why.
    """
    from litgpt.config import Config

    vocab = Config.from_name(model_name).vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    warmups: list[_Warmup] = []
    try:
        if peer in ("litkv", "litkv-compile"):
            stamps, tokens = _time_litkv(model_name, lit_dir, prompt, new, chunk, peer == "litkv-compile", warmups)
        elif peer == "litgpt":
            stamps, tokens = _time_litgpt(model_name, lit_dir, prompt, new)
        elif peer in ("hf", "hf-static-compile"):
            stamps, tokens = _time_hf(hf_dir, prompt, new, peer == "hf-static-compile", warmups)
        else:
            raise ValueError(f"peer must be one of {list(PEERS)}, got {peer!r}")
    except PeerUnavailable as exc:
        return BenchResult(peer, prompt_len, 0, 0.0, 0.0, 0.0, 0.0, [], note=str(exc))
    peak = _status_mb("VmHWM")
    if len(stamps) < 3 or stamps[-1] <= stamps[1]:
        raise RuntimeError(f"{peer} produced {len(stamps) - 1} tokens: no decode step was timed")
    prefill = stamps[1] - stamps[0]
    step = (stamps[-1] - stamps[1]) / (len(stamps) - 2)
    return BenchResult(
        peer,
        prompt_len,
        len(stamps) - 1,
        prefill,
        1.0 / step,
        peak,
        peak - _BASELINE_MB[-1],
        tokens,
        compile_s=_compile_seconds(warmups, prefill, step),
    )


def _worker_main() -> None:
    """Subprocess entry: arguments as JSON in argv[1], the result as one JSON line on stdout."""
    args = json.loads(sys.argv[1])
    if args.get("threads"):
        torch.set_num_threads(args["threads"])
    result = run_peer(
        args["peer"],
        args["model"],
        Path(args["hf_dir"]),
        Path(args["lit_dir"]),
        args["prompt_len"],
        args["new"],
        args["chunk"],
        args["seed"],
    )
    print("RESULT " + json.dumps(asdict(result)))


def _run_subprocess(args: dict) -> BenchResult:
    code = "from litkv.bench import _worker_main; _worker_main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, env=os.environ.copy()
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark worker {args['peer']} failed:\n{proc.stderr[-3000:]}")
    return BenchResult(**json.loads(lines[-1][len("RESULT ") :]))


def _best_of(results: list[BenchResult]) -> list[BenchResult]:
    """Per (prompt length, peer), the run with the fastest decode, in first-seen order."""
    best: dict[tuple[int, str], BenchResult] = {}
    for r in results:
        key = (r.prompt_len, r.peer)
        if key not in best or r.decode_tok_s > best[key].decode_tok_s:
            best[key] = r
    return list(best.values())


def _ratio(num: float, den: float, digits: int = 2) -> str:
    return f"{num / den:.{digits}f}" if den > 0 and num > 0 else "-"


def _row(r: BenchResult, ours: BenchResult | None) -> str:
    """One table row; ratios against `ours` (litkv eager at the same prompt length), `-` where unknown."""
    if not r.available:
        return f"| {r.prompt_len} | {r.peer} | {r.note} |" + " - |" * 11
    ref = ours if ours is not None and ours.available else None
    bound = r.bound_tok_s
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
        ("yes" if r.tokens == ref.tokens else "no") if ref else "-",
    ]
    return f"| {r.prompt_len} | {r.peer} | " + " | ".join(cells) + " |"


def format_table(results: list[BenchResult]) -> str:
    """Markdown table with litkv/peer ratios (speed: higher is better; memory: lower is better).

    `compile s`: compiled peers' compilation time (warm-up call minus the same work timed).
    `MB/step`: bytes a decode step reads (weights + cached keys and values, in 10^6 bytes);
    `bound tok/s`: the measured bandwidth over that; `of bound`: decode tok/s as a fraction of it.
    `peak MB` is the process's peak resident set during generation (weights and libraries included);
    `gen MB` is that peak minus the resident set just before generation (what generating needs); for
    compiled peers both include the warm-up call and its compilation.
    `same tokens`: the greedy tokens equal litkv's (eager) at the same prompt length.
    """
    rows = [
        "| prompt | peer | prefill s | compile s | decode tok/s | MB/step | bound tok/s | of bound | peak MB | gen MB "
        "| litkv/peer tok/s | litkv/peer peak | litkv/peer gen | same tokens |",
        "|" + "---|" * 14,
    ]
    for r in results:
        ours = next((x for x in results if x.peer == "litkv" and x.prompt_len == r.prompt_len), None)
        rows.append(_row(r, ours))
    return "\n".join(rows)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_options(lengths: list[int], max_new_tokens: int, chunk_size: int, threads: int | None, repeats: int) -> None:
    """ValueError naming the option and the value, before any weights are written."""
    if not lengths:
        raise ValueError("prompt_lengths must be a non-empty list of ints >= 1, got []")
    for n in lengths:
        if not _is_int(n) or n < 1:
            raise ValueError(f"prompt_lengths must be ints >= 1, got {n!r} in {lengths}")
    if not _is_int(max_new_tokens) or max_new_tokens < 2:
        raise ValueError(
            f"max_new_tokens must be an int >= 2 (a decode speed needs a step after the first token), "
            f"got {max_new_tokens!r}"
        )
    for name, value in (("chunk_size", chunk_size), ("repeats", repeats)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if threads is not None and (not _is_int(threads) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")


def _step_bytes(model: str, prompt_len: int, new: int) -> float:
    """Bytes a decode step reads halfway through the decode (float32 weights, LM head tied to the embedding)."""
    from litgpt.config import Config

    from litkv import GPT
    from litkv.bandwidth import weight_bytes

    config = Config.from_name(model)
    with torch.device("meta"):
        meta = GPT(config)
    meta.lm_head.weight = meta.transformer.wte.weight  # tied, as the benchmark's weights are
    per_token = kv_bytes_per_token(config.n_layer, config.n_query_groups, config.head_size, 4)
    return bytes_per_step(weight_bytes(meta), per_token, prompt_len + new / 2)


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
    weights_dir: Path | None, repeats: int,
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
        repeats: rounds over all (length, peer) runs; each keeps its fastest decode of the rounds
            (rounds interleave the peers, so a busy moment of the machine hits them alike).
        quick: a smoke test: prompt 32, 8 new tokens, no compiled peer unless `peers` names one
            (explicit `prompt_lengths` still apply).
    """
    if quick:
        prompt_lengths = [32] if prompt_lengths is None else prompt_lengths
        max_new_tokens = 8
    lengths = [512, 2048, 4096] if prompt_lengths is None else list(prompt_lengths)
    _check_options(lengths, max_new_tokens, chunk_size, threads, repeats)
    chosen = _resolve_peers(peers, quick)
    gib = 2**28 if quick else 2**30
    bandwidth = measure_bandwidth(gib, threads=threads)
    results = _measure_all(model, lengths, chosen, max_new_tokens, chunk_size, seed, threads, weights_dir, repeats)
    bandwidth = max(bandwidth, measure_bandwidth(gib, threads=threads))  # best of before and after
    used = threads or torch.get_num_threads()
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s (sum of {gib // 2**20} MiB, {used} threads)")
    results = _best_of(results)
    for r in results:
        if r.available:
            r.step_bytes, r.bandwidth = _step_bytes(model, r.prompt_len, r.new_tokens), bandwidth
    print(format_table(results))
    if json_out is not None:
        write_text_atomic(json_out, json.dumps([asdict(r) for r in results], indent=2))
    return results
