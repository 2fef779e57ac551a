"""KL to dense after a one-shot compression: uniform budgets vs AdaKV per-head budgets (issue 19, item 5).

Runs under the litkv environment (no kvpress). For each window of `--window` tokens of the shipped
model's `heldout.txt`: the first half (the context) is prefilled in chunks of 64 with `mode="one-shot"`
and compressed to `budget` tokens per KV head (uniform) or `budget x n_query_groups` per layer
(AdaKV, `alpha_safeguard` 0.2); the second half is then teacher-forced without eviction. Reported over
the second half's positions: mean KL(dense || policy) of the next-token distributions, top-1 agreement
with dense, and the slots the AdaKV heads use (min / max per head, as a multiple of the budget: the
padded layout's overhead).

    PYTHONPATH=. python scripts/oneshot_kl.py --budgets 64 128 256
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from litkv import GPT, KVCacheConfig
from litkv.checkpoints.checkpoint import default_checkpoint_dir, load_model, load_tokenizer
from litkv.kvcache.score import compress_all

EA = {"recent": 0, "n_sink": 4, "n_future_positions": 512}  # kvpress's ExpectedAttentionPress settings
POLICIES = {
    "expected-attention (uniform)": ("expected-attention", EA),
    "expected-attention (AdaKV)": ("litkv.kvcache.adakv:AdaKVExpectedAttention", {**EA, "alpha_safeguard": 0.2}),
}
CHUNK = 64


@torch.inference_mode()
def run_window(model: GPT, ids: torch.Tensor, policy: str, options: dict, budget: int) -> tuple[torch.Tensor, list]:
    """Logits of the second half of `ids` `(1, n)` after the one-shot compression of the first half, and
    the per-head slot counts after it (one `(B, G)` tensor per layer)."""
    n, half = ids.shape[1], ids.shape[1] // 2
    config = KVCacheConfig(
        policy, cache_length=n, chunk_size=CHUNK, options={**options, "mode": "one-shot", "budget": budget}
    )
    logits = []
    with model.kv_caches_attached(config, batch_size=1) as caches:
        for start in range(0, n, CHUNK):
            if start == half:
                compress_all(caches)
                used = [(c.positions >= 0).sum(dim=2) for c in caches]
            out = model(ids[:, start : start + CHUNK], input_pos=torch.arange(start, min(start + CHUNK, n))[None])
            if start >= half:
                logits.append(out)
    return torch.cat(logits, dim=1)[0], used


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--window", type=int, default=1024, help="tokens per window (context: the first half)")
    parser.add_argument("--num_windows", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


@torch.inference_mode()
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = default_checkpoint_dir()
    model = load_model(checkpoint, dtype=torch.float32)
    text = (checkpoint / "heldout.txt").read_text(encoding="utf-8")
    tokens = load_tokenizer(checkpoint).encode(text).long()
    if args.window % (2 * CHUNK) or tokens.numel() < args.window * args.num_windows:
        print(f"error: --window must be a multiple of {2 * CHUNK} and the text long enough", file=sys.stderr)
        return 2
    windows = tokens[: args.window * args.num_windows].view(args.num_windows, 1, args.window)
    print("| policy | budget | KL (dense, policy) | top-1 | slots per head, min / max (x budget) |")
    print("|---|---:|---:|---:|---|")
    for name, (policy, options) in POLICIES.items():
        for budget in args.budgets:
            kls, agree, counts = [], [], []
            for ids in windows:
                dense = model(ids)[0, args.window // 2 :].log_softmax(-1)
                logits, used = run_window(model, ids, policy, options, budget)
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
