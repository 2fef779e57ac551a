"""Multi-turn chat workload against `litkv serve` and `litgpt serve` on the same checkpoint.

For each count N of `--clients` (default 1 2 4 8), N clients at once, each running one conversation of
`--turns` turns through the `openai` client (streaming), each turn adding a user message of about
`--words` words, replies of at most `--max_tokens` tokens. Reports the aggregate tokens/s (reply tokens
counted by re-tokenising the replies, the same way for both servers, over the wall time) and the time
to first token (TTFT) of each turn, p50 and p95 over the N clients. Then `--conversations` conversations
one after another, and the server's RSS (all its processes) after each.

`litkv-1row` is litkv with `--max_batch 1` (the peer of one client: a server meant for one user).
`litgpt serve` is litgpt's own server code (`litgpt.deploy.serve.OpenAISpecLitAPI` on LitServe, as
`litgpt serve --openai_spec true` builds it) started here only to bind 127.0.0.1; it reads
`lit_model.pth`, so the checkpoint is copied to a temporary directory with its weights in that file.

    nice python scripts/bench_serve.py --checkpoint smollm2-135m-instruct --turns 3 --clients 1 2 4 8
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import psutil

TEXT = (
    "and it came to pass when the king heard these words that he rent his clothes and went up into the "
    "house of the lord and the servants of the king said unto him behold the land is before thee"
)
WORDS = TEXT.split()


def user_message(conversation: int, turn: int, words: int) -> str:
    start = (conversation * 7 + turn * 13) % len(WORDS)
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(words)).capitalize() + "."


def litgpt_checkpoint(src: Path) -> Path:
    """A copy of `src` with the weights in `lit_model.pth` (what litgpt's LLM.load reads)."""
    import torch
    from safetensors.torch import load_file

    out = Path(tempfile.mkdtemp(prefix="bench-serve-litgpt-"))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    torch.save(load_file(str(src / "model.safetensors")), out / "lit_model.pth")
    return out


LITGPT_LAUNCH = """
import sys
from pathlib import Path
from litserve import LitServer
from litserve.specs.openai import OpenAISpec
from litgpt.deploy.serve import OpenAISpecLitAPI
api = OpenAISpecLitAPI(checkpoint_dir=Path(sys.argv[1]), quantize=None, precision="32-true", temperature=0.8,
                       top_k=50, top_p=1.0, max_new_tokens=50, devices=1, api_path="/predict")
LitServer(api, spec=OpenAISpec(), accelerator="cpu", devices=1, stream=True, timeout=600).run(
    host="127.0.0.1", port=int(sys.argv[2]), generate_client_file=False)
"""


def start(kind: str, ckpt: Path, port: int, args: argparse.Namespace) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if kind.startswith("litkv"):  # litkv-1row: a one-row server (--max_batch 1), the lone client's peer
        argv = [
            sys.executable,
            "-m",
            "litkv",
            "serve",
            str(ckpt),
            "--port",
            str(port),
            "--num_threads",
            str(args.threads),
            "--kv-cache",
            args.policy,
            "--kv_cache.cache_length",
            str(args.cache_length),
            "--stop_at_newline",
            "false",
            "--state_bytes",
            str(args.state_bytes),
            "--max_batch",
            str(1 if kind == "litkv-1row" else args.max_batch),
        ]
    else:
        argv = [sys.executable, "-c", LITGPT_LAUNCH, str(litgpt_checkpoint(ckpt)), str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    end = time.monotonic() + 180
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{kind} serve did not come up")


def rss_mib(proc: subprocess.Popen) -> float:
    root = psutil.Process(proc.pid)
    procs = [root, *root.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20


def conversation(client: openai.OpenAI, c: int, args: argparse.Namespace) -> tuple[list[float], int, float]:
    """One conversation; (TTFT of each turn, tokens received, seconds)."""
    messages: list[dict] = []
    ttfts, tokens, t0 = [], 0, time.perf_counter()
    for t in range(args.turns):
        messages.append({"role": "user", "content": user_message(c, t, args.words)})
        sent = time.perf_counter()
        first, parts = None, []
        stream = client.chat.completions.create(
            model=client.model_name,
            messages=messages,
            stream=True,
            max_completion_tokens=args.max_tokens,
            temperature=0.8,
            seed=c,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
        ttfts.append((first or time.perf_counter()) - sent)
        messages.append({"role": "assistant", "content": "".join(parts)})
        tokens += len(args.tokenizer.encode(messages[-1]["content"], add_special_tokens=False).ids)
    return ttfts, tokens, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(kind: str, args: argparse.Namespace) -> dict:
    proc = start(kind, args.checkpoint, args.port, args)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", timeout=600)
        client.model_name = client.models.list().data[0].id if kind.startswith("litkv") else "litgpt"
        loads = {}
        for n in args.clients:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                t0 = time.perf_counter()
                results = list(pool.map(lambda c: conversation(client, c, args), [100 * n + c for c in range(n)]))
                seconds = time.perf_counter() - t0
            per_turn = [[r[0][t] for r in results] for t in range(args.turns)]
            loads[n] = {
                "tps": sum(r[1] for r in results) / seconds,
                "p50": [percentile(t, 0.5) for t in per_turn],
                "p95": [percentile(t, 0.95) for t in per_turn],
            }
            print(kind, n, "clients", loads[n], flush=True)
        rss = []
        for c in range(args.conversations):
            conversation(client, 10000 + c, args)
            rss.append(rss_mib(proc))
        return {"loads": loads, "rss": rss}
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server, then end whatever of its process tree is left (LitServe's own main process
    dies on SIGTERM without stopping its workers)."""
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    for child in children:
        if child.is_running():
            child.kill()


QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How do plants grow?",
    "Tell me a fun fact about cats.",
    "What is 12 times 7?",
    "Give me a tip for learning Python.",
]


def count_retokenize(args: argparse.Namespace) -> None:
    """In process: how many replies' text does not re-tokenize to the ids the server fed (a fresh server
    given that text would feed other tokens), over `--retokenize` sampled single-turn replies."""
    import torch

    from litkv.checkpoints.checkpoint import load_model, load_tokenizer
    from litkv.inference.chat_template import load_format
    from litkv.modeling.config import KVCacheConfig
    from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.checkpoint), load_tokenizer(args.checkpoint)
    kv = KVCacheConfig(policy=args.policy, cache_length=args.cache_length)
    store = ConversationStore(0, model=model, kv_cache=kv)
    fmt = load_format(args.checkpoint, tok, None)
    engine = Engine(model, tok, kv, store, fmt=fmt, stop_at_newline=False, max_batch=1)
    counts: dict[str, list[int]] = {}
    for i in range(args.retokenize):
        question = QUESTIONS[i % len(QUESTIONS)]
        result = TurnResult()
        request = TurnRequest([("user", question)], args.max_tokens, temperature=0.8, seed=i)
        "".join(engine.run(request, result))
        seen = counts.setdefault(result.finish_reason, [0, 0])
        seen[0] += 1
        seen[1] += engine.text_ids(result.content) != result.reply_ids
    for reason, (n, bad) in counts.items():
        print(f"finish_reason {reason}: {bad} of {n} replies do not re-tokenize to their ids")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=Path(__file__).parents[1] / "litkv/assets/default")
    p.add_argument("--conversations", type=int, default=20, help="sequential conversations for the RSS")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--words", type=int, default=30)
    p.add_argument("--max_tokens", type=int, default=24)
    p.add_argument("--policy", default="h2o")
    p.add_argument("--cache_length", type=int, default=256)
    p.add_argument("--state_bytes", type=int, default=64 << 20)
    p.add_argument("--max_batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=18765)
    p.add_argument("--servers", nargs="+", default=["litkv", "litkv-1row", "litgpt"], help="litkv, litkv-1row, litgpt")
    p.add_argument("--retokenize", type=int, default=0, help="only count replies that do not re-tokenize")
    args = p.parse_args()
    from tokenizers import Tokenizer

    if not args.checkpoint.exists():  # a model name: litkv's cache directory of it
        from litkv.checkpoints.download import cache_dir

        args.checkpoint = cache_dir(str(args.checkpoint))
    if args.retokenize:
        count_retokenize(args)
        return
    args.tokenizer = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))  # counts both servers' replies
    results = {kind: run(kind, args) for kind in args.servers}
    turns = " | ".join(f"TTFT t{i + 1} p50 / p95 (ms)" for i in range(args.turns))
    print(f"| server | clients | tok/s | {turns} |")
    print("|---" * (args.turns + 3) + "|")
    for kind, r in results.items():
        for n, load in r["loads"].items():
            ttft = " | ".join(f"{1000 * a:.0f} / {1000 * b:.0f}" for a, b in zip(load["p50"], load["p95"], strict=True))
            print(f"| {kind} | {n} | {load['tps']:.1f} | {ttft} |")
    if "litkv" in results and 1 in results["litkv"]["loads"]:
        one = results["litkv"]["loads"][1]["tps"]
        for peer in ("litkv-1row", "litgpt"):
            if peer in results and 1 in results[peer]["loads"]:
                print(f"\none client: litkv {one:.2f} tok/s = {one / results[peer]['loads'][1]['tps']:.2f}x {peer}")
    print("\n| server | RSS after conversation 1 / 10 / last (MiB) | conversations |\n|---|---|---|")
    for kind, r in results.items():
        rss = r["rss"]
        mid = rss[min(9, len(rss) - 1)] if rss else 0.0
        print(f"| {kind} | {rss[0] if rss else 0:.0f} / {mid:.0f} / {rss[-1] if rss else 0:.0f} | {len(rss)} |")


if __name__ == "__main__":
    main()
