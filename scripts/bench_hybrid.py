"""Decode speed and cache bytes of a Bamba-shaped hybrid model (Mamba-2 + attention), or with `--family qwen3.5`
a Qwen3.5-shaped one (Gated DeltaNet + gated attention; `--width 1024 --layers 24 --attn-every 4` is
Qwen3.5-0.8B's layout, its vocabulary with `--vocab 248320`), against an attention-only model of the same
width and depth, and against transformers' pure-PyTorch Bamba / Qwen3.5.

Random weights. For each prompt length: prefill through litkv's chunk runner, then `--new-tokens` greedy
decode steps timed on their own (tok/s = rows * steps / seconds), and `KVCaches.nbytes()` after them.
Rows: hybrid + h2o (the attention layers' caches bounded; the recurrent state constant), hybrid + dense,
attention-only + h2o, attention-only + dense, and transformers' `BambaForCausalLM` (prefill into its hybrid
cache, then the same timed greedy steps; `--no-transformers` skips it).

With `--turns N` it times instead each turn's first token of an N-turn conversation (`--turn-tokens` each): the
state saved at the previous turn's end restored and only the turn prefilled, against the whole conversation
prefilled cold (`warm_over_cold`).

Run: ``python scripts/bench_hybrid.py`` (``--help`` for the options); prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from litkv import GPT, KVCacheConfig
from litkv.kvcache.config import ChunkPlan
from litkv.modeling.config import Config
from litkv.modeling.hf_hybrid import hybrid_config_from_hf
from litkv.modeling.hf_qwen35 import qwen35_config_from_hf
from litkv.modeling.runner import run_chunks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--family", default="bamba", choices=["bamba", "qwen3.5"])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--attn-every", type=int, default=4, help="attention at layers every N (others Mamba-2)")
    parser.add_argument("--cache-length", type=int, default=512, help="h2o slots per attention layer")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--transformers-max", type=int, default=4096, help="longest prompt run through transformers")
    parser.add_argument(
        "--turns", type=int, default=0, help="also time each turn's first token of a conversation of this many turns"
    )
    parser.add_argument("--turn-tokens", type=int, default=8192, help="tokens of each turn (with --turns)")
    return parser.parse_args()


def bamba_config(args: argparse.Namespace) -> dict:
    """A Bamba `config.json` mapping (attention every `attn_every` layers, Mamba-2 elsewhere)."""
    heads = args.width // 64
    return {
        "model_type": "bamba",
        "vocab_size": args.vocab,
        "hidden_size": args.width,
        "intermediate_size": 4 * args.width,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "attn_layer_indices": list(range(args.attn_every - 1, args.layers, args.attn_every)),
        "mamba_n_heads": 2 * args.width // 64,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "max_position_embeddings": 1 << 16,
        "rms_norm_eps": 1e-5,
    }


def qwen35_config(args: argparse.Namespace) -> dict:
    """A Qwen3.5 text `config.json` mapping: heads of 256 (8 query / 2 KV at width 1,024), a quarter rotated;
    Gated DeltaNet with 16 key and 16 value heads of 128 per 1,024 of width; MLP 3.5x the width."""
    heads = max(1, args.width // 128)
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": args.vocab,
        "hidden_size": args.width,
        "intermediate_size": 7 * args.width // 2,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 256,
        "layer_types": [
            "full_attention" if (i + 1) % args.attn_every == 0 else "linear_attention" for i in range(args.layers)
        ],
        "linear_num_key_heads": max(1, args.width // 64),
        "linear_num_value_heads": max(1, args.width // 64),
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 1 << 18,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }


def attention_only(hybrid: Config) -> Config:
    """LitGPT's `Config` of the same width, depth, heads and MLP, every layer attention."""
    c = hybrid
    return Config(
        name="attention-only", block_size=c.block_size, vocab_size=c.vocab_size, padded_vocab_size=c.padded_vocab_size,
        n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head, n_query_groups=c.n_query_groups, head_size=c.head_size,
        intermediate_size=c.intermediate_size, rotary_percentage=1.0, parallel_residual=False, bias=False,
        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
    )  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def litkv_row(model: GPT, kv: KVCacheConfig, prompt: torch.Tensor, new: int) -> dict:
    """Prefill, then `new` timed greedy decode steps; tok/s and the caches' bytes."""
    device = prompt.device
    t = prompt.shape[1]
    with model.kv_caches_attached(kv, 1) as caches:
        pos = torch.arange(t, device=device)[None]
        start = time.perf_counter()
        hidden = run_chunks(model, prompt, pos, ChunkPlan.of(kv), lm_head=False, last_only=True)
        token = model.logits(hidden[:, -1]).argmax(-1, keepdim=True)
        caches.end_prefill()
        sync(device)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(new):
            token = model.decode_step(token, torch.full((1, 1), t + i, device=device)).argmax(-1, keepdim=True)
        sync(device)
        decode_s = time.perf_counter() - start
        return {
            "prefill_s": round(prefill_s, 3),
            "decode_tok_s": round(new / decode_s, 2),
            "cache_bytes": caches.nbytes(),
        }


@torch.inference_mode()
def transformers_row(hf: torch.nn.Module, prompt: torch.Tensor, new: int) -> dict:
    """transformers' Bamba / Qwen3.5: prefill into its hybrid cache, then `new` timed greedy steps."""
    device, t = prompt.device, prompt.shape[1]
    if hf.config.model_type == "bamba":
        from transformers.models.bamba.modeling_bamba import HybridMambaAttentionDynamicCache

        cache = HybridMambaAttentionDynamicCache(hf.config, 1, dtype=hf.dtype, device=device)
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DynamicCache

        cache = Qwen3_5DynamicCache(hf.config)
    out = hf(prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(t, device=device))
    token = out.logits[:, -1:].argmax(-1)
    sync(device)
    start = time.perf_counter()
    for i in range(new):
        pos = torch.tensor([t + i], device=device)
        out = hf(token, past_key_values=cache, use_cache=True, cache_position=pos)
        token = out.logits[:, -1:].argmax(-1)
    sync(device)
    return {"decode_tok_s": round(new / (time.perf_counter() - start), 2)}


@torch.inference_mode()
def turn_rows(model: GPT, kv: KVCacheConfig, turns: list[torch.Tensor]) -> list[dict]:
    """Time to first token of each turn of a conversation: warm (the state saved at the previous turn's end
    restored, only the turn's tokens prefilled) against cold (the whole conversation so far prefilled from
    empty caches). Replies are left out: each turn is its tokens."""
    from litkv.states.state import restore, snapshot

    device, rows, saved, start = turns[0].device, [], None, 0
    plan = ChunkPlan.of(kv)
    for k, turn in enumerate(turns):
        history = torch.cat(turns[: k + 1], dim=1)
        with model.kv_caches_attached(kv, 1):
            begin = time.perf_counter()
            hidden = run_chunks(
                model, history, torch.arange(history.shape[1], device=device)[None], plan, lm_head=False
            )
            model.logits(hidden[:, -1]).argmax(-1)
            sync(device)
            cold = time.perf_counter() - begin
        with model.kv_caches_attached(kv, 1):
            if saved is not None:
                restore(model, saved)
            begin = time.perf_counter()
            pos = torch.arange(start, start + turn.shape[1], device=device)[None]
            hidden = run_chunks(model, turn, pos, plan, lm_head=False)
            model.logits(hidden[:, -1]).argmax(-1)
            sync(device)
            warm = time.perf_counter() - begin
            saved, start = snapshot(model), start + turn.shape[1]
        rows.append(
            {
                "turn": k + 1,
                "cold_ttft_s": round(cold, 3),
                "warm_ttft_s": round(warm, 3),
                "warm_over_cold": round(warm / cold, 3),
            }
        )
    return rows


def transformers_model(hf_cfg: dict) -> torch.nn.Module:
    """transformers' model of `hf_cfg` (random weights)."""
    fields = {k: v for k, v in hf_cfg.items() if k != "model_type"}
    if hf_cfg["model_type"] == "bamba":
        from transformers import BambaConfig, BambaForCausalLM

        return BambaForCausalLM(BambaConfig(**fields))
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields))


def main() -> None:
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.family == "bamba":
        hf_cfg = bamba_config(args)
        hybrid_config = hybrid_config_from_hf(hf_cfg, "bamba-bench")
    else:
        hf_cfg = qwen35_config(args)
        hybrid_config = qwen35_config_from_hf(hf_cfg, "qwen3.5-bench")
    torch.manual_seed(0)
    models = {"hybrid": GPT(hybrid_config), "attention-only": GPT(attention_only(hybrid_config))}
    for m in models.values():
        m.to(device, dtype).eval()
    hf = None
    if not args.no_transformers:
        hf = transformers_model(hf_cfg).to(device, dtype).eval()
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    print(json.dumps({"device": str(device), "dtype": args.dtype, "params": params, "config": hf_cfg}))
    if args.turns:
        turns = [torch.randint(0, args.vocab, (1, args.turn_tokens), device=device) for _ in range(args.turns)]
        total = args.turns * args.turn_tokens
        kv = KVCacheConfig("dense", cache_length=total, chunk_size=min(args.chunk, total))
        for row in turn_rows(models["hybrid"], kv, turns):
            print(json.dumps({"model": "hybrid", "policy": "dense", **row}), flush=True)
        return
    for t in args.prompts:
        prompt = torch.randint(0, args.vocab, (1, t), device=device)
        for name, model in models.items():
            for policy in ("h2o", "dense"):
                length = args.cache_length if policy == "h2o" else t + args.new_tokens
                kv = KVCacheConfig(policy, cache_length=length, chunk_size=min(args.chunk, length))
                row = litkv_row(model, kv, prompt, args.new_tokens)
                print(json.dumps({"prompt": t, "model": name, "policy": policy, **row}), flush=True)
        if hf is not None and t <= args.transformers_max:
            row = transformers_row(hf, prompt, args.new_tokens)
            name = f"transformers-{args.family}"
            print(json.dumps({"prompt": t, "model": name, "policy": "dynamic", **row}), flush=True)


if __name__ == "__main__":
    main()
