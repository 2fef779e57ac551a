"""Kept-set parity of litkv's `kvzip` with kvpress 0.5.5's `KVzipPress` on the same weights (issue 45, item 1).

Runs in the kvpress environment with litkv on the path (see scripts/parity_kvpress.py for the venv):

    PYTHONPATH=. ../venv-kvpress/bin/python scripts/parity_kvzip.py CHECKPOINT_DIR --length 1024 --out out/parity_kvzip

For each budget `b` and option set (KVzip, KVzip+, layerwise), the same prompt (the checkpoint's chat
template prefix, then `heldout.txt` tokens, `--length` in all) is

- prefilled by the Hugging Face twin (`compare_kvpress.build_twin`, SDPA: `KVzipPress` masks pairs and
  refuses eager attention) under `KVzipPress(compression_ratio=r, ...)`, `r` the ratio for which kvpress
  prunes exactly `n_layers x G x (n - b)` pairs; its kept set per layer and KV head is the complement of
  `masked_key_indices`;
- prefilled by litkv (chunks of `--chunk`) through `kvzip` caches (one-shot, `budget=b`), then
  `litkv.inference.kvzip_reconstruction.kvzip_compress` with the reconstruction prompt built from the same chat
  template; the kept set is the slots' positions.

Prints the Jaccard `|A & B| / |A | B|` per (options, budget): mean and minimum over layers and KV heads
(a head may keep nothing on one side: its Jaccard is 1 when both keep nothing), and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from kvpress import KVzipPress
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_kvpress import build_twin, ratio_for  # noqa: E402

from litkv.checkpoints.checkpoint import load_model, load_tokenizer  # noqa: E402
from litkv.core.tokens import encode_plain  # noqa: E402
from litkv.inference.chat_template import ChatTemplate  # noqa: E402
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_compress  # noqa: E402
from litkv.kvcache.config import (
    ChunkPlan,  # noqa: E402
    KVCacheConfig,  # noqa: E402
)
from litkv.modeling.runner import run_chunks  # noqa: E402

CASES = {
    "kvzip": {},
    "kvzip_plus": {"kvzip_plus": True},
    "kvzip layerwise": {"layerwise": True},
    "kvzip+ chunks of 256": {"kvzip_plus": True, "chunk_size": 256},
}


def prompt_ids(ckpt: Path, length: int) -> tuple[list[int], RepeatPrompt]:
    tokenizer = load_tokenizer(ckpt)
    template = ChatTemplate.load(ckpt)
    repeat = RepeatPrompt.build(tokenizer, template)
    head = []
    if template is not None:
        head = encode_plain(tokenizer, template.render([("user", "X")], True).split("X")[0])
    text = (ckpt / "heldout.txt") if (ckpt / "heldout.txt").is_file() else Path("litkv/assets/default/heldout.txt")
    body = encode_plain(tokenizer, text.read_text(encoding="utf-8"))
    return head + body[: length - len(head)], repeat


@torch.inference_mode()
def kvpress_kept(twin, ids: list[int], budget: int, options: dict) -> list[list[set[int]]]:
    cfg = twin.config
    n, layers, g = len(ids), cfg.num_hidden_layers, cfg.num_key_value_heads
    pruned = (n - budget) * g if options.get("layerwise") else (n - budget) * g * layers
    total = n * g if options.get("layerwise") else n * g * layers
    press = KVzipPress(
        compression_ratio=ratio_for(total, pruned),
        layerwise=options.get("layerwise", False),
        kvzip_plus_normalization=options.get("kvzip_plus", False),
        chunk_size=options.get("chunk_size", 2048),
    )
    with press(twin):
        twin(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
    kept = []
    for layer in twin.model.layers:
        _, heads, seqs = layer.self_attn.masked_key_indices
        sets = [set(range(n)) for _ in range(g)]
        for h, s in zip(heads.tolist(), seqs.tolist(), strict=True):
            sets[h].discard(s)
        kept.append(sets)
        del layer.self_attn.masked_key_indices
    return kept


@torch.inference_mode()
def litkv_kept(model, ids: list[int], repeat: RepeatPrompt, budget: int, options: dict, chunk: int):
    n = len(ids)
    opts = {"mode": "one-shot", "budget": budget, **options}
    cfg = KVCacheConfig("kvzip", cache_length=n, chunk_size=chunk, options=opts)
    x = torch.tensor([ids])
    with model.kv_caches_attached(cfg, 1) as caches:
        run_chunks(model, x, torch.arange(n)[None], ChunkPlan.of(cfg), lm_head=False, last_only=True)
        kvzip_compress(model, [x[0]], repeat, repeat.prefix_length)
        return [[set(p[p >= 0].tolist()) for p in cache.positions[0]] for cache in caches]


def jaccard(a: set[int], b: set[int]) -> float:
    return 1.0 if not a and not b else len(a & b) / len(a | b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("out/parity_kvzip"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ids, repeat = prompt_ids(args.checkpoint_dir, args.length)
    twin = build_twin(args.checkpoint_dir)
    twin.config._attn_implementation = "sdpa"
    twin.config.name_or_path = str(args.checkpoint_dir)  # KVzipPress loads the tokenizer from there
    model = load_model(args.checkpoint_dir, dtype=torch.float32)
    results = {}
    start = time.perf_counter()
    for case in args.cases:
        for budget in args.budgets:
            a = kvpress_kept(twin, ids, budget, CASES[case])
            b = litkv_kept(model, ids, repeat, budget, CASES[case], args.chunk)
            per = [[jaccard(x, y) for x, y in zip(la, lb, strict=True)] for la, lb in zip(a, b, strict=True)]
            flat = [j for layer in per for j in layer]
            results[f"{case}@{budget}"] = {"mean": sum(flat) / len(flat), "min": min(flat), "per_layer_head": per}
            print(f"{case:16s} budget {budget:5d}: Jaccard mean {sum(flat) / len(flat):.4f} min {min(flat):.4f}",
                  flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    info = {"length": len(ids), "prefix_length": repeat.prefix_length, "elapsed_s": time.perf_counter() - start}
    (args.out / "parity_kvzip.json").write_text(json.dumps({**info, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
