"""Kept-set parity of litkv's policies (one-shot mode) with NVIDIA kvpress presses (issue 19, item 3).

Runs in the kvpress environment with litkv on the path (litkv needs litgpt there too):

    python3 -m venv ../venv-kvpress && ../venv-kvpress/bin/pip install torch==2.13.0
    ../venv-kvpress/bin/pip install kvpress==0.5.5 "transformers<5.4" litgpt==0.5.13 safetensors pyyaml
    PYTHONPATH=. ../venv-kvpress/bin/python scripts/parity_kvpress.py --out out/parity

For each model (the shipped default, and a random GQA Llama written to a temporary checkpoint), each
pair (litkv policy, kvpress press) and each budget `b`: the same prompt of `n` tokens is

- prefilled by the Hugging Face twin (`compare_kvpress.build_twin`, eager attention, float32) under
  the press, with the compression ratio for which kvpress keeps exactly `b` positions; the kept
  positions of each layer and KV head are found by matching the kept keys with the keys of an
  uncompressed run (exact copies);
- prefilled by litkv in chunks of `--chunk` tokens with `mode="one-shot"`, `budget=b` and
  `cache_length=n`, then compressed (`compress_all`); the kept positions are the slots' positions.

The Jaccard overlap `|A & B| / |A | B|` of the two kept sets is reported per layer and KV head (JSON)
and as mean / min per pair and budget (markdown table). litkv runs with the options that make its
policy the press's (`PAIRS`), or with its own defaults (`--litkv_defaults`: what the defaults change).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvpress
import torch
import yaml
from safetensors.torch import save_file
from transformers import DynamicCache, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_kvpress import DEFAULT_CHECKPOINT, build_twin, ratio_for_budget  # noqa: E402
from kvpress_pairs import ADAKV, PAIRS, WINDOW  # noqa: E402

from litkv import KVCacheConfig  # noqa: E402
from litkv.checkpoints.checkpoint import load_model, load_tokenizer  # noqa: E402
from litkv.kvcache.one_shot import compress_all  # noqa: E402
from litkv.modeling.model import GPT  # noqa: E402

PRESS_NAMES = {
    "adakv-expected-attention": "AdaKVPress(ExpectedAttentionPress), alpha 0.2",
    "adakv-snapkv": f"AdaKVPress(SnapKVPress window {WINDOW}), alpha 0.2",
    "knorm": "KnormPress",
    "keydiff": "KeyDiffPress",
    "tova": "TOVAPress",
    "snapkv": f"SnapKVPress (window {WINDOW}, kernel 5)",
    "expected-attention": "ExpectedAttentionPress",
    "last-recent": "StreamingLLMPress (4 sinks)",
    "h2o": "ObservedAttentionPress",
}


def random_gqa_checkpoint(out_dir: Path, seed: int) -> Path:
    """A random Llama-style model with GQA (8 query heads, 2 KV heads, head size 64, 3 layers, RoPE base
    500000) written as a LitGPT checkpoint; weights ~ N(0, 1/fan_in) so that attention is peaked."""
    cfg = yaml.safe_load((DEFAULT_CHECKPOINT / "model_config.yaml").read_text(encoding="utf-8"))
    cfg.update(name="random-gqa", n_layer=3, n_head=8, n_query_groups=2, head_size=64, n_embd=256)
    cfg.update(intermediate_size=512, rope_base=500000)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "model_config.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    from litkv.checkpoints.checkpoint import load_config

    torch.manual_seed(seed)
    model = GPT(load_config(out_dir))
    state = {}
    for name, tensor in model.state_dict().items():
        fan_in = tensor.shape[-1] if tensor.dim() == 2 else 1
        state[name] = torch.randn_like(tensor) / fan_in**0.5 if tensor.dim() == 2 else torch.ones_like(tensor)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    return out_dir


@torch.inference_mode()
def kvpress_kept(twin: LlamaForCausalLM, ids: torch.Tensor, press: kvpress.BasePress) -> list[list[set[int]]]:
    """Kept positions per layer and KV head of the twin's cache after prefilling `ids` `(1, n)` under `press`."""
    full = DynamicCache()
    twin.model(input_ids=ids, past_key_values=full)
    cache = DynamicCache()
    with press(twin):
        twin.model(input_ids=ids, past_key_values=cache)
    kept = []
    for layer in range(len(cache.layers)):
        ref, got = full.layers[layer].keys[0], cache.layers[layer].keys[0]  # (H, n, D), (H, b, D)
        heads = []
        for h in range(ref.shape[0]):
            match = (got[h][:, None, :] == ref[h][None, :, :]).all(dim=-1)  # (b, n)
            if not bool((match.sum(dim=1) == 1).all()):
                raise RuntimeError(f"layer {layer} head {h}: a kept key matches no single original key")
            heads.append(set(match.float().argmax(dim=1).tolist()))
        kept.append(heads)
    return kept


@torch.inference_mode()
def kvpress_kept_masked(twin: LlamaForCausalLM, ids: torch.Tensor, press: kvpress.BasePress) -> list[list[set[int]]]:
    """Kept positions of a press that masks keys per head (AdaKVPress): all minus `masked_key_indices`."""
    cache = DynamicCache()
    with press(twin):
        twin.model(input_ids=ids, past_key_values=cache)
    n = ids.shape[1]
    kept = []
    for layer in twin.model.layers:
        attn = layer.self_attn
        heads = [set(range(n)) for _ in range(twin.config.num_key_value_heads)]
        _, head_idx, seq_idx = attn.masked_key_indices
        for h, j in zip(head_idx.tolist(), seq_idx.tolist(), strict=True):
            heads[h].discard(j)
        attn.masked_key_indices = None
        kept.append(heads)
    return kept


@torch.inference_mode()
def litkv_kept(
    model: GPT, ids: torch.Tensor, policy: str, options: dict[str, Any], budget: int, chunk: int
) -> list[list[set[int]]]:
    """Kept positions per layer and KV head after a chunked one-shot prefill of `ids` and `compress_all`."""
    n = ids.shape[1]
    config = KVCacheConfig(
        policy, cache_length=n, chunk_size=chunk, options={**options, "mode": "one-shot", "budget": budget}
    )
    with model.kv_caches_attached(config, batch_size=1) as caches:
        pos = torch.arange(n)[None]
        for start in range(0, n, chunk):
            model(ids[:, start : start + chunk], input_pos=pos[:, start : start + chunk])
        compress_all(caches)
        return [
            [{p for p in c.positions[0, g].tolist() if p >= 0} for g in range(c.positions.shape[1])] for c in caches
        ]


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / max(len(a | b), 1)


def compare(
    model: GPT, twin: LlamaForCausalLM, ids: torch.Tensor, budgets: Sequence[int], chunk: int, defaults: bool
) -> dict:
    """`{pair: {budget: per-layer lists of per-head Jaccard}}` (litkv's default options with `defaults`)."""
    n = ids.shape[1]
    out: dict[str, dict[int, list[list[float]]]] = {}
    for name, (policy, options, make_press) in PAIRS.items():
        out[name] = {}
        for budget in budgets:
            ours = litkv_kept(model, ids, policy, {} if defaults else options, budget, chunk)
            theirs = kvpress_kept(twin, ids, make_press(ratio_for_budget(n, budget)))
            out[name][budget] = [
                [jaccard(a, b) for a, b in zip(la, lb, strict=True)] for la, lb in zip(ours, theirs, strict=True)
            ]
        cells = ", ".join(f"@{b} {_mean(out[name][b]):.3f}" for b in budgets)
        print(f"  {name}: {cells}", flush=True)
    twin.set_attn_implementation("sdpa")  # AdaKVPress refuses eager attention
    try:
        for name, (policy, options, make_press) in ADAKV.items():
            out[name] = {}
            for budget in budgets:
                ours = litkv_kept(model, ids, policy, options, budget, chunk)
                theirs = kvpress_kept_masked(twin, ids, make_press(ratio_for_budget(n, budget)))
                out[name][budget] = [
                    [jaccard(a, b) for a, b in zip(la, lb, strict=True)] for la, lb in zip(ours, theirs, strict=True)
                ]
            cells = ", ".join(f"@{b} {_mean(out[name][b]):.3f}" for b in budgets)
            print(f"  {name}: {cells}", flush=True)
    finally:
        twin.set_attn_implementation("eager")
    return out


def _mean(per_layer: list[list[float]]) -> float:
    values = [v for layer in per_layer for v in layer]
    return sum(values) / len(values)


def _min(per_layer: list[list[float]]) -> float:
    return min(v for layer in per_layer for v in layer)


def markdown(results: dict[str, dict], budgets: Sequence[int]) -> str:
    head = "| litkv policy (one-shot) | kvpress press | model | " + " | ".join(
        f"Jaccard @{b} mean (min)" for b in budgets
    )
    lines = [head + " |", "|---|---|---|" + "---:|" * len(budgets)]
    for model_name, per_pair in results.items():
        for pair, per_budget in per_pair.items():
            cells = [f"{_mean(per_budget[b]):.3f} ({_min(per_budget[b]):.2f})" for b in budgets]
            lines.append(f"| {pair} | {PRESS_NAMES[pair]} | {model_name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prompt_ids(n: int, seed: int, tokenizer_dir: Path = DEFAULT_CHECKPOINT) -> torch.Tensor:
    """`(1, n)` token ids: the start of the shipped model's heldout text in `tokenizer_dir`'s tokenizer
    (random ids if too short)."""
    text = (DEFAULT_CHECKPOINT / "heldout.txt").read_text(encoding="utf-8")
    ids = load_tokenizer(tokenizer_dir).encode(text)[:n]
    if ids.numel() < n:
        ids = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed))
    return ids.long()[None]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=512, help="prompt tokens")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--chunk", type=int, default=64, help="litkv prefill chunk")
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--litkv_defaults", action="store_true", help="litkv's default options (not kvpress's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("out/parity"))
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="compare on this checkpoint only (e.g. the real model's, from `litkv download`), its own tokenizer",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in set(PAIRS) - set(args.pairs):
        del PAIRS[name]
    ids = prompt_ids(args.length, args.seed, args.checkpoint or DEFAULT_CHECKPOINT)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = (
            [(args.checkpoint.name, args.checkpoint)]
            if args.checkpoint
            else [
                ("shipped", DEFAULT_CHECKPOINT),
                ("random GQA 8/2", random_gqa_checkpoint(Path(tmp) / "gqa", args.seed)),
            ]
        )
        for label, checkpoint in models:
            print(f"{label}: {checkpoint.name}", flush=True)
            model, twin = load_model(checkpoint, dtype=torch.float32), build_twin(checkpoint)
            results[label] = compare(model, twin, ids, args.budgets, args.chunk, args.litkv_defaults)
    print()
    print(markdown(results, args.budgets))
    args.out.mkdir(parents=True, exist_ok=True)
    info = {
        "kvpress": _version("kvpress"),
        "transformers": _version("transformers"),
        "length": args.length,
        "chunk": args.chunk,
        "litkv_defaults": args.litkv_defaults,
        "jaccard": {m: {p: {str(b): v for b, v in pb.items()} for p, pb in r.items()} for m, r in results.items()},
    }
    (args.out / "parity.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    print(f"per layer and head: {args.out / 'parity.json'}")
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
