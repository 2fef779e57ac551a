"""Prefix reuse: time to first token of a cold call and of a second call sharing a long prefix.

Two prompts share their first `--prefix_tokens` tokens (the shipped held-out text) and end with
different questions. The cold call runs with an empty `PrefixCache`; the second call, with the
store the first one filled, restores the state after the shared blocks and prefills only its own
tail. Each figure is the best of `--repeats` rounds (a fresh store each round). The second call's
tokens are checked against a run without a store.

    python scripts/bench_prefix.py --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from litkv import GPT, KVCacheConfig, PrefixCache, generate
from litkv.checkpoints.checkpoint import default_checkpoint_dir, load_model, load_tokenizer

QUESTIONS = (
    "\n\nAnd the king said unto the prophet, what shall we do",
    "\n\nThen answered the people and said, who is this man that",
)


def _ttft(
    model: GPT, prompt: torch.Tensor, cfg: KVCacheConfig, store: PrefixCache | None, new: int
) -> tuple[float, list[int]]:
    """Seconds to the first new token, and the new tokens."""
    marks: list[float] = []

    def on_tokens(tokens: torch.Tensor) -> None:
        tokens.tolist()  # synchronises the device
        marks.append(time.perf_counter())

    start = time.perf_counter()
    out = generate(model, [prompt], new, cfg, on_tokens=on_tokens, prefix_cache=store)[0]
    return marks[0] - start, out.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix_tokens", type=int, default=2048)
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--cache_length", type=int, default=1024)
    parser.add_argument("--chunk_size", type=int, default=256)
    parser.add_argument("--new_tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ckpt = default_checkpoint_dir()
    device = torch.device(args.device)
    model = load_model(ckpt, device=device)
    tokenizer = load_tokenizer(ckpt)
    text = (ckpt / "heldout.txt").read_text(encoding="utf-8")
    prefix = tokenizer.encode(text, device=device).long()[: args.prefix_tokens]
    if prefix.numel() < args.prefix_tokens:
        raise SystemExit(f"the held-out text has only {prefix.numel()} tokens")
    prompts = [torch.cat((prefix, tokenizer.encode(q, device=device).long())) for q in QUESTIONS]
    cfg = KVCacheConfig(args.policy, cache_length=args.cache_length, chunk_size=args.chunk_size)
    with torch.inference_mode():
        _ttft(model, prompts[0][:300], cfg, None, 1)  # warm-up
        cold, warm, store = [], [], None
        for _ in range(args.repeats):
            store = PrefixCache(1 << 34)
            cold.append(_ttft(model, prompts[0], cfg, store, args.new_tokens)[0])
            seconds, tokens = _ttft(model, prompts[1], cfg, store, args.new_tokens)
            warm.append(seconds)
        _, reference = _ttft(model, prompts[1], cfg, None, args.new_tokens)
    print(
        f"policy {args.policy}, cache_length {args.cache_length}, chunk {args.chunk_size}, shared prefix "
        f"{args.prefix_tokens} tokens, prompts of {prompts[0].numel()} and {prompts[1].numel()} tokens, {device}"
    )
    print(f"cold call TTFT:   {min(cold) * 1000:8.1f} ms")
    print(f"second call TTFT: {min(warm) * 1000:8.1f} ms  ({min(warm) / min(cold):.1%} of cold)")
    print(f"prompt tokens reused by the second call: {store.reused_tokens} of {prompts[1].numel()}")
    print(f"store: {len(store)} states, {store.nbytes() / 2**20:.1f} MiB")
    print(f"second call's tokens equal a run without a store: {'yes' if tokens == reference else 'NO'}")


if __name__ == "__main__":
    main()
