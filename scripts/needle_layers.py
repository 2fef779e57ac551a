"""Where one-shot policies lose a RULER needle, per layer and KV head, and which layers dense reads it from.

For each sample (`scripts/export_ruler_samples.py`'s JSON: the prompts token for token as `litkv evaluate
--tasks` and `scripts/ruler_slice.py` make them) and each one-shot policy, the context is prefilled once
through that policy's one-shot caches and its budgets are compressed from that one prefill, with the
machinery of `litkv.eval.oneshot` (`snapshot` / `restore`, `compress_kvzip` for `kvzip`, `end_prefill`
for the others). Per layer and KV head it records:

- `kept`: the share of the needle's value tokens (the digits of each reference, first occurrence in the
  context) still in the cache after the compression, per budget;
- `slots`: how many tokens each (layer, KV head) keeps, per budget (`kvzip` shares its budget across layers);
- `rank`: the needle tokens' median rank (0 = the best-scored) in the policy's `oneshot_scores()` among the
  tokens it may evict (finite score: not a sink, not the recent window), and how many those are;
- `reads` (the reference, from a dense forward pass of context + question + the reference answer): the
  share of the attention that the question's and the answer's queries give the needle tokens, averaged over
  those queries and the KV group's query heads; it says which layers read the answer.

One JSON line per (sample, policy) is appended to `--out` as it is done (a stopped run keeps them);
`--summarize` prints the per-layer table of what the files hold.

    python scripts/export_ruler_samples.py smollm2-135m-instruct --tasks niah_single_1,niah_single_2 \\
        --length 4096 --num_samples 1 --out out/samples.json
    python scripts/needle_layers.py smollm2-135m-instruct --samples out/samples.json \\
        --policies kvzip,learned,keydiff,snapkv --budgets 1024,512 --out out/layers.jsonl
    python scripts/needle_layers.py --summarize out/layers.jsonl --budget 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from litkv.eval.oneshot import KVZIP, _with_config
from litkv.inference.generate import pad_prompts
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_score
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.kvcache.kvzip import KVzipKVCache, compress_kvzip
from litkv.modeling.model import GPT
from litkv.modeling.runner import run_chunks
from litkv.states.state import restore, snapshot


def needle_positions(ids: Sequence[int], answers: Sequence[Sequence[int]], end: int) -> list[int]:
    """The positions of the first occurrence of each answer's tokens in `ids[:end]` (ValueError if absent)."""
    out: list[int] = []
    for answer in answers:
        n = len(answer)
        start = next((i for i in range(end - n + 1) if list(ids[i : i + n]) == list(answer)), None)
        if start is None:
            raise ValueError(f"the answer's tokens {list(answer)} do not occur in the context")
        out += range(start, start + n)
    return out


@torch.inference_mode()
def policy_layers(
    model: GPT, context: torch.Tensor, configs: Mapping[int, KVCacheConfig], repeat: RepeatPrompt | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, list[torch.Tensor]]]:
    """One prefill of `context` `(T,)` through one-shot caches of one policy, then each budget's compression.

    Args:
        model: the GPT.
        context: the tokens that are compressed.
        configs: budget -> the policy's one-shot config with that budget (`cache_length >= T`).
        repeat: the reconstruction prompt (`kvzip` only).

    Returns:
        Per layer, before the compression: the slots' positions `(G, L)` and `oneshot_scores()` `(G, L)`
        (float32; `inf`: never evicted; `kvzip`: its `n_sink` first positions `inf`); and per budget, per
        layer, the positions left after it `(G, L)` (`-1`: empty slot).
    """
    first = next(iter(configs.values()))
    kvzip = issubclass(first.policy_class, KVzipKVCache)
    if kvzip and repeat is None:
        raise ValueError("kvzip needs its reconstruction prompt (repeat=RepeatPrompt.build(tokenizer, template))")
    idx, pos = pad_prompts([context], model.lm_head.weight.device)
    kept: dict[int, list[torch.Tensor]] = {}
    with model.kv_caches_attached(first, 1):
        run_chunks(model, idx, pos, ChunkPlan.of(first), lm_head=False, last_only=True)
        if kvzip:
            kvzip_score(model, [context], repeat, repeat.prefix_length)  # type: ignore[union-attr]
        state = snapshot(model)
        positions = [c.positions[0].clone() for c in model.caches]
        scores = [c.policy.oneshot_scores()[0].float().clone() for c in model.caches]
        if kvzip:  # compress_kvzip keeps the first n_sink positions whatever they score
            sink = model.caches[0].policy.options.n_sink
            sinks = [(p >= 0) & (p < sink) for p in positions]
            scores = [s.masked_fill(m, float("inf")) for s, m in zip(scores, sinks, strict=True)]
        for budget, config in configs.items():
            restore(model, _with_config(state, config))
            if kvzip:
                compress_kvzip(list(model.caches))  # type: ignore[arg-type]
            else:
                model.caches.end_prefill()
            kept[budget] = [c.positions[0].clone() for c in model.caches]
    return positions, scores, kept


def needle_stats(positions: torch.Tensor, scores: torch.Tensor, needle: Sequence[int]) -> tuple[list[float], list[int]]:
    """Per KV head: the needle tokens' median rank (`statistics.median_low`; 0 = best-scored) among the
    evictable slots (filled, finite score; a needle token that is not evictable ranks 0), and how many
    evictable slots there are. `positions`, `scores`: `(G, L)`."""
    ranks: list[float] = []
    counts: list[int] = []
    for g in range(positions.shape[0]):
        free = (positions[g] >= 0) & torch.isfinite(scores[g])
        pool = scores[g][free]
        per_token = []
        for p in needle:
            slot = (positions[g] == p).nonzero()
            if slot.numel() == 0:
                raise ValueError(f"position {p} is not in the cache")
            s = scores[g, int(slot[0, 0])]
            per_token.append(int((pool > s).sum()) if torch.isfinite(s) else 0)
        ranks.append(statistics.median_low(per_token))
        counts.append(int(free.sum()))
    return ranks, counts


def kept_share(kept: torch.Tensor, needle: Sequence[int]) -> list[float]:
    """Per KV head, the share of `needle`'s positions among the kept positions `(G, L)`."""
    want = torch.tensor(list(needle), device=kept.device)
    return [float(torch.isin(want, kept[g]).float().mean()) for g in range(kept.shape[0])]


@torch.inference_mode()
def dense_reads(model: GPT, ids: torch.Tensor, start: int, needle: Sequence[int]) -> list[list[float]]:
    """Per layer and KV head `[layer][g]`: the share of attention that the queries at positions `start..T-1`
    of a dense causal pass over `ids` `(T,)` give the `needle` positions, the mean over those queries and
    the group's query heads (float32 softmax over the scaled dot products, as the model attends)."""
    out: list[list[float]] = []
    want = torch.tensor(list(needle), device=ids.device)

    def hook(module: torch.nn.Module, inputs: tuple, _output: torch.Tensor) -> None:
        q, k, _ = module._qkv(inputs[0], inputs[1], inputs[2])
        _, h, t, _ = q.shape
        g = k.shape[1]
        q = q[0, :, start:].float().view(g, h // g, t - start, -1)
        scores = torch.matmul(q, k[0].float().transpose(1, 2)[:, None]) * module.scale  # (g, h/g, m, t)
        mask = torch.arange(t, device=q.device)[None, :] > torch.arange(start, t, device=q.device)[:, None]
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out.append(probs[..., want].sum(-1).mean(dim=(1, 2)).tolist())

    hooks = [block.attn.register_forward_hook(hook) for block in model.transformer.h]
    try:
        model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    return out


def analyse(
    model: GPT,
    sample: Mapping,
    needle: Sequence[int],
    policies: Mapping[str, Mapping[int, KVCacheConfig]],
    repeat: RepeatPrompt | None,
    answer_ids: Sequence[int],
) -> Iterator[dict]:
    """One record for dense's reads, then one per policy, of `sample` (an exported RULER sample), each
    yielded when done."""
    ids = torch.tensor(sample["ids"], dtype=torch.long)
    split = sample["context_length"]
    start, cpu = time.perf_counter(), time.process_time()
    full = torch.cat((ids, torch.tensor(list(answer_ids), dtype=torch.long)))
    head = {"task": sample["task"], "sample": sample.get("sample"), "needle": list(needle)}
    record = {**head, "policy": "dense", "reads": dense_reads(model, full, split, needle)}
    yield {**record, "wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(time.process_time() - cpu, 1)}
    for name, configs in policies.items():
        start, cpu = time.perf_counter(), time.process_time()
        positions, scores, kept = policy_layers(model, ids[:split], configs, repeat if name == KVZIP else None)
        stats = [needle_stats(p, s, needle) for p, s in zip(positions, scores, strict=True)]
        record = {**head, "policy": name, "rank": [r for r, _ in stats], "evictable": [c for _, c in stats]}
        record["kept"] = {str(b): [kept_share(k, needle) for k in layers] for b, layers in kept.items()}
        record["slots"] = {str(b): [(k >= 0).sum(dim=1).tolist() for k in layers] for b, layers in kept.items()}
        record.update(wall_s=round(time.perf_counter() - start, 1), cpu_s=round(time.process_time() - cpu, 1))
        yield record


def summarize(paths: Sequence[Path], budget: int, top: int = 10) -> str:
    """Markdown tables of what the files hold: per layer (mean over samples and KV heads) dense's reads of the
    needle, then per policy the needle share kept at `budget` and the median needle rank; then per sample
    and policy the share kept over all (layer, head) pairs and weighted by dense's reads (what the answer's
    queries would find); then the `top` (layer, KV head) pairs dense reads the needle from most."""
    lines = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    reads: dict[tuple[str, int], list[list[float]]] = {}
    for r in lines:
        if r["policy"] == "dense":
            reads[(r["task"], r["sample"])] = r["reads"]
    per_layer_reads: dict[int, list[float]] = defaultdict(list)
    for sample_reads in reads.values():
        for layer, per_head in enumerate(sample_reads):
            per_layer_reads[layer] += per_head
    kept: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    rank: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    weighted: dict[tuple[str, int], dict[str, tuple[float, float]]] = defaultdict(dict)
    pairs: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in lines:
        if r["policy"] == "dense" or str(budget) not in r["kept"]:
            continue
        share = r["kept"][str(budget)]
        for layer, per_head in enumerate(share):
            kept[r["policy"]][layer] += per_head
            rank[r["policy"]][layer] += r["rank"][layer]
            for g, v in enumerate(per_head):
                pairs[r["policy"]][(layer, g)].append(v)
        w = reads.get((r["task"], r["sample"]))
        flat = [v for per_head in share for v in per_head]
        if w is not None:
            ws = [v for per_head in w for v in per_head]
            read = sum(a * b for a, b in zip(ws, flat, strict=True)) / sum(ws)
            weighted[(r["task"], r["sample"])][r["policy"]] = (_mean(flat), read)
    names = list(kept)
    out = [f"{len(reads)} samples; budget {budget}; kept: share of the needle's tokens kept; rank: median rank"]
    out += ["", "| layer | dense reads | " + " | ".join(f"{n} kept | {n} rank" for n in names) + " |"]
    out.append("|---:|---:|" + "---:|---:|" * len(names))
    for layer in sorted(per_layer_reads):
        cells = [f"{_mean(kept[n][layer]):.2f} | {statistics.median(rank[n][layer]):.0f}" for n in names]
        out.append(f"| {layer} | {_mean(per_layer_reads[layer]):.3f} | " + " | ".join(cells) + " |")
    cells = [f"{_mean([v for per in kept[n].values() for v in per]):.2f} | -" for n in names]
    out.append("| all | | " + " | ".join(cells) + " |")
    out += ["", "| sample | " + " | ".join(f"{n} kept (read-weighted)" for n in names) + " |"]
    out.append("|---|" + "---:|" * len(names))
    for (task, i), per in weighted.items():
        cells = [f"{per[n][0]:.2f} ({per[n][1]:.2f})" if n in per else "-" for n in names]
        out.append(f"| {task} {i} | " + " | ".join(cells) + " |")
    out += ["", _reading_heads(reads, pairs, top)]
    return "\n".join(out)


def _reading_heads(
    reads: Mapping[tuple[str, int], list[list[float]]],
    pairs: Mapping[str, Mapping[tuple[int, int], list[float]]],
    top: int,
) -> str:
    """The `top` (layer, KV head) pairs dense's answer reads most (mean over samples), with each policy's
    mean needle share kept there."""
    mean_reads: dict[tuple[int, int], list[float]] = defaultdict(list)
    for sample_reads in reads.values():
        for layer, per_head in enumerate(sample_reads):
            for g, v in enumerate(per_head):
                mean_reads[(layer, g)].append(v)
    best = sorted(mean_reads, key=lambda k: -_mean(mean_reads[k]))[:top]
    names = list(pairs)
    out = ["| layer, KV head | dense reads | " + " | ".join(f"{n} kept" for n in names) + " |"]
    out.append("|---|---:|" + "---:|" * len(names))
    for layer, g in best:
        cells = [f"{_mean(pairs[n].get((layer, g), [])):.2f}" for n in names]
        out.append(f"| {layer}, {g} | {_mean(mean_reads[(layer, g)]):.3f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", nargs="?")
    p.add_argument("--samples", type=Path, help="scripts/export_ruler_samples.py's JSON")
    p.add_argument("--policies", default="kvzip,learned,keydiff,snapkv", help="one-shot policies")
    p.add_argument("--budgets", default="1024,512")
    p.add_argument("--length", type=int, default=4096, help="the caches' length (>= the context)")
    p.add_argument("--chunk_size", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("out/needle_layers.jsonl"))
    p.add_argument("--summarize", type=Path, nargs="+", default=None, help="print the table of JSONL files, stop")
    p.add_argument("--budget", type=int, default=1024, help="--summarize: the budget shown")
    args = p.parse_args(argv)
    if args.summarize is not None:
        print(summarize(args.summarize, args.budget))
        return 0
    from litkv.checkpoints.checkpoint import load_tokenizer
    from litkv.checkpoints.runtime import load_for_inference
    from litkv.cli.common import resolve_checkpoint_dir
    from litkv.eval.evaluate import cache_config
    from litkv.inference.chat_template import TemplateFormat, load_format

    ckpt = resolve_checkpoint_dir(args.checkpoint_dir)
    model, _ = load_for_inference(ckpt, "32-true", "cpu", args.threads, "none")
    tokenizer = load_tokenizer(ckpt)
    fmt = load_format(ckpt, tokenizer)
    repeat = RepeatPrompt.build(tokenizer, fmt.template if isinstance(fmt, TemplateFormat) else None)
    template = KVCacheConfig(chunk_size=args.chunk_size)
    budgets = [int(b) for b in args.budgets.split(",")]
    policies = {
        name: {b: cache_config(template, name, args.length, {"mode": "one-shot", "budget": b}) for b in budgets}
        for name in args.policies.split(",")
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for sample in json.loads(args.samples.read_text())["samples"]:
        digits = [tokenizer.processor.encode(" " + r).ids[1:] for r in sample["references"]]
        needle = needle_positions(sample["ids"], digits, sample["context_length"])
        answer = tokenizer.processor.encode(" " + ", ".join(sample["references"])).ids
        for record in analyse(model, sample, needle, policies, repeat, answer):
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{sample['task']} {sample.get('sample')} {record['policy']}: {record['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
