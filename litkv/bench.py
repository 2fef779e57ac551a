"""Decode benchmark: litkv (dense cache) against Hugging Face `transformers` and LitGPT.

The same random weights (a Llama-family LitGPT preset, SmolLM2-135M by default) are written once in
both formats; each (peer, prompt length) then runs greedy decoding in a fresh subprocess, so peak
memory (the process's resident high-water mark, reset after loading the weights) is measured alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["BenchResult", "bench", "prepare_weights", "run_peer"]

PEERS = ("litkv", "hf", "litgpt")


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


def prepare_weights(model_name: str, seed: int, workdir: Path) -> tuple[Path, Path]:
    """Write random weights for preset `model_name` as a HF model dir and a LitGPT safetensors file."""
    from litgpt.config import Config
    from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = Config.from_name(model_name)
    if config.mlp_class_name != "LLaMAMLP" or config.norm_class_name != "RMSNorm" or config.bias:
        raise ValueError(f"the decode benchmark supports Llama-family presets, got {model_name!r}")
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
    hf_model.save_pretrained(hf_dir)
    state_dict: dict[str, torch.Tensor] = {}
    hf_weights = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    copy_weights_hf_llama(config, {}, state_dict, hf_weights)
    state_dict = {k: v.contiguous().clone() for k, v in state_dict.items()}
    lit_dir.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, str(lit_dir / "model.safetensors"))
    return hf_dir, lit_dir


_BASELINE_MB: list[float] = []


def _reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark of this process (Linux); remember the RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    _BASELINE_MB.append(_status_mb("VmRSS"))


def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmHWM: peak resident set, VmRSS: current), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _load_lit(model_name: str, lit_dir: Path, cls: type[torch.nn.Module]) -> torch.nn.Module:
    from litgpt.config import Config
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = cls(Config.from_name(model_name))
    model.load_state_dict(load_file(str(lit_dir / "model.safetensors")), assign=True)
    # Share the embedding with the LM head where they are equal (tied weights), as HF does.
    if torch.equal(model.lm_head.weight, model.transformer.wte.weight):
        model.lm_head.weight = model.transformer.wte.weight
    return model.eval()


Timed = tuple[list[float], list[int]]


def _time_litkv(model_name: str, lit_dir: Path, prompt: torch.Tensor, new: int, chunk: int) -> Timed:
    from litkv import GPT, KVCacheConfig, generate

    model = _load_lit(model_name, lit_dir, GPT)
    cfg = KVCacheConfig(cache_length=prompt.numel() + new, chunk_size=min(chunk, prompt.numel() + new))
    stamps: list[float] = []
    _reset_peak_rss()
    stamps.append(time.perf_counter())
    out = generate(model, [prompt], new, cfg, on_tokens=lambda t: stamps.append(time.perf_counter()))
    return stamps, out[0].tolist()


def _time_litgpt(model_name: str, lit_dir: Path, prompt: torch.Tensor, new: int) -> Timed:
    from litgpt.generate.base import generate_fn
    from litgpt.model import GPT as LitGPT

    model = _load_lit(model_name, lit_dir, LitGPT)
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


def _time_hf(hf_dir: Path, prompt: torch.Tensor, new: int) -> Timed:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    stamps: list[float] = []
    tokens: list[int] = []

    class _Stamps:
        def put(self, value: torch.Tensor) -> None:
            stamps.append(time.perf_counter())
            if len(stamps) > 1:
                tokens.extend(value.view(-1).tolist())

        def end(self) -> None:
            pass

    _reset_peak_rss()
    with torch.inference_mode():
        model.generate(
            prompt[None],
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            streamer=_Stamps(),
            pad_token_id=0,
        )
    return stamps, tokens  # the first stamp is the prompt, put before the prefill


def run_peer(
    peer: str, model_name: str, hf_dir: Path, lit_dir: Path, prompt_len: int, new: int, chunk: int, seed: int
) -> BenchResult:
    """Measure one peer in this process (meant to run in a fresh subprocess)."""
    from litgpt.config import Config

    vocab = Config.from_name(model_name).vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    if peer == "litkv":
        stamps, tokens = _time_litkv(model_name, lit_dir, prompt, new, chunk)
    elif peer == "litgpt":
        stamps, tokens = _time_litgpt(model_name, lit_dir, prompt, new)
    elif peer == "hf":
        stamps, tokens = _time_hf(hf_dir, prompt, new)
    else:
        raise ValueError(f"peer must be one of {list(PEERS)}, got {peer!r}")
    peak = _status_mb("VmHWM")
    if len(stamps) < 3 or stamps[-1] <= stamps[1]:
        raise RuntimeError(f"{peer} produced {len(stamps) - 1} tokens: no decode step was timed")
    prefill = stamps[1] - stamps[0]
    decode = (len(stamps) - 2) / (stamps[-1] - stamps[1])
    return BenchResult(peer, prompt_len, len(stamps) - 1, prefill, decode, peak, peak - _BASELINE_MB[-1], tokens)


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


def format_table(results: list[BenchResult]) -> str:
    """Markdown table with litkv/peer ratios (speed: higher is better; memory: lower is better).

    `peak MB` is the process's peak resident set during generation (weights and libraries included);
    `gen MB` is that peak minus the resident set just before generation (what generating needs).
    """
    rows = [
        "| prompt | peer | prefill s | decode tok/s | peak MB | gen MB | litkv/peer tok/s | litkv/peer peak "
        "| litkv/peer gen | same tokens |",
        "|" + "---|" * 10,
    ]
    for r in results:
        ours = next(x for x in results if x.peer == "litkv" and x.prompt_len == r.prompt_len)
        rows.append(
            f"| {r.prompt_len} | {r.peer} | {r.prefill_s:.2f} | {r.decode_tok_s:.1f} | {r.peak_mb:.0f} | "
            f"{r.generation_mb:.0f} | {ours.decode_tok_s / r.decode_tok_s:.2f} | {ours.peak_mb / r.peak_mb:.2f} | "
            f"{ours.generation_mb / max(r.generation_mb, 1.0):.2f} | {'yes' if r.tokens == ours.tokens else 'no'} |"
        )
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
) -> list[BenchResult]:
    """Greedy decoding speed and peak memory of litkv (dense cache) against HF transformers and LitGPT.

    Args:
        model: LitGPT preset name of a Llama-family architecture (random weights).
        prompt_lengths: prompt lengths to measure (default 512, 2048, 4096).
        max_new_tokens: tokens generated per run.
        peers: which of litkv, hf, litgpt to run (default all; litkv always runs, ratios need it).
        chunk_size: litkv prefill chunk size.
        seed: seed of the weights and the prompt.
        threads: torch threads per worker (default: torch's default).
        json_out: also write the results as JSON here.
        weights_dir: keep the random weights here and reuse them on the next run (default: a temporary
            directory).
        repeats: rounds over all (length, peer) runs; each keeps its fastest decode of the rounds
            (rounds interleave the peers, so a busy moment of the machine hits them alike).
    """
    lengths = [512, 2048, 4096] if prompt_lengths is None else list(prompt_lengths)
    _check_options(lengths, max_new_tokens, chunk_size, threads, repeats)
    chosen = ["litkv"] + [p for p in (peers or list(PEERS)) if p != "litkv"]
    for p in chosen:
        if p not in PEERS:
            raise ValueError(f"peers must be among {list(PEERS)}, got {p!r}")
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
                        new=max_new_tokens,
                        chunk=chunk_size,
                        seed=seed,
                        threads=threads,
                    )
                    r = _run_subprocess(args)
                    print(f"{peer:>7} prompt={n}: {r.decode_tok_s:.1f} tok/s, {r.peak_mb:.0f} MB peak", flush=True)
                    results.append(r)
    results = _best_of(results)
    print(format_table(results))
    if json_out is not None:
        json_out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results
