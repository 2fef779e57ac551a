"""Pass-key recall of NVIDIA kvpress presses on a Hugging Face twin of litkv's shipped model (issue 10).

Runs in its own environment with kvpress and transformers (it does not import litkv):

    python3 -m venv ../venv-kvpress && . ../venv-kvpress/bin/activate
    pip install torch==2.13.0 && pip install kvpress==0.5.5 "transformers<5.3,>=5.0" safetensors tokenizers pyyaml

Inputs, made once by `scripts/export_recall_examples.py` under the litkv environment:
`recall_examples.json` (the exact token ids of litkv's recall examples) and
`reference_logits.safetensors` (litkv's float32 logits on a window of heldout.txt).

Steps:
1. Build a `LlamaForCausalLM` from the LitGPT checkpoint directory (`model_config.yaml` ->
   `LlamaConfig`; LitGPT weight names -> Hugging Face names; litgpt 0.5.13 lays the fused `attn.qkv`
   weight out as [all query heads, all key heads, all value heads], see `copy_weights_llama` in
   `litgpt/scripts/convert_lit_checkpoint.py`), float32 on CPU, eager attention (ObservedAttentionPress
   needs the attention weights).
2. Check the twin: its logits on the reference window must equal litkv's within `--tolerance`.
3. For every press and budget b: the context (filler + needle, n tokens) is prefilled under the press
   with `compression_ratio` chosen so that kvpress keeps exactly b of the n context positions
   (`1 - b / n`); then the question is appended at its true positions (no compression) and the
   answer decoded greedily, as in kvpress's `KVPressTextGenerationPipeline`. A hit iff the decoded
   token ids equal the answer's.
4. Print a markdown table (mean recall over all examples) and write per-depth detail to
   `--out/kvpress_recall.json`.

Unlike litkv's budget (cache slots for the whole sequence, question and answer included), kvpress's b
bounds only the compressed context: the question and answer tokens are added on top.

With `--litkv POLICY ...` (litkv on the path: `PYTHONPATH=.`, and litgpt installed in this environment)
the same examples also run through litkv's own model and policies, in two modes:

- one-shot, as kvpress: the context prefilled in chunks of 64 with `mode="one-shot"`, `budget=b` and
  room for every token, compressed (`compress_all`), then the question and the answer decoded without
  eviction; options as in `scripts/parity_kvpress.py` (the kvpress-equivalent settings);
- continuous, litkv's default: `cache_length=b` slots for the whole sequence (question and answer
  included), evicting at every chunk of 64 and every decode step, the policy's default options.

    python scripts/compare_kvpress.py --examples_dir out/kvpress_compare --out out/kvpress_compare
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import kvpress
import torch
import yaml
from kvpress.utils import compute_n_kept
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO / "litkv" / "assets" / "default"
EXAMPLES_FILE = "recall_examples.json"
REFERENCE_FILE = "reference_logits.safetensors"
RESULT_FILE = "kvpress_recall.json"
EXPORT = "scripts/export_recall_examples.py (under the litkv environment)"
DENSE = "dense (no press)"

# press name -> factory of a press from its compression ratio
PRESSES: dict[str, Callable[[float], kvpress.BasePress]] = {
    "ObservedAttentionPress": lambda r: kvpress.ObservedAttentionPress(compression_ratio=r),
    "SnapKVPress": lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=64),
    "KnormPress": lambda r: kvpress.KnormPress(compression_ratio=r),
    "ExpectedAttentionPress": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
    "KeyDiffPress": lambda r: kvpress.KeyDiffPress(compression_ratio=r),
    "TOVAPress": lambda r: kvpress.TOVAPress(compression_ratio=r),
    "StreamingLLMPress": lambda r: kvpress.StreamingLLMPress(compression_ratio=r),
    # masks keys per head instead of removing them; needs a non-eager twin
    "AdaKVPress(ExpectedAttentionPress)": lambda r: kvpress.AdaKVPress(
        kvpress.ExpectedAttentionPress(compression_ratio=r)
    ),
}
MASKING = ("AdaKVPress(ExpectedAttentionPress)",)

# LitGPT config fields that must hold these values for the model to be a plain Llama
_LLAMA_FIELDS: dict[str, Any] = {
    "mlp_class_name": "LLaMAMLP",
    "norm_class_name": "RMSNorm",
    "bias": False,
    "attn_bias": False,
    "lm_head_bias": False,
    "parallel_residual": False,
    "shared_attention_norm": False,
    "rotary_percentage": 1.0,
    "rope_condense_ratio": 1,
    "rope_adjustments": None,
    "norm_qk": False,
    "post_attention_norm": False,
    "post_mlp_norm": False,
    "scale_embeddings": False,
    "attention_logit_softcapping": None,
    "final_logit_softcapping": None,
    "attention_scores_scalar": None,
    "sliding_window_size": None,
    "n_expert": 0,
    "latent_attention": None,
}


# -- the Hugging Face twin -------------------------------------------------------------------------


def read_lit_config(checkpoint_dir: Path) -> dict[str, Any]:
    """`model_config.yaml` as a mapping; ValueError unless it describes a plain Llama-style model."""
    path = checkpoint_dir / "model_config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (expected a LitGPT checkpoint directory)")
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a mapping, got {type(cfg).__name__}")
    for key, expected in _LLAMA_FIELDS.items():
        if cfg.get(key, expected) != expected:
            raise ValueError(f"{path}: {key} must be {expected!r} for a Llama twin, got {cfg[key]!r}")
    if cfg["n_head"] % cfg["n_query_groups"]:
        raise ValueError(f"n_head ({cfg['n_head']}) must be a multiple of n_query_groups ({cfg['n_query_groups']})")
    return cfg


def llama_config(cfg: dict[str, Any], tie: bool) -> LlamaConfig:
    """The `LlamaConfig` of a LitGPT Llama-style config."""
    return LlamaConfig(
        vocab_size=cfg["padded_vocab_size"],
        hidden_size=cfg["n_embd"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["n_layer"],
        num_attention_heads=cfg["n_head"],
        num_key_value_heads=cfg["n_query_groups"],
        head_dim=cfg["head_size"],
        hidden_act="silu",
        max_position_embeddings=cfg["block_size"],
        rms_norm_eps=cfg["norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg["rope_base"])},
        tie_word_embeddings=tie,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _deinterleave_rows(w: torch.Tensor, n_heads: int, head_size: int) -> torch.Tensor:
    """Reorder each head's output rows from interleaved RoPE pairs to the half-split layout.

    `w`: `(n_heads * head_size, n_embd)`. litkv rotates pairs `(x[2i], x[2i+1])` then returns the
    half-split layout; permuting the rows of both q and k alike leaves `q . k` unchanged.
    """
    order = torch.cat((torch.arange(0, head_size, 2), torch.arange(1, head_size, 2)))
    return w.view(n_heads, head_size, -1)[:, order].reshape(n_heads * head_size, -1)


def convert_weights(lit: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """LitGPT state dict -> `LlamaForCausalLM` state dict (fused qkv split into q/k/v projections)."""
    hs, nh, ng = cfg["head_size"], cfg["n_head"], cfg["n_query_groups"]
    out = {
        "model.embed_tokens.weight": lit["transformer.wte.weight"],
        "model.norm.weight": lit["transformer.ln_f.weight"],
        "lm_head.weight": lit["lm_head.weight"],
    }
    names = {
        "norm_1.weight": "input_layernorm.weight",
        "norm_2.weight": "post_attention_layernorm.weight",
        "attn.proj.weight": "self_attn.o_proj.weight",
        "mlp.fc_1.weight": "mlp.gate_proj.weight",
        "mlp.fc_2.weight": "mlp.up_proj.weight",
        "mlp.proj.weight": "mlp.down_proj.weight",
    }
    for i in range(cfg["n_layer"]):
        src, dst = f"transformer.h.{i}.", f"model.layers.{i}."
        for lit_name, hf_name in names.items():
            out[dst + hf_name] = lit[src + lit_name]
        q, k, v = lit[src + "attn.qkv.weight"].split((nh * hs, ng * hs, ng * hs))
        if cfg.get("rope_interleave", False):
            q, k = _deinterleave_rows(q, nh, hs), _deinterleave_rows(k, ng, hs)
        out[dst + "self_attn.q_proj.weight"] = q
        out[dst + "self_attn.k_proj.weight"] = k
        out[dst + "self_attn.v_proj.weight"] = v
    expected = 3 + cfg["n_layer"] * (len(names) + 1)
    if len(lit) != expected:
        extra = sorted(set(lit) - {"transformer.wte.weight", "transformer.ln_f.weight", "lm_head.weight"})
        raise ValueError(f"expected {expected} LitGPT tensors, got {len(lit)} (e.g. {extra[:3]})")
    return out


def build_twin(checkpoint_dir: Path) -> LlamaForCausalLM:
    """The float32 `LlamaForCausalLM` (eager attention, eval mode) with the checkpoint's weights."""
    cfg = read_lit_config(checkpoint_dir)
    lit = {k: v.float() for k, v in load_file(str(checkpoint_dir / "model.safetensors")).items()}
    tie = torch.equal(lit["lm_head.weight"], lit["transformer.wte.weight"])
    config = llama_config(cfg, tie)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float()
    model.load_state_dict(convert_weights(lit, cfg), strict=True)
    return model.eval()


@torch.inference_mode()
def twin_difference(model: LlamaForCausalLM, reference: Path) -> tuple[float, int]:
    """Max |logit difference| between the twin and litkv on the reference window, and its length."""
    ref = load_file(str(reference))
    ids, expected = ref["ids"], ref["logits"]
    logits = model(input_ids=ids).logits.float()
    if logits.shape != expected.shape:
        raise ValueError(f"twin logits have shape {tuple(logits.shape)}, litkv's {tuple(expected.shape)}")
    return float((logits - expected).abs().max()), ids.shape[1]


# -- recall ----------------------------------------------------------------------------------------


def ratio_for(n_pairs: int, pruned: int) -> float:
    """The float `r` with `int(n_pairs * r) == pruned` (kvpress's count of pruned pairs)."""
    r = pruned / n_pairs
    while int(n_pairs * r) < pruned:
        r = float(torch.nextafter(torch.tensor(r, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)))
    if int(n_pairs * r) != pruned:
        raise ValueError(f"no ratio prunes exactly {pruned} of {n_pairs}")
    return r


def ratio_for_budget(n: int, budget: int) -> float:
    """`1 - budget / n`, nudged up to the float for which kvpress keeps exactly `budget` positions."""
    if not 1 <= budget < n:
        raise ValueError(f"budget must be in [1, {n - 1}] for a context of {n} tokens, got {budget}")
    ratio = 1.0 - budget / n
    for _ in range(8):
        kept = compute_n_kept(n, ratio)
        if kept == budget:
            return ratio
        ratio = math.nextafter(ratio, 0.0 if kept < budget else 1.0)
    raise ValueError(f"no compression ratio keeps exactly {budget} of {n} positions (kvpress keeps {kept})")


@torch.inference_mode()
def recall_one(
    model: LlamaForCausalLM, press: kvpress.BasePress | None, example: dict[str, Any], n_context: int, budget: int
) -> bool:
    """Compress the context `(1, n)` under `press`, append the question, decode the answer greedily."""
    ids = torch.tensor(example["ids"], dtype=torch.long)
    answer = example["ids"][example["answer_start"] :]
    cache = DynamicCache()
    if press is None:
        model.model(input_ids=ids[None, :n_context], past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=ids[None, :n_context], past_key_values=cache)
    if cache.get_seq_length() != (n_context if isinstance(press, kvpress.AdaKVPress) else budget):
        raise RuntimeError(f"kvpress kept {cache.get_seq_length()} positions, expected {budget}")
    question = ids[None, n_context : example["answer_start"]]
    positions = torch.arange(n_context, example["answer_start"])[None]
    logits = model(input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1).logits
    out = [int(logits[0, -1].argmax())]
    for i in range(len(answer) - 1):
        step = torch.tensor([[out[-1]]])
        pos = torch.tensor([[example["answer_start"] + i]])
        out.append(int(model(input_ids=step, past_key_values=cache, position_ids=pos).logits[0, -1].argmax()))
    return out == answer


@torch.inference_mode()
def litkv_recall_one(model: Any, policy: str, options: dict[str, Any] | None, example: dict[str, Any], n_context: int,
                     budget: int) -> bool:  # fmt: skip
    """litkv's recall of one example: one-shot (`options` given) or continuous (`options` None)."""
    from litkv import KVCacheConfig
    from litkv.kvcache.one_shot import compress_all

    ids = torch.tensor(example["ids"], dtype=torch.long)[None]
    answer = example["ids"][example["answer_start"] :]
    total = ids.shape[1]
    if options is None:
        config = KVCacheConfig(policy, cache_length=budget, chunk_size=64)
        ends = [example["answer_start"]]
    else:
        one_shot = {**options, "mode": "one-shot", "budget": budget}
        config = KVCacheConfig(policy, cache_length=total, chunk_size=64, options=one_shot)
        ends = [n_context, example["answer_start"]]
    with model.kv_caches_attached(config, batch_size=1) as caches:
        start = 0
        for end in ends:
            for s in range(start, end, 64):
                e = min(s + 64, end)
                logits = model(ids[:, s:e], input_pos=torch.arange(s, e)[None])
            start = end
            if options is not None and end == n_context:
                compress_all(caches)
        out = [int(logits[0, -1].argmax())]
        for i in range(len(answer) - 1):
            pos = torch.tensor([[example["answer_start"] + i]])
            out.append(int(model(torch.tensor([[out[-1]]]), input_pos=pos)[0, -1].argmax()))
    return out == answer


def run_litkv(model: Any, policy: str, one_shot: bool, budgets: Sequence[int], data: dict[str, Any]) -> dict:
    """Recall per budget and depth (`"mean"` too) of a litkv policy in one mode."""
    from kvpress_pairs import ADAKV, PAIRS

    path, pair_options, _ = {**PAIRS, **ADAKV}[policy]
    options = pair_options if one_shot else None
    result: dict[int, dict[str, float]] = {}
    for budget in budgets:
        hits: dict[float, list[bool]] = {}
        for ex in data["examples"]:
            n = context_length(ex, data["question_ids"])
            hits.setdefault(ex["depth"], []).append(litkv_recall_one(model, path, options, ex, n, budget))
        row = {f"{d:g}": sum(h) / len(h) for d, h in sorted(hits.items())}
        row["mean"] = sum(sum(h) for h in hits.values()) / sum(len(h) for h in hits.values())
        result[budget] = row
    return result


def context_length(example: dict[str, Any], question_ids: Sequence[int]) -> int:
    """Tokens before the question (filler + needle); ValueError if the question is not where expected."""
    n = example["answer_start"] - len(question_ids)
    if n < 1 or example["ids"][n : example["answer_start"]] != list(question_ids):
        raise ValueError(f"example with key {example['key']}: the question ids are not right before the answer")
    return n


def run_press(
    model: LlamaForCausalLM, name: str, budgets: Sequence[int], data: dict[str, Any]
) -> dict[int, dict[str, float]]:
    """Recall per budget and depth (`"mean"` too) of one press (or `DENSE`)."""
    result: dict[int, dict[str, float]] = {}
    model.set_attn_implementation("sdpa" if name in MASKING else "eager")
    for budget in budgets:
        hits: dict[float, list[bool]] = {}
        for ex in data["examples"]:
            n = context_length(ex, data["question_ids"])
            press = None if name == DENSE else PRESSES[name](ratio_for_budget(n, budget))
            hits.setdefault(ex["depth"], []).append(recall_one(model, press, ex, n, n if name == DENSE else budget))
        row = {f"{d:g}": sum(h) / len(h) for d, h in sorted(hits.items())}
        row["mean"] = sum(sum(h) for h in hits.values()) / sum(len(h) for h in hits.values())
        result[budget] = row
        if name == DENSE:
            break
    return result


def markdown_table(results: dict[str, dict[int, dict[str, float]]], budgets: Sequence[int]) -> str:
    """One row per press, one column per budget: mean recall."""
    lines = ["| method | " + " | ".join(f"recall @{b}" for b in budgets) + " |"]
    lines.append("|---|" + "---:|" * len(budgets))
    for name, per_budget in results.items():
        if name == DENSE:
            cells = [f"{next(iter(per_budget.values()))['mean']:.2f} (full cache)"] + [""] * (len(budgets) - 1)
        else:
            cells = [f"{per_budget[b]['mean']:.2f}" for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", type=Path, default=DEFAULT_CHECKPOINT, help="LitGPT checkpoint directory")
    parser.add_argument("--examples_dir", type=Path, default=Path("out/kvpress_compare"), help="exported inputs")
    parser.add_argument("--out", type=Path, default=Path("out/kvpress_compare"), help="where to write the JSON")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512], help="context slots kept")
    parser.add_argument("--presses", nargs="*", default=list(PRESSES), choices=list(PRESSES), help="presses to run")
    parser.add_argument("--litkv", nargs="*", default=[], help="litkv policies to run too (one-shot and continuous)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N examples per depth")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max |logit difference| twin vs litkv")
    return parser.parse_args(argv)


def load_examples(path: Path, limit: int | None) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run {EXPORT} first")
    data = json.loads(path.read_text(encoding="utf-8"))
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        per: dict[float, int] = {}
        kept = []
        for ex in data["examples"]:
            per[ex["depth"]] = per.get(ex["depth"], 0) + 1
            if per[ex["depth"]] <= limit:
                kept.append(ex)
        data["examples"] = kept
    return data


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        from kvpress_pairs import ADAKV, PAIRS

        unknown = sorted(set(args.litkv) - set(PAIRS) - set(ADAKV))
        if unknown:
            raise ValueError(f"--litkv: no kvpress-equivalent options for {unknown}; known: {sorted(PAIRS)}")
        torch.set_num_threads(args.threads)
        data = load_examples(args.examples_dir / EXAMPLES_FILE, args.limit)
        for ex in data["examples"]:
            for budget in args.budgets:
                ratio_for_budget(context_length(ex, data["question_ids"]), budget)
        if not (args.examples_dir / REFERENCE_FILE).is_file():
            raise FileNotFoundError(f"{args.examples_dir / REFERENCE_FILE} does not exist: run {EXPORT} first")
        model = build_twin(args.checkpoint_dir)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return evaluate(model, data, args)


def evaluate(model: LlamaForCausalLM, data: dict[str, Any], args: argparse.Namespace) -> int:
    """Check the twin, run every press, print the table and write the JSON; the exit status."""
    diff, window = twin_difference(model, args.examples_dir / REFERENCE_FILE)
    print(f"twin check: max |logits(HF twin) - logits(litkv)| = {diff:.3g} on {window} tokens of heldout.txt")
    if not diff <= args.tolerance:
        print(f"error: the twin differs from litkv by {diff:.3g} > --tolerance {args.tolerance}", file=sys.stderr)
        return 1
    start = time.perf_counter()
    results = {DENSE: run_press(model, DENSE, args.budgets, data)}
    for name in args.presses:
        results[name] = run_press(model, name, args.budgets, data)
        print(f"{name}: " + ", ".join(f"@{b} {results[name][b]['mean']:.2f}" for b in args.budgets), flush=True)
    if args.litkv:
        from litkv.checkpoints.checkpoint import load_model

        lit = load_model(args.checkpoint_dir, dtype=torch.float32)
        for policy in args.litkv:
            for mode in ("one-shot",) if policy.startswith("adakv") else ("one-shot", "continuous"):
                name = f"litkv {policy} ({mode})"
                results[name] = run_litkv(lit, policy, mode == "one-shot", args.budgets, data)
                print(f"{name}: " + ", ".join(f"@{b} {results[name][b]['mean']:.2f}" for b in args.budgets), flush=True)
    elapsed = time.perf_counter() - start
    print()
    print(markdown_table(results, args.budgets))
    n_ctx = sorted({context_length(ex, data["question_ids"]) for ex in data["examples"]})
    print(f"\n{len(data['examples'])} examples of {data['length']} tokens, context {n_ctx} tokens; {elapsed:.0f} s")
    info = {
        "kvpress": _version("kvpress"),
        "transformers": _version("transformers"),
        "torch": torch.__version__,
        "twin_max_abs_logit_diff": diff,
        "examples": len(data["examples"]),
        "context_lengths": n_ctx,
        "budgets": args.budgets,
        "recall": {name: {str(b): row for b, row in per.items()} for name, per in results.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / RESULT_FILE).write_text(json.dumps(info, indent=2), encoding="utf-8")
    print(f"per-depth detail: {args.out / RESULT_FILE}")
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
