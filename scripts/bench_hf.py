"""Speed of litkv's policies inside transformers (`litkv.hf.Cache`), against transformers' own dynamic cache and
against litkv's GPT with the same policy, on the same weights.

For each prompt length: prefill (seconds) and `--new-tokens` greedy decode steps timed on their own (tok/s),
and the cache's bytes after them, for three runners:

- `hf-dynamic`: transformers' model (SDPA) with its `DynamicCache` (every token kept);
- `hf-litkv`: transformers' model with `litkv.hf.Cache(model, KVCacheConfig(policy, cache_length=prompt/ratio))`;
- `litkv`: litkv's GPT (the model converted by litkv's converter) with the same `KVCacheConfig`.

All three run in one process, `--repeats` times, in an order rotated each repeat (alternated), and the median of
each figure is printed. Both transformers runners use a plain forward loop (no `generate` overhead); litkv's decode
steps run under `GPT.trusted_inputs` as `litkv.generate`'s do. Weights: a random Llama of `--width` / `--layers`
(default), or `--gguf FILE` (transformers loads the GGUF, litkv converts it).

Run: ``python scripts/bench_hf.py --prompts 4096 16384`` (``--help`` for the options); prints one JSON line per
(prompt, runner).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

import litkv.hf
from litkv import GPT, KVCacheConfig
from litkv.checkpoints.checkpoint import load_model
from litkv.checkpoints.convert import convert_hf_checkpoint
from litkv.kvcache.config import ChunkPlan
from litkv.modeling.runner import run_chunks
from litkv.modeling.weight_layout import columns_contiguous

RUNNERS = ("hf-dynamic", "hf-litkv", "litkv")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--ratio", type=int, default=8, help="cache_length = prompt / ratio")
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--chunk", type=int, default=256, help="chunk_size (at most cache_length)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file instead of random weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser.parse_args()


def build(args: argparse.Namespace, tmp: Path) -> tuple[torch.nn.Module, GPT]:
    """(transformers model, litkv GPT) with the same weights, on the device in the dtype."""
    dtype = getattr(torch, args.dtype)
    if args.gguf is not None:
        from litkv.cli.convert_cmd import convert

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(args.gguf.parent), gguf_file=args.gguf.name, dtype=torch.float32, use_kernels=False
        )  # no hub kernels: 5.25 kernelizes by default and then needs the `kernels` package (docs/hf.md)
        convert(args.gguf, tmp / "litkv")
    else:
        config = transformers.LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.width,
            intermediate_size=args.width * 8 // 3,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=max(args.prompts) + args.new_tokens + 1,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(config)
        hf.save_pretrained(tmp / "hf", safe_serialization=True)
        (tmp / "hf" / "tokenizer.json").write_text("{}")
        convert_hf_checkpoint(tmp / "hf", tmp / "litkv")
    model = load_model(tmp / "litkv")
    return hf.to(args.device, dtype).eval(), columns_contiguous(model.to(args.device, dtype).eval())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf(hf: torch.nn.Module, ids: torch.Tensor, cache: object, steps: int, device: str) -> dict[str, float]:
    """Prefill, then `steps` greedy one-token calls through `cache`."""
    _sync(device)
    start = time.perf_counter()
    logits = hf(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[:, -1]
    _sync(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        logits = hf(input_ids=logits.argmax(dim=-1, keepdim=True), past_key_values=cache).logits[:, -1]
    _sync(device)
    decode = time.perf_counter() - start
    nbytes = cache.nbytes() if isinstance(cache, litkv.hf.Cache) else _dynamic_bytes(cache)
    return {"prefill_s": prefill, "decode_tok_s": steps / decode, "cache_bytes": nbytes}


def _dynamic_bytes(cache: transformers.DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def run_litkv(model: GPT, ids: torch.Tensor, cfg: KVCacheConfig, steps: int, device: str) -> dict[str, float]:
    """litkv's GPT: the chunked prefill, `end_prefill`, then `steps` greedy decode steps (trusted inputs)."""
    n = ids.shape[1]
    with model.kv_caches_attached(cfg, 1) as caches:
        _sync(device)
        start = time.perf_counter()
        pos = torch.arange(n, device=ids.device)[None]
        logits = run_chunks(model, ids, pos, ChunkPlan.of(cfg), last_only=True)[:, -1]
        caches.end_prefill()
        _sync(device)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        with model.trusted_inputs(n + steps):
            for j in range(steps):
                tok = logits.argmax(dim=-1, keepdim=True)
                logits = model(tok, torch.full_like(tok, n + j))[:, -1]
        _sync(device)
        decode = time.perf_counter() - start
        return {"prefill_s": prefill, "decode_tok_s": steps / decode, "cache_bytes": caches.nbytes()}


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf, model = build(args, Path(tmp))
    vocab = hf.config.vocab_size
    for prompt in args.prompts:
        cache_length = prompt // args.ratio
        cfg = KVCacheConfig(policy=args.policy, cache_length=cache_length, chunk_size=min(args.chunk, cache_length))
        ids = torch.randint(3, vocab, (1, prompt), generator=torch.Generator().manual_seed(prompt)).to(args.device)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in RUNNERS}
        for rep in range(args.repeats):
            order = RUNNERS[rep % 3 :] + RUNNERS[: rep % 3]
            for name in order:
                with torch.inference_mode():
                    if name == "hf-dynamic":
                        hf.set_attn_implementation("sdpa")
                        results[name].append(run_hf(hf, ids, transformers.DynamicCache(), args.new_tokens, args.device))
                    elif name == "hf-litkv":
                        cache = litkv.hf.Cache(hf, cfg)
                        results[name].append(run_hf(hf, ids, cache, args.new_tokens, args.device))
                    else:
                        results[name].append(run_litkv(model, ids, cfg, args.new_tokens, args.device))
        for name in RUNNERS:
            rows = results[name]
            row = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            line = {"prompt": prompt, "runner": name, "policy": "dense" if name == "hf-dynamic" else args.policy,
                    "cache_length": None if name == "hf-dynamic" else cache_length, **row,
                    "repeats": args.repeats, "threads": torch.get_num_threads(), "device": args.device}  # fmt: skip
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
