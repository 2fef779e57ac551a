"""KVzip's extra prefill cost: the context-reconstruction pass against the prefill it follows.

Loads a checkpoint, builds a prompt of `--length` tokens from held-out text in the checkpoint's chat
template (as `litkv evaluate --tasks` feeds RULER prompts), and times, in the same process and in turn:

- the prefill through dense caches (chunks of `--chunk`), the baseline;
- the prefill through `kvzip` caches (one-shot: every token kept; the policy's queries are kept too);
- the reconstruction pass (`kvzip_score`, chunks of `--kvzip_chunk` context tokens) and the compression.

Prints each time (best of `--repeats`) and the ratios (reconstruction / dense prefill; (kvzip prefill +
reconstruction + compression) / dense prefill). Wall-clock on whatever else the machine runs: compare the
ratios, not the seconds.

    python scripts/kvzip_cost.py smollm2-135m-instruct --length 4096 --threads 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.checkpoints.download import known_checkpoint_dir
from litkv.checkpoints.runtime import load_for_inference
from litkv.core.tokens import encode_plain
from litkv.inference.chat_template import ChatTemplate, TemplateFormat, load_format
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_score
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.kvzip import compress_kvzip
from litkv.modeling.runner import run_chunks


def _prompt(ckpt: Path, tokenizer: object, length: int) -> tuple[torch.Tensor, RepeatPrompt]:
    text = (ckpt / "heldout.txt").read_text(encoding="utf-8") if (ckpt / "heldout.txt").is_file() else None
    if text is None:
        text = (Path(__file__).resolve().parents[1] / "litkv/assets/default/heldout.txt").read_text(encoding="utf-8")
    fmt = load_format(ckpt, tokenizer, None)
    template = fmt.template if isinstance(fmt, TemplateFormat) else None
    repeat = RepeatPrompt.build(tokenizer, template)
    body = encode_plain(tokenizer, text)
    head = (
        encode_plain(tokenizer, template.render([("user", "X")], True).split("X")[0])
        if isinstance(template, ChatTemplate)
        else []
    )
    ids = head + body[: length - len(head)]
    return torch.tensor(ids, dtype=torch.long), repeat


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="checkpoint directory or a known model name")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    parser.add_argument("--kvzip_chunk", type=int, default=2048, help="context tokens per reconstruction call")
    parser.add_argument("--plus", action="store_true", help="KVzip+ normalisation")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ckpt = known_checkpoint_dir(args.checkpoint) or Path(args.checkpoint)
    model, device = load_for_inference(ckpt, None, "cpu", args.threads)
    tokenizer = load_tokenizer(ckpt)
    ids, repeat = _prompt(ckpt, tokenizer, args.length)
    n = ids.numel()
    idx, pos = ids[None].to(device), torch.arange(n, device=device)[None]
    dense = KVCacheConfig("dense", cache_length=n, chunk_size=args.chunk)
    options = {"mode": "one-shot", "budget": n // 4, "chunk_size": args.kvzip_chunk, "kvzip_plus": args.plus}
    kvzip = KVCacheConfig("kvzip", cache_length=n, chunk_size=args.chunk, options=options)
    times: dict[str, float] = {}

    def record(name: str, seconds: float) -> None:
        times[name] = min(times.get(name, float("inf")), seconds)

    with torch.inference_mode():
        for _ in range(args.repeats):
            with model.kv_caches_attached(dense, 1):
                record("dense prefill", _timed(lambda: run_chunks(model, idx, pos, ChunkPlan.of(dense), lm_head=False)))
            with model.kv_caches_attached(kvzip, 1):
                record("kvzip prefill", _timed(lambda: run_chunks(model, idx, pos, ChunkPlan.of(kvzip), lm_head=False)))
                record("reconstruction", _timed(lambda: kvzip_score(model, [ids], repeat, repeat.prefix_length)))
                record("compression", _timed(lambda: compress_kvzip(list(model.caches))))
    base = times["dense prefill"]
    for name, seconds in times.items():
        print(f"{name:16s} {seconds:8.2f} s  {seconds / base:5.2f}x dense prefill")
    total = times["kvzip prefill"] + times["reconstruction"] + times["compression"]
    print(f"{n} tokens, prefix {repeat.prefix_length}, threads {args.threads}, KVzip+ {args.plus}: kvzip total "
          f"{total:.2f} s = {total / base:.2f}x the dense prefill (extra {total / base - 1:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
