"""RULER samples through NVIDIA kvpress's presses on the same weights, as kvpress's pipeline runs them.

Runs in its own environment (it does not import litkv):

    python3 -m venv ../venv-kvpress && ../venv-kvpress/bin/pip install torch==2.13.0
    ../venv-kvpress/bin/pip install kvpress==0.5.5 "transformers<5.3,>=5.0" accelerate gguf safetensors pyyaml

Inputs: `scripts/export_ruler_samples.py` (under litkv) writes the samples (token ids, where the context
ends, references) exactly as `litkv evaluate --tasks` makes them. The model is the float32 Hugging Face
twin of a litkv checkpoint (`--checkpoint`, `compare_kvpress.build_twin`: litkv's own weights; `KVzipPress`
reads the tokenizer and chat template from that directory) or transformers' load of a GGUF file (`--gguf`).

For every press and budget b (`--compress context`, the default, as kvpress's pipeline and
`litkv evaluate`'s one-shot rows): the sample's context is prefilled under the press with the compression
ratio that keeps exactly b positions per KV head (`KVzipPress`: b x heads x layers pairs over all layers,
its default), then its question (the rest of the chat template and the answer's start) is fed at the
positions after the context with nothing evicted, and the answer decoded greedily. `--compress prompt`:
the whole prompt but its last token is compressed instead. Scored with RULER's string_match_all; one JSON
line per (press, budget, sample) is appended to `--jsonl` as it is answered (sample by sample, the tasks
interleaved), so a stopped run keeps what it answered.

    cd scripts && ../../venv-kvpress/bin/python kvpress_ruler.py --checkpoint CHECKPOINT_DIR \\
        --samples ../out/ruler_samples.json --budgets 1024,512 --presses KVzipPress,SnapKVPress --jsonl ../out/kvp.jsonl
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvpress
import torch
from compare_kvpress import build_twin, ratio_for, ratio_for_budget  # the twin; budget -> kvpress ratio
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

PRESSES: dict[str, Callable[[float], kvpress.BasePress]] = {
    "KVzipPress": lambda r: kvpress.KVzipPress(compression_ratio=r),
    "KnormPress": lambda r: kvpress.KnormPress(compression_ratio=r),
    "SnapKVPress": lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=64),
    "TOVAPress": lambda r: kvpress.TOVAPress(compression_ratio=r),
    "KeyDiffPress": lambda r: kvpress.KeyDiffPress(compression_ratio=r),
    "StreamingLLMPress": lambda r: kvpress.StreamingLLMPress(compression_ratio=r),
    "ExpectedAttentionPress": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
    "AdaKVPress(ExpectedAttentionPress)": lambda r: kvpress.AdaKVPress(
        kvpress.ExpectedAttentionPress(compression_ratio=r)
    ),
}


def ratio_over_layers(n: int, budget: int, heads: int, layers: int) -> float:
    """The ratio `r` for which `KVzipPress` (budgets across layers) prunes exactly `(n - budget) x heads x
    layers` of its `n x heads x layers` scores (`int(numel * r)`)."""
    return ratio_for(n * heads * layers, (n - budget) * heads * layers)


def make_press(name: str, n: int, budget: int, config: Any) -> kvpress.BasePress:
    """Press `name` keeping `budget` of `n` context positions per KV head."""
    if name == "KVzipPress":
        return PRESSES[name](ratio_over_layers(n, budget, config.num_key_value_heads, config.num_hidden_layers))
    return PRESSES[name](ratio_for_budget(n, budget))


@torch.inference_mode()
def answer(model: Any, press: kvpress.BasePress | None, ids: list[int], split: int, new: int, stop: int) -> list[int]:
    """Prefill `ids[:split]` under `press`, feed `ids[split:]` after it (nothing evicted), decode greedily."""
    cache = DynamicCache()
    context = torch.tensor([ids[:split]])
    if press is None:
        model.model(input_ids=context, past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=context, past_key_values=cache)
    rest = torch.tensor([ids[split:]])
    logits = model(input_ids=rest, past_key_values=cache, position_ids=torch.arange(split, len(ids))[None]).logits
    out: list[int] = []
    token, pos = int(logits[0, -1].argmax()), len(ids)
    while token != stop:
        out.append(token)
        if len(out) == new:
            break
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[pos]]))
        token, pos = int(logits.logits[0, -1].argmax()), pos + 1
    return out


def score(prediction: str, references: list[str]) -> float:
    """RULER's string_match_all for one sample: the share of references found (case-insensitive)."""
    return sum(r.lower() in prediction.lower() for r in references) / len(references)


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    if args.checkpoint is not None:
        model = build_twin(args.checkpoint)
        model.config._attn_implementation = "sdpa"  # KVzipPress masks pairs and refuses eager attention
        model.config.name_or_path = str(args.checkpoint)  # KVzipPress reads the tokenizer from there
        return model, AutoTokenizer.from_pretrained(str(args.checkpoint))
    directory, name = str(args.gguf.parent), args.gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="a litkv checkpoint directory (its float32 HF twin)")
    source.add_argument("--gguf", type=Path, help="a GGUF file (transformers' load)")
    p.add_argument("--samples", type=Path, required=True)
    p.add_argument("--budgets", default="128,256")
    p.add_argument("--presses", default=",".join(PRESSES))
    p.add_argument("--compress", choices=["context", "prompt"], default="context")
    p.add_argument("--dense", action="store_true", help="also the row without a press")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jsonl", type=Path, default=None, help="append one line per answered sample")
    p.add_argument("--json_out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args)
    stop = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    data = json.loads(args.samples.read_text())
    tasks = sorted({s["task"] for s in data["samples"]})
    rows: dict[str, dict[str, float]] = {}
    plan = [("dense (no press)", None, None)] if args.dense else []
    plan += [(f"{press} @{b}", press, int(b)) for b in args.budgets.split(",") for press in args.presses.split(",")]
    per_row: dict[str, dict[str, list[float]]] = {label: {t: [] for t in tasks} for label, _, _ in plan}
    by_task = [[s for s in data["samples"] if s["task"] == t] for t in tasks]
    order = [rows_[i] for i in range(max(len(r) for r in by_task)) for rows_ in by_task if i < len(rows_)]
    for s in order:  # sample by sample, the tasks interleaved: a stopped run keeps whole samples
        for label, press_name, budget in plan:
            start = time.perf_counter()
            ids = s["ids"]
            split = s["context_length"] if args.compress == "context" else len(ids) - 1
            press = None if press_name is None else make_press(press_name, split, budget, model.config)
            prediction = tokenizer.decode(answer(model, press, ids, split, s["max_new_tokens"], stop))
            per_row[label][s["task"]].append(score(prediction, s["references"]))
            wall = time.perf_counter() - start
            print(f"{s['task']} {label}: {per_row[label][s['task']][-1]:.2f} {wall:.0f} s", flush=True)
            if args.jsonl:
                line = {"row": label, "task": s["task"], "sample": s.get("sample")}
                line["score"] = per_row[label][s["task"]][-1]
                with args.jsonl.open("a") as f:
                    f.write(json.dumps({**line, "prediction": prediction, "wall_s": round(wall, 1)}) + "\n")
    for label, per_task in per_row.items():
        rows[label] = {t: sum(v) / len(v) for t, v in per_task.items()}
        cells = " | ".join(f"{rows[label][t]:.2f}" for t in tasks)
        print(f"| {label} | {cells} | {sum(rows[label].values()) / len(tasks):.2f} |")
    if args.json_out:
        version = importlib.metadata.version("kvpress")
        summary = {"tasks": tasks, "rows": rows, "kvpress": version, "compress": args.compress}
        args.json_out.write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
