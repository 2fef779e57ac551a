"""KL to dense after a one-shot compression, row by row (issue 19, item 5: uniform budgets vs AdaKV per-head
budgets; issue 58: `learned` across layers, `kvzip` and the heuristics beside the RULER table).

Runs under the litkv environment (no kvpress). For each window of `--window` tokens of the shipped
model's `heldout.txt`: the first half (the context) is prefilled in chunks of `--chunk` with
`mode="one-shot"` and compressed to `budget` tokens per KV head (uniform; `learned` with gates of one
scale: `budget x G x n_layer` over all layers; `kvzip` after its context-reconstruction pass), or
`budget x n_query_groups` per layer (AdaKV, `alpha_safeguard` 0.2); the second half is then teacher-forced
without eviction. Reported over the second half's positions: mean KL(dense || policy) of the next-token
distributions, top-1 agreement with dense (`--reference`: the dense run of another checkpoint, a retrofitted
model's base), and the slots the heads use (min / max per head, as a multiple of the budget: AdaKV's padded
layout, the spread of a budget across layers).

    PYTHONPATH=. python scripts/oneshot_kl.py --budgets 64 128 256          # the default model, AdaKV rows
    python scripts/oneshot_kl.py --checkpoint smollm2-135m-instruct --window 4096 --num_windows 1 \
        --budgets 512 256 --chunk 512 --rows learned,learned-per-head,kvzip,tova-all,keydiff,snapkv
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from litkv import GPT, KVCacheConfig
from litkv.checkpoints.checkpoint import default_checkpoint_dir, load_model, load_tokenizer
from litkv.checkpoints.known import model_dir
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_score
from litkv.kvcache.kvzip import compress_kvzip
from litkv.kvcache.one_shot import compress_all

EA = {"recent": 0, "n_sink": 4, "n_future_positions": 512}  # kvpress's ExpectedAttentionPress settings
ROWS = {
    "expected-attention": ("expected-attention", EA),
    "expected-attention-adakv": ("litkv.kvcache.adakv:AdaKVExpectedAttention", {**EA, "alpha_safeguard": 0.2}),
    "learned": ("learned", {}),  # across layers with gates of one scale (the default), per head otherwise
    "learned-per-head": ("learned", {"across_layers": False}),
    "kvzip": ("kvzip", {}),
    "tova-all": ("tova", {"heads": "all"}),
    "keydiff": ("keydiff", {}),
    "snapkv": ("snapkv", {}),
}


@torch.inference_mode()
def run_window(
    model: GPT, ids: torch.Tensor, row: str, budget: int, chunk: int, repeat: RepeatPrompt
) -> tuple[torch.Tensor, list]:
    """Logits `(n/2, vocab)` of the second half of `ids` `(1, n)` after the one-shot compression of the first
    half, and the per-head slot counts after it (one `(B, G)` tensor per layer)."""
    policy, options = ROWS[row]
    n, half = ids.shape[1], ids.shape[1] // 2
    options = {**options, "mode": "one-shot", "budget": budget}
    config = KVCacheConfig(policy, cache_length=n, chunk_size=chunk, options=options)
    logits = []
    with model.kv_caches_attached(config, batch_size=1) as caches:
        for start in range(0, n, chunk):
            if start == half:
                if policy == "kvzip":
                    kvzip_score(model, [ids[0, :half]], repeat, repeat.prefix_length)
                    compress_kvzip(list(caches))
                else:
                    compress_all(caches)
                used = [(c.positions >= 0).sum(dim=2) for c in caches]
            out = model(ids[:, start : start + chunk], input_pos=torch.arange(start, min(start + chunk, n))[None])
            if start >= half:
                logits.append(out)
    return torch.cat(logits, dim=1)[0], used


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--window", type=int, default=1024, help="tokens per window (context: the first half)")
    parser.add_argument("--num_windows", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory or known name (default model)")
    parser.add_argument("--reference", default=None, help="KL to this checkpoint's dense run (a retrofit's base)")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk (the context half is a multiple)")
    parser.add_argument(
        "--rows", default="expected-attention,expected-attention-adakv", help=f"comma-separated, among {list(ROWS)}"
    )
    args = parser.parse_args(argv)
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}, known: {list(ROWS)}")
    return args


@torch.inference_mode()
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = default_checkpoint_dir() if args.checkpoint is None else model_dir(args.checkpoint)
    model = load_model(checkpoint, dtype=torch.float32)
    text = (default_checkpoint_dir() / "heldout.txt").read_text(encoding="utf-8")
    tokenizer = load_tokenizer(checkpoint)
    tokens = tokenizer.encode(text).long()
    repeat = RepeatPrompt.build(tokenizer, None)  # plain text
    if args.window % (2 * args.chunk) or tokens.numel() < args.window * args.num_windows:
        print(f"error: --window must be a multiple of {2 * args.chunk} and the text long enough", file=sys.stderr)
        return 2
    print(f"{checkpoint.name}: {args.num_windows} window(s) of {args.window} tokens (context {args.window // 2})")
    windows = tokens[: args.window * args.num_windows].view(args.num_windows, 1, args.window)
    print("| policy | budget | KL (dense, policy) | top-1 | slots per head, min / max (x budget) |")
    print("|---|---:|---:|---:|---|")
    reference = model if args.reference is None else load_model(model_dir(args.reference), dtype=torch.float32)
    dense_logp = [reference(ids)[0, args.window // 2 :].log_softmax(-1) for ids in windows]
    if args.reference is not None:  # the policy-free row: the checkpoint's own dense run against the reference
        for ids, dense in zip(windows, dense_logp, strict=True):
            own = model(ids)[0, args.window // 2 :].log_softmax(-1)
            kl = float((dense.exp() * (dense - own)).sum(-1).mean())
            top1 = float((dense.argmax(-1) == own.argmax(-1)).float().mean())
            print(f"| dense (this checkpoint) | {args.window} | {kl:.4f} | {top1:.3f} | - |", flush=True)
    for name in args.rows.split(","):
        for budget in args.budgets:
            kls, agree, counts = [], [], []
            for ids, dense in zip(windows, dense_logp, strict=True):
                logits, used = run_window(model, ids, name, budget, args.chunk, repeat)
                logp = logits.log_softmax(-1)
                kls.append((dense.exp() * (dense - logp)).sum(-1).mean())
                agree.append((dense.argmax(-1) == logp.argmax(-1)).float().mean())
                counts += [int(x) for u in used for x in u.flatten()]
            kl, top1 = float(torch.stack(kls).mean()), float(torch.stack(agree).mean())
            spread = f"{min(counts) / budget:.2f} / {max(counts) / budget:.2f}"
            print(f"| {name} | {budget} | {kl:.4f} | {top1:.3f} | {spread} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
