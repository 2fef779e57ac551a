"""KV blocks on a real model: time to first token and quality of spliced blocks against a full prefill.

Prompts are a chat user message made of N documents of about `--block_tokens` tokens (RULER's noise
haystack, each document with its own title) and a needle question (RULER's niah_single wording; the
needle sits in one document at a random sentence; generated offline with `--seed`).

- **TTFT** (`--ttft_blocks`, e.g. 2 4 8): a previous prompt with the same documents in another order fills
  the stores, then the measured prompt (documents shuffled) is prefilled by: a full prefill; the prefix
  store (`PrefixCache`, which restores only up to the first document that moved; also shown when the
  order repeats); the block store at `r = 0` and at `r = 0.15`. Best of `--repeats`.
- **Quality** (`--quality_blocks` documents, `--samples` prompts): for r in `--ratios`, the KL divergence
  KL(full || spliced) of the next-token distributions over the full prefill's greedy answer (teacher-
  forced, `--answer_tokens` positions), and the retrieval accuracy (the greedy answer contains the
  needle's value), beside the full prefill's own accuracy.
- **Batch** (`--batch_prompts P`): P questions after the same `--quality_blocks` documents, `--answer_tokens`
  new tokens each, one after another and as one batch (`generate` with one prompt, then all),
  the blocks already stored; wall and CPU seconds, best of `--repeats`.
- **Recomputation cost** (`--cost_blocks N`): the blocks' TTFT at each r of `--ratios` with the store
  already holding the blocks, in CPU seconds of the process (steadier than wall time on a shared
  machine; 1 thread) and wall seconds, best of `--repeats`, and the number of model calls.

    python scripts/bench_blocks.py --checkpoint smollm2-135m-instruct --threads 1 | tee report.txt
    python scripts/bench_blocks.py --plot_from report.txt --plot docs/blocks.png
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from litkv import GPT, KVCacheConfig, PrefixCache, generate, restore, snapshot
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.cli.common import resolve_checkpoint_dir
from litkv.core.tokens import encode_plain
from litkv.eval.ruler import FALLBACK_WORDS, NOISE, NiahFormat
from litkv.inference.blocks import (
    Segment,
    prefill_segments,
    prompt_segments,
)
from litkv.inference.chat_template import load_format
from litkv.states.block_store import BlockStore

# RULER's niah question, asked as a chat user would (a small instruct model answers it with the number).
QUESTION = "\nWhat is the special magic number for {key} mentioned in the provided text? Answer with the number only."


def make_sample(tokenizer: object, rng: random.Random, n_blocks: int, block_tokens: int) -> tuple[list[str], str, str]:
    """`n_blocks` documents (one holds the needle), the question, the needle's value."""
    per = len(encode_plain(tokenizer, NOISE + " "))
    fmt = NiahFormat()
    key, value = rng.choice(FALLBACK_WORDS), str(rng.randint(10**6, 10**7 - 1))
    docs = []
    for i in range(n_blocks):
        title = f"Document {i + 1}: on the {rng.choice(FALLBACK_WORDS)} and the {rng.choice(FALLBACK_WORDS)}.\n"
        docs.append([title] + [NOISE + " "] * max(1, block_tokens // per - 1))
    holder = docs[rng.randrange(n_blocks)]
    holder.insert(rng.randrange(1, len(holder) + 1), fmt.needle.format(key=key, value=value))
    question = QUESTION.format(key=key)
    return ["".join(d) + "\n" for d in docs], question, value


def _prefill(
    model: GPT, segments: list[Segment], cfg: KVCacheConfig, mode: str, store: object, ratio: float = 0.0
) -> tuple[torch.Tensor, int]:
    """Prefill into the attached caches: `full`, `prefix` (a PrefixCache) or `blocks` (a BlockStore)."""
    if mode == "full":
        return prefill_segments(model, [Segment(torch.cat([s.ids for s in segments]))], cfg)
    if mode == "prefix":
        ids = torch.cat([s.ids for s in segments])
        hidden, next_pos = store.prefill(model, [ids], cfg)  # type: ignore[attr-defined]
        return hidden[:, -1], int(next_pos[0])
    return prefill_segments(model, segments, cfg, store, ratio)  # type: ignore[arg-type]


def ttft(
    model: GPT, segments: list[Segment], cfg: KVCacheConfig, mode: str, store: object, ratio: float = 0.0
) -> float:
    """Seconds from nothing to the first token (prefill + logits + argmax)."""
    with model.kv_caches_attached(cfg, 1):
        start = time.perf_counter()
        hidden, _ = _prefill(model, segments, cfg, mode, store, ratio)
        int(model.logits(hidden).argmax())
        return time.perf_counter() - start


def answer(
    model: GPT,
    segments: list[Segment],
    cfg: KVCacheConfig,
    mode: str,
    store: object,
    ratio: float,
    steps: int,
    forced: Sequence[int] | None,
) -> tuple[list[int], torch.Tensor]:
    """One prefill, then the greedy tokens and the log-probabilities `(steps, V)` along them, or, with `forced`,
    along `forced` (teacher-forced from the same prefilled state, restored)."""
    with model.kv_caches_attached(cfg, 1):
        hidden, pos = _prefill(model, segments, cfg, mode, store, ratio)
        state = snapshot(model) if forced is not None else None
        greedy, own = _steps(model, model.logits(hidden)[0], pos, steps, None)
        if state is None:
            return greedy, own
        restore(model, state)
        _, logps = _steps(model, model.logits(hidden)[0], pos, steps, forced)
        return greedy, logps


def _steps(
    model: GPT, logits: torch.Tensor, pos: int, steps: int, forced: Sequence[int] | None
) -> tuple[list[int], torch.Tensor]:
    tokens, logps = [], []
    for i in range(steps):
        logps.append(torch.log_softmax(logits.double(), dim=-1))
        token = int(logits.argmax()) if forced is None else forced[i]
        tokens.append(token)
        logits = model(torch.tensor([[token]]), torch.tensor([[pos + i]]))[0, -1]
    return tokens, torch.stack(logps)


def run_ttft(model: GPT, tokenizer: object, fmt: object, cfg: KVCacheConfig, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    print(
        "\n| blocks | prompt tokens | full prefill | prefix store, order repeated | prefix store, shuffled "
        "| blocks r=0 | blocks r=0.15 |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.ttft_blocks:
        docs, question, _ = make_sample(tokenizer, rng, n, args.block_tokens)
        order = list(range(n))
        shuffled = order[:]
        while n > 1 and shuffled == order:
            rng.shuffle(shuffled)
        first = prompt_segments(fmt, tokenizer, [docs[i] for i in order], question)
        second = prompt_segments(fmt, tokenizer, [docs[i] for i in shuffled], question)
        blocks, prefix = BlockStore(1 << 34), PrefixCache(1 << 34)
        ttft(model, first, cfg, "blocks", blocks)  # fills the block store
        ttft(model, first, cfg, "prefix", prefix)  # fills the prefix store
        times = {k: [] for k in ("full", "prefix_same", "prefix", "r0", "r15")}
        for _ in range(args.repeats):
            times["full"].append(ttft(model, second, cfg, "full", None))
            times["prefix_same"].append(ttft(model, first, cfg, "prefix", prefix))
            filled = _copy_prefix(model, first, cfg)  # filled by the first prompt only, outside the timing
            times["prefix"].append(ttft(model, second, cfg, "prefix", filled))
            times["r0"].append(ttft(model, second, cfg, "blocks", blocks, 0.0))
            times["r15"].append(ttft(model, second, cfg, "blocks", blocks, 0.15))
        length = sum(s.ids.numel() for s in second)
        best = {k: min(v) for k, v in times.items()}
        cells = " | ".join(
            f"{best[k] * 1000:.0f} ms ({best['full'] / best[k]:.1f}x)" for k in ("prefix_same", "prefix", "r0", "r15")
        )
        print(f"| {n} | {length} | {best['full'] * 1000:.0f} ms | {cells} |", flush=True)


def _copy_prefix(model: GPT, segments: list[Segment], cfg: KVCacheConfig) -> PrefixCache:
    """A prefix store holding the states of `segments`' prompt (filled outside the timing)."""
    store = PrefixCache(1 << 34)
    with model.kv_caches_attached(cfg, 1):
        store.prefill(model, [torch.cat([s.ids for s in segments])], cfg)
    return store


def run_quality(model: GPT, tokenizer: object, fmt: object, cfg: KVCacheConfig, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed + 1)
    kl = {r: [] for r in args.ratios}
    hits = {r: 0 for r in args.ratios}
    full_hits = 0
    for _ in range(args.samples):
        docs, question, value = make_sample(tokenizer, rng, args.quality_blocks, args.block_tokens)
        rng.shuffle(docs)
        segments = prompt_segments(fmt, tokenizer, docs, question)
        store = BlockStore(1 << 34)
        ref_tokens, ref = answer(model, segments, cfg, "full", None, 0.0, args.answer_tokens, None)
        full_hits += value in tokenizer.decode(torch.tensor(ref_tokens))
        for r in args.ratios:
            tokens, got = answer(model, segments, cfg, "blocks", store, r, args.answer_tokens, ref_tokens)
            kl[r].append(float((ref.exp() * (ref - got)).sum(dim=-1).mean()))  # type: ignore[operator]
            hits[r] += value in tokenizer.decode(torch.tensor(tokens))
        print(f"sample: value {value}, full answer {tokenizer.decode(torch.tensor(ref_tokens))!r}", flush=True)
    length = sum(s.ids.numel() for s in segments)
    print(
        f"\n{args.samples} samples, {args.quality_blocks} blocks, ~{length} prompt tokens; "
        f"full prefill accuracy {full_hits}/{args.samples}\n"
    )
    print("| r | mean KL(full \\|\\| spliced), nats | max KL | accuracy |")
    print("|---|---|---|---|")
    for r in args.ratios:
        print(f"| {r:.0%} | {sum(kl[r]) / len(kl[r]):.4f} | {max(kl[r]):.4f} | {hits[r]}/{args.samples} |")


def run_cost(model: GPT, tokenizer: object, fmt: object, cfg: KVCacheConfig, args: argparse.Namespace) -> None:
    """`--cost_blocks`: what selective recomputation costs, per r: model calls, CPU and wall time to the first token."""
    docs, question, _ = make_sample(tokenizer, random.Random(args.seed), args.cost_blocks, args.block_tokens)
    segments = prompt_segments(fmt, tokenizer, docs, question)
    store = BlockStore(1 << 34)
    ttft(model, segments, cfg, "blocks", store)  # fills the store
    calls = [0]
    forward = model.forward

    def counted(*a: object, **k: object) -> object:
        calls[0] += 1
        return forward(*a, **k)

    model.forward = counted  # type: ignore[method-assign]
    length = sum(s.ids.numel() for s in segments)
    print(f"\n{args.cost_blocks} blocks, {length} prompt tokens\n")
    print("| r | model calls | CPU time | wall time |\n|---|---|---|---|")
    try:
        for ratio in args.ratios:
            cpu, wall = [], []
            for _ in range(args.repeats):
                calls[0] = 0
                start = time.process_time()
                wall.append(ttft(model, segments, cfg, "blocks", store, ratio))
                cpu.append(time.process_time() - start)
            print(f"| {ratio:.0%} | {calls[0]} | {min(cpu) * 1000:.0f} ms | {min(wall) * 1000:.0f} ms |", flush=True)
    finally:
        model.forward = forward  # type: ignore[method-assign]


def run_batch(model: GPT, tokenizer: object, fmt: object, cfg: KVCacheConfig, args: argparse.Namespace) -> None:
    """`--batch_prompts`: P prompts sharing the documents, one after another and as one batch."""
    rng = random.Random(args.seed)
    docs, _, _ = make_sample(tokenizer, rng, args.quality_blocks, args.block_tokens)
    prompts = []
    for _ in range(args.batch_prompts):
        question = QUESTION.format(key=rng.choice(FALLBACK_WORDS))
        prompts.append(prompt_segments(fmt, tokenizer, docs, question))
    store = BlockStore(1 << 34)
    n = args.answer_tokens
    generate(model, prompts[:1], 1, cfg, block_store=store)  # fills the store

    def sequential() -> object:
        return [generate(model, [p], n, cfg, block_store=store)[0] for p in prompts]

    print(f"\n{args.batch_prompts} prompts after {args.quality_blocks} documents, {n} new tokens each\n")
    print("| decoding | wall time | CPU time |\n|---|---|---|")
    for name, run in (
        ("one after another", sequential),
        ("one batch", lambda: generate(model, prompts, n, cfg, block_store=store)),
    ):
        cpu, wall = [], []
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        print(f"| {name} | {min(wall) * 1000:.0f} ms | {min(cpu) * 1000:.0f} ms |", flush=True)


def plot(report: Path, out: Path) -> None:
    """Quality against r and TTFT against the number of blocks, from a report this script printed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft_rows, quality_rows = [], []
    for line in report.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdigit() and len(cells) == 7:
            ttft_rows.append([int(cells[0])] + [float(c.split(" ms")[0]) / 1000 for c in cells[2:]])
        elif line.startswith("| ") and cells[0].endswith("%") and len(cells) == 4:
            hits, total = cells[3].split("/")
            quality_rows.append((float(cells[0][:-1]), float(cells[1]), int(hits) / int(total)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = ("full prefill", "prefix store, order repeated", "prefix store, shuffled", "blocks r=0", "blocks r=0.15")
    for i, name in enumerate(names):
        left.plot([r[0] for r in ttft_rows], [r[i + 1] for r in ttft_rows], marker="o", label=name)
    left.set(xlabel="blocks of ~512 tokens (shuffled) + question", ylabel="TTFT, s", title="time to first token")
    left.legend(fontsize=7)
    ratios = [q[0] for q in quality_rows]
    right.plot(ratios, [q[1] for q in quality_rows], marker="o", color="C3", label="mean KL(full || spliced)")
    right.set(xlabel="recomputed tokens r, %", ylabel="KL, nats", title="quality against r")
    twin = right.twinx()
    twin.plot(ratios, [q[2] for q in quality_rows], marker="s", color="C2", label="accuracy")
    twin.set(ylabel="needle accuracy", ylim=(0, 1.05))
    right.legend(loc="center right", bbox_to_anchor=(1.0, 0.6), fontsize=7)
    twin.legend(loc="center right", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="smollm2-135m-instruct")
    parser.add_argument("--block_tokens", type=int, default=512)
    parser.add_argument("--ttft_blocks", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--quality_blocks", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.0, 0.05, 0.15, 0.3])
    parser.add_argument("--answer_tokens", type=int, default=20)
    parser.add_argument("--chunk_size", type=int, default=256)
    parser.add_argument("--batch_prompts", type=int, default=0, help="prompts of the batch table (0: none)")
    parser.add_argument("--cost_blocks", type=int, default=0, help="blocks of the recomputation cost table (0: none)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot_from", type=Path, default=None, help="a report of this script: plot it and exit")
    parser.add_argument("--plot", type=Path, default=Path("docs/blocks.png"))
    args = parser.parse_args()
    if args.plot_from is not None:
        plot(args.plot_from, args.plot)
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ckpt = resolve_checkpoint_dir(Path(args.checkpoint) if Path(args.checkpoint).exists() else args.checkpoint)
    model, tokenizer = load_model(ckpt), load_tokenizer(ckpt)
    fmt = load_format(ckpt, tokenizer, None)
    longest = max([*args.ttft_blocks, args.quality_blocks, args.cost_blocks]) * (args.block_tokens + 64) + 256
    cfg = KVCacheConfig("dense", cache_length=longest, chunk_size=args.chunk_size)
    print(
        f"{ckpt.name}, dense cache, chunk {args.chunk_size}, {torch.get_num_threads()} thread(s), CPU, "
        f"format {fmt.name}"
    )
    with torch.inference_mode():
        if args.ttft_blocks:
            run_ttft(model, tokenizer, fmt, cfg, args)
        if args.samples:
            run_quality(model, tokenizer, fmt, cfg, args)
        if args.cost_blocks:
            run_cost(model, tokenizer, fmt, cfg, args)
        if args.batch_prompts:
            run_batch(model, tokenizer, fmt, cfg, args)


if __name__ == "__main__":
    main()
