"""litkv's fitted eviction gates run by kvpress 0.5.5's `KVzapPress` on the same weights (issue 45, item 2).

KVzap's surrogate (`kvpress.presses.kvzap_press.KVzapModel`, linear variant) is one `nn.Linear(hidden,
n_kv_heads)` per layer applied to the hidden state the attention layer receives (the output of its input
RMSNorm). litkv's gate (`litkv.gates.gate.EvictionGates`) is `logit = k_pre . w[l, g] / sqrt(D) + b[l, g]`
on the pre-RoPE key, and the pre-RoPE key of a Llama layer is `W_k h + b_k` of that same normed hidden
state `h`. So the gate *is* such a linear layer, exactly:

    weight[g] = sum_d w[l, g, d] / sqrt(D) * W_k[g * D + d, :]      bias[g] = b[l, g] + w[l, g] . b_k[g] / sqrt(D)

`export_linear` computes it; the script writes a `KVzapModel` directory (`save_pretrained`: config.json and
model.safetensors), reads it back with `KVzapModel.from_pretrained`, and hands it to a `KVzapPress`
(`model_type="linear"`) in place of the hub download (`post_init_from_model` loads
`nvidia/KVzap-linear-<model>` from the hub; none is reachable here, so the press gets the local surrogate
under that name). Then for each budget `b` the same prompt (`heldout.txt` tokens, `--length`) is

- prefilled by the Hugging Face twin (`compare_kvpress.build_twin`, float32, eager) under the press with
  the ratio that keeps exactly `b` positions per head (`ScorerPress`: the top `b` scores, no sinks, no
  window); the kept positions are found by matching kept keys with an uncompressed run's
  (`parity_kvpress.kvpress_kept`);
- prefilled by litkv's `learned` policy, one-shot, `budget=b`, `sinks=0`, `recent=0` (so that it keeps
  the top `b` gate logits per head, as the press does), then `compress_all`.

Prints the Jaccard `|A & B| / |A | B|` per budget (mean and minimum over layers and KV heads, and per layer)
and writes them with the largest |logit difference| between the exported surrogate on the twin's hidden
states and litkv's gate logits on its keys. Runs in the kvpress environment with litkv on the path
(scripts/parity_kvpress.py describes that venv):

    PYTHONPATH=. ../venv-kvpress/bin/python scripts/parity_kvzap.py CHECKPOINT_DIR --out out/parity_kvzap

`CHECKPOINT_DIR` must hold `eviction_gates.safetensors` (e.g. the converted SmolLM2-135M-Instruct, or a
`litkv finetune --learn_eviction true` output's `final/`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from litkv.gates.gate import EvictionGates

__all__ = ["export_linear"]


def export_linear(
    gates: EvictionGates, k_weights: Sequence[torch.Tensor], k_biases: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """KVzap's linear surrogate equal to `gates`: weight `(L, G, C)` and bias `(L, G)`, float64, such that
    `weight[l] @ h + bias[l]` is layer `l`'s gate logit of the token whose normed hidden state is `h` `(C,)`.

    `k_weights[l]` is layer `l`'s key projection `(G * D, C)` (Hugging Face `k_proj.weight` layout: KV head
    `g` owns rows `g * D : (g + 1) * D`, in the order RoPE is applied to), `k_biases[l]` its bias `(G * D,)`
    or `None`.
    """
    n_layer, g, d = gates.weight.shape
    if len(k_weights) != n_layer or len(k_biases) != n_layer:
        raise ValueError(f"gates have {n_layer} layers, got {len(k_weights)} key weights / {len(k_biases)} biases")
    weights, biases = [], []
    for layer in range(n_layer):
        w = gates.weight[layer].double() / math.sqrt(d)  # (G, D)
        k = k_weights[layer].double()
        if k.shape[0] != g * d:
            raise ValueError(f"layer {layer}: key projection has {k.shape[0]} rows, gates expect {g} x {d}")
        weights.append(torch.einsum("gd,gdc->gc", w, k.view(g, d, -1)))
        bias = gates.bias[layer].double()
        if k_biases[layer] is not None:
            bias = bias + (w * k_biases[layer].double().view(g, d)).sum(dim=-1)
        biases.append(bias)
    return torch.stack(weights), torch.stack(biases)


def kvzap_model(weight: torch.Tensor, bias: torch.Tensor, out_dir: Path):
    """Write the surrogate as a `KVzapModel` directory and read it back with `from_pretrained`."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    n_layer, g, c = weight.shape
    model = KVzapModel(KVzapConfig(input_dim=c, output_dim=g, n_modules=n_layer))
    with torch.no_grad():
        for layer, module in enumerate(model.layers):
            module.weight.copy_(weight[layer])
            module.bias.copy_(bias[layer])
    model.save_pretrained(out_dir)
    return KVzapModel.from_pretrained(out_dir).float().eval()


def make_press(surrogate, twin, ratio: float):
    """A `KVzapPress` (linear) whose hub surrogate is `surrogate` (set under the name the press would load)."""
    from kvpress import KVzapPress

    press = KVzapPress(compression_ratio=ratio, model_type="linear")
    press.kvzap_model_name = f"nvidia/KVzap-linear-{twin.config.name_or_path.split('/')[-1]}"
    press.kvzap_model = surrogate
    return press


@torch.inference_mode()
def logit_difference(model, twin, surrogate, ids: torch.Tensor) -> tuple[float, float, list[torch.Tensor]]:
    """Largest |surrogate(h) - gate logit| over layers, KV heads and tokens of `ids` `(1, n)` (the exported
    layer on the twin's normed hidden states against litkv's gates on its own pre-RoPE keys), the largest
    |gate logit| (its scale), and litkv's gate logits per layer `(G, n)`."""
    from litkv.gates.gate import unrotate_keys
    from litkv.kvcache.config import KVCacheConfig

    n = ids.shape[1]
    hidden: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: hidden.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True
        )
        for i, layer in enumerate(twin.model.layers)
    ]
    try:
        twin.model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    pos = torch.arange(n)[None]
    cos, sin = model.rope(pos)
    worst, scale, logits = 0.0, 0.0, []
    with model.kv_caches_attached(KVCacheConfig("dense", cache_length=n), batch_size=1) as caches:
        model(ids, input_pos=pos)
        for layer, cache in enumerate(caches):
            keys = cache.storage.read()[0][:, :, :n]
            gate = model.eviction_gates.logits(layer, unrotate_keys(keys, cos, sin, model.config.rope_n_elem))
            ours = surrogate.layers[layer](hidden[layer]).transpose(1, 2)  # (1, G, n)
            worst = max(worst, float((ours - gate).abs().max()))
            scale = max(scale, float(gate.abs().max()))
            logits.append(gate[0])
    return worst, scale, logits


def off_tie(ours: set[int], theirs: set[int], logits: torch.Tensor, budget: int, tol: float) -> int:
    """Positions kept by one side only whose gate logit `(n,)` is more than `tol` from the `budget`-th largest
    (a disagreement that a tie, or rounding at the cut, does not explain)."""
    cut = float(logits.topk(budget).values[-1])
    return sum(1 for p in ours ^ theirs if abs(float(logits[p]) - cut) > tol)


def main(argv: Sequence[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_kvpress import build_twin, ratio_for_budget
    from parity_kvpress import jaccard, kvpress_kept, litkv_kept, prompt_ids

    from litkv.checkpoints.checkpoint import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", type=Path, help="a checkpoint with eviction_gates.safetensors")
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens (heldout.txt)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--chunk", type=int, default=128, help="litkv prefill chunk")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("out/parity_kvzap"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = load_model(args.checkpoint_dir, dtype=torch.float32)  # checks the gates' fingerprint
    if model.eviction_gates is None:
        raise SystemExit(f"{args.checkpoint_dir} has no eviction_gates.safetensors")
    twin = build_twin(args.checkpoint_dir)
    attn = [layer.self_attn for layer in twin.model.layers]
    weight, bias = export_linear(model.eviction_gates, [a.k_proj.weight for a in attn], [a.k_proj.bias for a in attn])
    surrogate = kvzap_model(weight, bias, args.out / "kvzap_model")
    ids = prompt_ids(args.length, 0, args.checkpoint_dir)
    n = ids.shape[1]
    diff, scale, logits = logit_difference(model, twin, surrogate, ids)
    print(f"{n} tokens; max |KVzapModel(h) - gate logit| = {diff:.2e} (max |gate logit| {scale:.2f})", flush=True)
    results = {}
    for budget in args.budgets:
        theirs = kvpress_kept(twin, ids, make_press(surrogate, twin, ratio_for_budget(n, budget)))
        ours = litkv_kept(model, ids, "learned", {"sinks": 0, "recent": 0}, budget, args.chunk)
        per = [[jaccard(a, b) for a, b in zip(la, lb, strict=True)] for la, lb in zip(ours, theirs, strict=True)]
        flat = [j for layer in per for j in layer]
        layers = [sum(row) / len(row) for row in per]
        tol = 10 * diff  # well above the two routes' rounding
        unexplained = sum(
            off_tie(a, b, logits[layer][g], budget, tol)
            for layer, (la, lb) in enumerate(zip(ours, theirs, strict=True))
            for g, (a, b) in enumerate(zip(la, lb, strict=True))
        )
        results[str(budget)] = {
            "mean": sum(flat) / len(flat), "min": min(flat), "per_layer": layers, "per_head": per,
            "off_tie_disagreements": unexplained, "tie_tolerance": tol,
        }  # fmt: skip
        print(
            f"budget {budget:5d}: Jaccard mean {sum(flat) / len(flat):.4f} min {min(flat):.4f}; per layer min "
            f"{min(layers):.4f} (layer {layers.index(min(layers))}); positions kept by one side only and not "
            f"within {tol:.1e} of the cut: {unexplained}",
            flush=True,
        )
    info = {"checkpoint": args.checkpoint_dir.name, "length": n, "max_logit_difference": diff, "max_abs_logit": scale}
    info["elapsed_s"] = time.perf_counter() - start
    (args.out / "parity_kvzap.json").write_text(json.dumps({**info, "results": results}, indent=1) + "\n")
    print(f"per layer and head: {args.out / 'parity_kvzap.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
