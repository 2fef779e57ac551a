"""A system prompt shared by conversations: hit rate and time to first token with and without sharing.

`--conversations` new conversations, one after another, through `litkv serve`'s engine (in this process:
no HTTP), each the same system prompt of about `--system_tokens` tokens (the checkpoint's chat template)
and its own short user message. "shared": a state store as the server's default keeps the system prompt's
state after the first conversation feeds it; "none": an empty store (`ConversationStore(0)`), so every
conversation prefills the system prompt (what a new conversation did before issue 49). TTFT is from the
request to the first sampled token. Every reply of "none" is checked equal to the same conversation's
reply in "shared"; `--baseline_conversations` runs "none" on the first conversations only (each prefills
the whole system prompt, so it is the slow side).

    python scripts/bench_shared_system.py --checkpoint smollm2-135m-instruct --conversations 100 \
        --baseline_conversations 20 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.cli.common import resolve_checkpoint_dir
from litkv.inference.chat_template import load_format
from litkv.kvcache.config import KVCacheConfig
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult

TEXT = (
    "You are a careful assistant for a library. Answer briefly, cite the shelf of each book you name, "
    "never invent a title, and ask one question back when a request is unclear. "
)
WORDS = TEXT.lower().replace(",", "").split()


def system_prompt(tokenizer: object, tokens: int) -> str:
    """`TEXT` repeated to about `tokens` tokens."""
    text = TEXT
    while len(tokenizer.encode(text)) < tokens:  # type: ignore[attr-defined]
        text += TEXT
    return text


def run(engine: Engine, system: str, n: int, max_tokens: int) -> tuple[list[float], list[int], list[list[int]]]:
    """TTFT (s), reused tokens and reply ids of `n` new conversations."""
    first: list[float] = []
    on_token = engine.on_token

    def mark(job: object, token: int) -> bool:
        if not first:
            first.append(time.perf_counter())
        return on_token(job, token)  # type: ignore[arg-type]

    engine.on_token = mark  # type: ignore[method-assign]
    ttft, reused, replies = [], [], []
    for i in range(n):
        user = " ".join(WORDS[i % 7 : i % 7 + 3 + i % 5]) + f" (question {i})"
        result, first[:] = TurnResult(), []
        start = time.perf_counter()
        "".join(engine.run(TurnRequest([("system", system), ("user", user)], max_tokens), result))
        ttft.append(first[0] - start)
        reused.append(result.reused_tokens)
        replies.append(result.reply_ids)
    return ttft, reused, replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="smollm2-135m-instruct")
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--system_tokens", type=int, default=1000)
    parser.add_argument("--max_tokens", type=int, default=4)
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--cache_length", type=int, default=256)  # `litkv serve`'s default cache
    parser.add_argument("--baseline_conversations", type=int, default=None, help="default: --conversations")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    baseline = args.conversations if args.baseline_conversations is None else args.baseline_conversations
    if not 1 <= baseline <= args.conversations:
        parser.error(f"--baseline_conversations must be in [1, {args.conversations}], got {baseline}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ckpt = resolve_checkpoint_dir(args.checkpoint)
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    kv = KVCacheConfig(policy=args.policy, cache_length=args.cache_length)
    system = system_prompt(tok, args.system_tokens)
    figures = {}
    for name, state_bytes, n in (("none", 0, baseline), ("shared", 1 << 30, args.conversations)):
        store = ConversationStore(state_bytes, model=model, kv_cache=kv)
        engine = Engine(model, tok, kv, store, fmt=load_format(ckpt, tok, None), max_batch=1)
        figures[name] = run(engine, system, n, args.max_tokens)
    print(f"{ckpt.name}, {args.policy} cache {args.cache_length}, {args.conversations} conversations "
          f"({baseline} without sharing), load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for name, (ttft, reused, _) in figures.items():
        hits = sum(r > 0 for r in reused)
        print(
            f"{name:>6}: hit rate {hits}/{len(reused)} ({hits / len(reused):.0%}), reused tokens "
            f"{statistics.mean(reused):.0f} mean, TTFT mean {statistics.mean(ttft) * 1e3:.0f} ms, "
            f"median {statistics.median(ttft) * 1e3:.0f} ms"
        )
    speedup = statistics.mean(figures["none"][0]) / statistics.mean(figures["shared"][0])
    same = figures["none"][2] == figures["shared"][2][:baseline]
    print(f"mean TTFT none / shared: {speedup:.2f}x; replies equal ({baseline} conversations): {same}")


if __name__ == "__main__":
    main()
