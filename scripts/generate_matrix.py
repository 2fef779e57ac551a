"""Tokens of `generate` over a matrix of cases, to check that a change to generation keeps them bitwise.

Cases (tiny random model with gates, one thread): ragged token-id batches, one prompt, a prefix store
(second use), prompts of segments alone and as one batch (blocks spliced, recompute 0.3); greedy, seeded
top-k/top-p, and sampling with stop tokens; dense, h2o, snapkv with int8 storage, learned caches. Runs on
either API: `generate(..., temperature=...)` / `generate_segments` (before issue 43 item 3) or
`generate(..., Sampling(...), block_store=...)` (after), so the same cases run on both trees:

    PYTHONPATH=OLD_TREE python scripts/generate_matrix.py before.pt   # litkv imported from OLD_TREE
    PYTHONPATH=. python scripts/generate_matrix.py after.pt
    python scripts/generate_matrix.py --compare before.pt after.pt     # prints "N cases; differ: [...]"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import attach_random_gates, random_gpt, random_tokens, tiny_config  # noqa: E402

from litkv import KVCacheConfig, PrefixCache  # noqa: E402
from litkv.inference import blocks  # noqa: E402
from litkv.inference import generate as gen  # noqa: E402
from litkv.states.block_store import BlockStore  # noqa: E402

SAMPLINGS = {
    "greedy": {},
    "seeded": {"temperature": 0.9, "top_k": 20, "top_p": 0.95},
    "stop": {"temperature": 1.3, "stop": tuple(range(0, 128, 6))},  # rows stop at different steps
}
CACHES = {
    "dense": KVCacheConfig("dense", cache_length=96, chunk_size=8),
    "h2o": KVCacheConfig("h2o", cache_length=24, chunk_size=8),
    "snapkv-int8": KVCacheConfig("snapkv", cache_length=24, chunk_size=8, storage="int8", quant_group_size=8),
    "learned": KVCacheConfig("learned", cache_length=24, chunk_size=8),
}
NEW_TOKENS = 12


def _call(model: object, prompts: list, cfg: KVCacheConfig, options: dict, stores: dict, one: bool) -> object:
    """`generate` through the API this tree has; `one`: a single prompt of segments (old: generate_segments)."""
    sampling = {k: v for k, v in options.items() if k != "stop"}
    stop, generator = options.get("stop", ()), torch.Generator().manual_seed(7)
    if hasattr(gen, "Sampling"):
        chosen = gen.Sampling(**sampling, stop_tokens=stop, generator=generator)
        out = gen.generate(model, [prompts] if one else prompts, NEW_TOKENS, cfg, chosen, **stores)
        return out[0] if one else out
    old = dict(sampling, stop_tokens=stop, generator=generator)
    if "block_store" not in stores:
        return gen.generate(model, prompts, NEW_TOKENS, cfg, **old, **stores)
    call = blocks.generate_segments if one else blocks.generate_segments_batch
    return call(model, prompts, NEW_TOKENS, cfg, stores["block_store"], stores["recompute"], **old)


def run() -> dict[str, object]:
    torch.set_num_threads(1)
    model = attach_random_gates(random_gpt(tiny_config("SmolLM2-135M"), seed=33), seed=33)
    prompts = [random_tokens(1, n, seed=10 + n)[0] for n in (23, 9, 31)]
    docs = [random_tokens(1, n, seed=90 + i)[0] for i, n in enumerate((20, 13, 17))]
    text = [random_tokens(1, n, seed=95 + i)[0] for i, n in enumerate((5, 6, 3, 9, 4))]
    seg = blocks.Segment
    layouts = [
        [seg(text[0]), seg(docs[0], True), seg(docs[1], True), seg(text[1])],
        [seg(text[2]), seg(docs[1], True), seg(docs[0], True), seg(text[3])],
        [seg(docs[2], True), seg(text[4])],
    ]
    out: dict[str, object] = {}
    for cache, cfg in CACHES.items():
        for name, options in SAMPLINGS.items():
            out[f"ids/{cache}/{name}"] = _call(model, prompts, cfg, options, {}, False)
            out[f"ids1/{cache}/{name}"] = _call(model, prompts[:1], cfg, options, {}, False)
            prefix = {"prefix_cache": PrefixCache(1 << 24)}
            _call(model, prompts[:1], cfg, options, prefix, False)
            out[f"prefix/{cache}/{name}"] = _call(model, prompts, cfg, options, prefix, False)
            stores = {"block_store": BlockStore(1 << 24), "recompute": 0.3}
            for i, layout in enumerate(layouts):
                out[f"seg{i}/{cache}/{name}"] = _call(model, layout, cfg, options, stores, True)
            out[f"segbatch/{cache}/{name}"] = _call(model, layouts, cfg, options, stores, False)
    return out


def _equal(a: object, b: object) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return isinstance(b, torch.Tensor) and torch.equal(a, b)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="OUT.pt, or with --compare two files")
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args()
    if args.compare:
        before, after = (torch.load(p) for p in args.paths)
        print(f"{len(before)} cases; differ: {[k for k in before if not _equal(before[k], after.get(k))]}")
        return
    tokens = run()
    torch.save(tokens, args.paths[0])
    print(f"{len(tokens)} cases written to {args.paths[0]}")


if __name__ == "__main__":
    main()
