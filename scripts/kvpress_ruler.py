"""RULER samples through NVIDIA kvpress's presses, on transformers' own load of the same GGUF file.

Runs in its own environment (it does not import litkv):

    python3 -m venv ../venv-kvpress && ../venv-kvpress/bin/pip install torch==2.13.0
    ../venv-kvpress/bin/pip install kvpress==0.5.5 "transformers<5.3,>=5.0" accelerate gguf

Inputs: `scripts/export_ruler_samples.py` (under litkv) writes the samples, token ids and references,
exactly as `litkv evaluate --tasks` makes them. For every press and budget b, the prompt but its last
token is prefilled under the press with the compression ratio that keeps exactly b positions (kvpress's
one-shot setting: the whole prompt is compressed once, question included), then the answer is decoded
greedily with nothing more evicted; scored with RULER's string_match_all. Unlike litkv's continuous
rows (b slots for the whole run, evicting at every chunk of 64 and every decode step), the answer's
tokens come on top of b here.

    ../venv-kvpress/bin/python scripts/kvpress_ruler.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --samples out/ruler_samples.json --budgets 128,256
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
from compare_kvpress import ratio_for_budget  # the budget -> compression ratio of the recall comparison
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

PRESSES: dict[str, Callable[[float], kvpress.BasePress]] = {
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


@torch.inference_mode()
def answer(model: Any, press: kvpress.BasePress | None, ids: list[int], new: int, stop: int) -> list[int]:
    """Prefill `ids[:-1]` under `press`, then decode greedily from the last prompt token."""
    n = len(ids)
    cache = DynamicCache()
    prompt = torch.tensor([ids[:-1]])
    if press is None:
        model.model(input_ids=prompt, past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=prompt, past_key_values=cache)
    out: list[int] = []
    token, pos = ids[-1], n - 1
    for _ in range(new):
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[pos]]))
        token, pos = int(logits.logits[0, -1].argmax()), pos + 1
        if token == stop:
            break
        out.append(token)
    return out


def score(prediction: str, references: list[str]) -> float:
    """RULER's string_match_all for one sample: the share of references found (case-insensitive)."""
    return sum(r.lower() in prediction.lower() for r in references) / len(references)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--samples", type=Path, required=True)
    p.add_argument("--budgets", default="128,256")
    p.add_argument("--presses", default=",".join(PRESSES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json_out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    directory, name = str(args.gguf.parent), args.gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    stop = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    data = json.loads(args.samples.read_text())
    tasks = sorted({s["task"] for s in data["samples"]})
    rows: dict[str, dict[str, float]] = {}
    plan = [("dense (no press)", None, None)] + [
        (f"{press} @{b}", press, int(b)) for b in args.budgets.split(",") for press in args.presses.split(",")
    ]
    for label, press_name, budget in plan:
        start, per_task = time.perf_counter(), {t: [] for t in tasks}
        for s in data["samples"]:
            press = None if press_name is None else PRESSES[press_name](ratio_for_budget(len(s["ids"]) - 1, budget))
            out = answer(model, press, s["ids"], s["max_new_tokens"], stop)
            per_task[s["task"]].append(score(tokenizer.decode(out), s["references"]))
        rows[label] = {t: sum(v) / len(v) for t, v in per_task.items()}
        cells = " | ".join(f"{rows[label][t]:.2f}" for t in tasks)
        mean = sum(rows[label].values()) / len(tasks)
        print(f"| {label} | {cells} | {mean:.2f} | {time.perf_counter() - start:.0f} s |", flush=True)
    if args.json_out:
        args.json_out.write_text(
            json.dumps({"tasks": tasks, "rows": rows, "kvpress": importlib.metadata.version("kvpress")})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
