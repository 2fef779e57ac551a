"""Multi-turn chat workload against `litkv serve` and `litgpt serve` on the same checkpoint: the long run.

For each count N of `--clients` (default 1 2 4 8), `--conversations` conversations (one count, or one per
N) go through N clients at once (a client takes the next conversation when its own ends), each of
`--turns` turns through the `openai` client (streaming, greedy: temperature 0). The user messages are
generated offline from `--seed` (about `--words` words each); replies have at most `--max_tokens` tokens.
Reported per N: the aggregate tokens/s (reply tokens counted by re-tokenising the replies, the same way for
both servers, over the wall time) and the time to first token (TTFT) p50 / p95 by turn index over all the
conversations; while it runs, the server's RSS (all its processes) and the bytes in its `--state_dir`
after every finished conversation (the series' first / middle / last / largest value).

Replay (litkv servers, unless `--replay_clients 0`): after the run a fresh server (a new process with an
empty `--state_dir`) replays every recorded conversation, `--replay_clients` at a time: turn t sends the
same user messages and the replies recorded under load for turns before t, and its greedy reply must equal
the one recorded. The mismatches are counted and printed (the contract says 0).

`litkv-1row` is litkv with `--max_batch 1` (the peer of one client: a server meant for one user).
`litgpt serve` is litgpt's own server code (`litgpt.deploy.serve.OpenAISpecLitAPI` on LitServe, as
`litgpt serve --openai_spec true` builds it) started here only to bind 127.0.0.1, greedy; it reads
`lit_model.pth`, so the checkpoint is copied to a temporary directory with its weights in that file.

    nice python scripts/bench_serve.py --checkpoint smollm2-135m-instruct --turns 10 --clients 1 2 4 8 \
        --conversations 2 2 4 16 --max_tokens 8 --words 20
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil

TEXT = (
    "and it came to pass when the king heard these words that he rent his clothes and went up into the "
    "house of the lord and the servants of the king said unto him behold the land is before thee"
)
WORDS = TEXT.split()


def user_messages(seed: int, conversations: int, turns: int, words: int) -> list[list[str]]:
    """`conversations` lists of `turns` user messages, drawn from `seed` alone: each message `words` words of
    TEXT from a random start, 1 in 4 words replaced by a random word of TEXT, capitalised, ending in a period."""
    rng = random.Random(seed)
    out = []
    for _ in range(conversations):
        convo = []
        for _ in range(turns):
            start = rng.randrange(len(WORDS))
            picked = [WORDS[(start + i) % len(WORDS)] for i in range(words)]
            picked = [rng.choice(WORDS) if rng.random() < 0.25 else w for w in picked]
            convo.append(" ".join(picked).capitalize() + ".")
        out.append(convo)
    return out


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
api = OpenAISpecLitAPI(checkpoint_dir=Path(sys.argv[1]), quantize=None, precision="32-true",
                       temperature=float(sys.argv[3]), top_k=50, top_p=1.0, max_new_tokens=50, devices=1,
                       api_path="/predict")
LitServer(api, spec=OpenAISpec(), accelerator="cpu", devices=1, stream=True, timeout=600).run(
    host="127.0.0.1", port=int(sys.argv[2]), generate_client_file=False)
"""


def start(kind: str, ckpt: Path, port: int, state_dir: Path | None, args: argparse.Namespace) -> subprocess.Popen:
    """`kind`'s server on 127.0.0.1:`port`, healthy; litkv's keeps its states in `state_dir` too."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if kind.startswith("litkv"):  # litkv-1row: a one-row server (--max_batch 1), the lone client's peer
        argv = [sys.executable, "-m", "litkv", "serve", str(ckpt), "--port", str(port),
                "--num_threads", str(args.threads), "--kv-cache", args.policy,
                "--kv_cache.cache_length", str(args.cache_length), "--stop_at_newline", "false",
                "--state_bytes", str(args.state_bytes), "--state_dir", str(state_dir),
                "--state_dir_bytes", str(args.state_dir_bytes),
                "--max_batch", str(1 if kind == "litkv-1row" else args.max_batch),
                "--max_step_tokens", str(args.max_step_tokens)]  # fmt: skip
    else:
        argv = [sys.executable, "-c", LITGPT_LAUNCH, str(litgpt_checkpoint(ckpt)), str(port), "0.0"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    proc.copied = None if kind.startswith("litkv") else Path(argv[3])  # removed by stop()
    end = time.monotonic() + 300
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise TimeoutError(f"{kind} serve did not come up")


def rss_mib(proc: subprocess.Popen) -> float:
    """Resident memory of `proc` and all its descendants, MiB."""
    root = psutil.Process(proc.pid)
    procs = [root, *root.children(recursive=True)]
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total / 2**20


def dir_bytes(path: Path | None) -> int:
    """Bytes of the regular files under `path` (0 when it is None or missing); files deleted meanwhile skipped."""
    total = 0
    for root, _, files in os.walk(path) if path else ():
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
    return total


@dataclass
class Sample:
    """The server's resident memory and its state directory's bytes after `done` conversations of a load."""

    clients: int
    done: int
    rss_mib: float
    state_dir_bytes: int


def series(values: list[float]) -> tuple[float, float, float, float]:
    """(first, middle, last, largest) of a non-empty series."""
    return values[0], values[len(values) // 2], values[-1], max(values)


@dataclass
class Record:
    """One conversation as a client saw it: its user messages, and per turn the reply and its TTFT (s)."""

    users: list[str]
    replies: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict]:
        """The request of turn `turn` (0-based): users 0..turn, with the recorded replies in between."""
        out = []
        for t in range(turn + 1):
            out.append({"role": "user", "content": self.users[t]})
            if t < turn:
                out.append({"role": "assistant", "content": self.replies[t]})
        return out


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """One greedy streamed turn: (seconds to its first content, the reply)."""
    sent = time.perf_counter()
    first, parts = None, []
    stream = client.chat.completions.create(
        model=client.model_name, messages=messages, stream=True, max_completion_tokens=max_tokens, temperature=0
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
    return (first or time.perf_counter()) - sent, "".join(parts)


def converse(client: openai.OpenAI, users: list[str], max_tokens: int) -> Record:
    """A conversation of `len(users)` turns, each sending the whole history so far."""
    record = Record(users)
    for t in range(len(users)):
        ttft, reply = ask(client, record.messages(t), max_tokens)
        record.ttfts.append(ttft)
        record.replies.append(reply)
    return record


def through_clients(work, items: list, clients: int, on_done=None) -> tuple[list, float]:
    """`work(item)` for every item, `clients` at a time; results in the items' order, and the wall seconds.
    `on_done(count)` runs after each finished item."""
    t0, results = time.perf_counter(), [None] * len(items)
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        futures = {pool.submit(work, item): i for i, item in enumerate(items)}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            results[futures[future]] = future.result()
            if on_done:
                on_done(done)
    return results, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ttft_by_turn(records: list[Record]) -> list[tuple[float, float]]:
    """(p50, p95) of the TTFT of each turn index over the conversations."""
    turns = len(records[0].ttfts)
    return [(percentile(t, 0.5), percentile(t, 0.95)) for t in ([r.ttfts[i] for r in records] for i in range(turns))]


def ttft_all_turns(records: list[Record]) -> tuple[float, float]:
    """(p50, p95) of the TTFT of every turn of every conversation."""
    ttfts = [t for r in records for t in r.ttfts]
    return percentile(ttfts, 0.5), percentile(ttfts, 0.95)


def mismatches(recorded: list[Record], replayed: list[Record]) -> list[tuple[int, int]]:
    """(conversation, turn) of every reply of `replayed` that differs from `recorded`'s (0-based)."""
    return [
        (c, t)
        for c, (a, b) in enumerate(zip(recorded, replayed, strict=True))
        for t, (x, y) in enumerate(zip(a.replies, b.replies, strict=True))
        if x != y
    ]


def replay_one(client: openai.OpenAI, record: Record, max_tokens: int) -> Record:
    """`record`'s turns asked again with its recorded history (not the replay's own replies)."""
    again = Record(record.users)
    for t in range(len(record.users)):
        ttft, reply = ask(client, record.messages(t), max_tokens)
        again.ttfts.append(ttft)
        again.replies.append(reply)
    return again


def reply_tokens(tokenizer, record: Record) -> int:
    """Tokens of `record`'s replies, re-tokenised (the same count for every server)."""
    return sum(len(tokenizer.encode(x, add_special_tokens=False).ids) for x in record.replies)


def connect(kind: str, port: int) -> openai.OpenAI:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=1200, max_retries=0)
    client.model_name = client.models.list().data[0].id if kind.startswith("litkv") else "litgpt"
    return client


def run(kind: str, args: argparse.Namespace) -> dict:
    """Every load of `args.clients` on one `kind` server: per load its records, seconds and samples."""
    state_dir = Path(tempfile.mkdtemp(prefix="bench-serve-states-"))
    proc = start(kind, args.checkpoint, args.port, state_dir, args)
    loads = {}
    try:
        client = connect(kind, args.port)
        counts = args.litgpt_conversations if kind == "litgpt" else args.conversations
        for n, count in zip(args.clients, counts, strict=True):
            if count == 0:
                continue
            convos = user_messages(args.seed * 1000 + n, count, args.turns, args.words)
            samples = [Sample(n, 0, rss_mib(proc), dir_bytes(state_dir))]

            def sample(done: int, n: int = n, samples: list = samples) -> None:
                samples.append(Sample(n, done, rss_mib(proc), dir_bytes(state_dir)))
                print(f"  {kind} {n} clients: {done} conversations done, {samples[-1]}", file=sys.stderr, flush=True)

            records, seconds = through_clients(lambda u: converse(client, u, args.max_tokens), convos, n, sample)
            tokens = sum(reply_tokens(args.tokenizer, r) for r in records)
            loads[n] = {"records": records, "seconds": seconds, "tps": tokens / seconds, "samples": samples}
            print(f"{kind} {n} clients: {count} conversations, {tokens} tokens in {seconds:.0f} s,"
                  f" {tokens / seconds:.2f} tok/s; TTFT p50 / p95 by turn (s):"
                  f" {', '.join(f'{a:.2f} / {b:.2f}' for a, b in ttft_by_turn(records))}", flush=True)  # fmt: skip
    finally:
        stop(proc)
        shutil.rmtree(state_dir, ignore_errors=True)
    return loads


def replay(kind: str, loads: dict, args: argparse.Namespace) -> dict[int, list[tuple[int, int]]]:
    """Per load, the (conversation, turn) whose reply from a fresh `kind` server (empty `--state_dir`)
    differs from the one recorded under load."""
    state_dir = Path(tempfile.mkdtemp(prefix="bench-serve-replay-"))
    proc = start(kind, args.checkpoint, args.port, state_dir, args)
    try:
        client = connect(kind, args.port)
        out = {}
        for n, load in loads.items():
            t0, bad = time.perf_counter(), []

            def check(record: Record, n: int = n, bad: list = bad) -> Record:  # progress as it goes
                again = replay_one(client, record, args.max_tokens)
                bad.append(sum(x != y for x, y in zip(record.replies, again.replies, strict=True)))
                print(f"  {kind} replay of the {n}-client load: {len(bad)} conversations, {sum(bad)} replies differ",
                      file=sys.stderr, flush=True)  # fmt: skip
                return again

            again, _ = through_clients(check, load["records"], args.replay_clients)
            out[n] = mismatches(load["records"], again)
            seconds = time.perf_counter() - t0
            print(f"{kind} replay of the {n}-client load ({len(again)} conversations, {seconds:.0f} s):"
                  f" {len(out[n])} mismatches {out[n][:5]}", flush=True)  # fmt: skip
        return out
    finally:
        stop(proc)
        shutil.rmtree(state_dir, ignore_errors=True)


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
    if getattr(proc, "copied", None):  # litgpt's copy of the checkpoint
        shutil.rmtree(proc.copied, ignore_errors=True)


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
    from litkv.kvcache.config import KVCacheConfig
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


def report(results: dict, replays: dict, args: argparse.Namespace) -> None:
    """The tables: tok/s and TTFT by turn per server and load; RSS and state bytes; replay mismatches."""
    turns = " | ".join(f"TTFT t{i + 1} p50 / p95 (s)" for i in range(args.turns))
    print(f"\n| server | clients | conversations | tok/s | {turns} |")
    print("|---" * (args.turns + 4) + "|")
    for kind, loads in results.items():
        for n, load in loads.items():
            ttft = " | ".join(f"{a:.2f} / {b:.2f}" for a, b in ttft_by_turn(load["records"]))
            print(f"| {kind} | {n} | {len(load['records'])} | {load['tps']:.2f} | {ttft} |")
    if "litkv" in results and 1 in results["litkv"]:
        one = results["litkv"][1]["tps"]
        one_p95 = ttft_all_turns(results["litkv"][1]["records"])[1]
        for n, load in results["litkv"].items():
            p50, p95 = ttft_all_turns(load["records"])
            print(f"litkv {n} clients: {load['tps'] / one:.2f}x one client's tok/s; TTFT over all turns p50 {p50:.2f}"
                  f" s, p95 {p95:.2f} s = {p95 / one_p95:.2f}x one client's p95")  # fmt: skip
        for peer in ("litkv-1row", "litgpt"):
            if 1 in results.get(peer, {}):
                print(f"one client: litkv {one:.2f} tok/s = {one / results[peer][1]['tps']:.2f}x {peer}")
    print("\n| server | clients | samples | RSS first / middle / last / max (MiB) |"
          " state_dir first / middle / last / max (MB) |\n|---|---|---|---|---|")  # fmt: skip
    for kind, loads in results.items():
        for n, load in loads.items():
            rss = series([s.rss_mib for s in load["samples"]])
            mb = series([s.state_dir_bytes / 1e6 for s in load["samples"]])
            print(f"| {kind} | {n} | {len(load['samples'])} | {' / '.join(f'{v:.0f}' for v in rss)} |"
                  f" {' / '.join(f'{v:.1f}' for v in mb)} |")  # fmt: skip
    for kind, per_load in replays.items():
        replies = sum(len(r.replies) for load in results[kind].values() for r in load["records"])
        bad = sum(len(m) for m in per_load.values())
        print(f"\n{kind}: {bad} of {replies} replies differ from a fresh server's replay (target 0)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=Path(__file__).parents[1] / "litkv/assets/default")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--conversations", type=int, nargs="+", default=[100], help="per load: one count or one per N")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--words", type=int, default=30)
    p.add_argument("--max_tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0, help="draws the user messages")
    p.add_argument("--policy", default="h2o")
    p.add_argument("--cache_length", type=int, default=256)
    p.add_argument("--state_bytes", type=int, default=64 << 20)
    p.add_argument("--state_dir_bytes", type=int, default=64 << 20)
    p.add_argument("--max_batch", type=int, default=8)
    p.add_argument("--max_step_tokens", type=int, default=1, help="litkv serve's prompt tokens per step (1: a chunk)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=18765)
    p.add_argument("--servers", nargs="+", default=["litkv", "litkv-1row", "litgpt"], help="litkv, litkv-1row, litgpt")
    p.add_argument("--replay_clients", type=int, default=1, help="clients of the replay (0: no replay)")
    p.add_argument("--retokenize", type=int, default=0, help="only count replies that do not re-tokenize")
    p.add_argument("--litgpt_conversations", type=int, nargs="+", help="litgpt's (0: skip); default --conversations")
    args = p.parse_args(argv)
    args.litgpt_conversations = args.litgpt_conversations or args.conversations
    for name in ("conversations", "litgpt_conversations"):
        counts = getattr(args, name)
        counts = counts * len(args.clients) if len(counts) == 1 else counts
        if len(counts) != len(args.clients):
            p.error(f"--{name}: one count or one per --clients ({len(args.clients)}), got {counts}")
        setattr(args, name, counts)
    if min(args.clients + args.conversations + [args.turns]) < 1 or min(args.litgpt_conversations) < 0:
        p.error("--clients, --conversations and --turns must be at least 1")
    unknown = set(args.servers) - {"litkv", "litkv-1row", "litgpt"}
    if unknown:
        p.error(f"--servers: unknown {sorted(unknown)} (litkv, litkv-1row, litgpt)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if __name__ == "__main__":  # a SIGTERM still stops the servers started here (the `finally` blocks)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from tokenizers import Tokenizer

    if not args.checkpoint.exists():  # a model name: litkv's cache directory of it
        from litkv.checkpoints.download import cache_dir

        args.checkpoint = cache_dir(str(args.checkpoint))
    if args.retokenize:
        count_retokenize(args)
        return {}
    args.tokenizer = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))  # counts both servers' replies
    results = {kind: run(kind, args) for kind in args.servers}
    replays = {}
    if args.replay_clients:
        replays = {kind: replay(kind, results[kind], args) for kind in results if kind.startswith("litkv")}
    report(results, replays, args)
    return {"results": results, "replays": replays}


if __name__ == "__main__":
    main()
