"""`litkv chat`: an interactive session on a checkpoint, through any KV cache policy.

Each turn appends the user's text and the reply to the caches: the history is never prefilled again,
and with an evicting policy the conversation can run past the model's context length. Commands:
`/undo` (roll back the last turn), `/save FILE`, `/load FILE`, `/reset`, `/stats`, `/help`, `/quit`.
`--session FILE` loads the session at start (when the file exists) and saves it at exit. Replies stream;
Ctrl-C stops a reply (the part already produced stays in the session); Ctrl-D (end of input) exits.
Input may come from a terminal or a pipe.
"""

from __future__ import annotations

import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from litkv.checkpoint import check_checkpoint_dir, load_model, load_tokenizer
from litkv.cli.common import apply_num_threads, resolve_checkpoint_dir, resolve_device, resolve_dtype
from litkv.config import KVCacheConfig
from litkv.generate import check_sampling, sample
from litkv.model import GPT
from litkv.state import CacheState, keep_undo_log, restore, snapshot, truncate

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

__all__ = ["ChatSession", "chat"]

Pick = Callable[[torch.Tensor], torch.Tensor]  # logits (B, V) -> next tokens (B,)

_DEFAULT_KV_CACHE = KVCacheConfig()  # never mutated
HELP = (
    "commands: /undo (roll back the last turn), /save FILE, /load FILE, /reset, /stats, /help, /quit; "
    "Ctrl-C stops a reply, Ctrl-D exits"
)


class ChatSession:
    """The state of a conversation: the model's attached caches (batch of one), the token history, the
    token count of each turn (for `/undo`) and an undo log deep enough for `undo_depth` calls.

    Args:
        model: the GPT (caches are attached to it for the session's life).
        tokenizer: LitGPT's tokenizer of the checkpoint.
        kv_cache: the cache config of every layer.
        undo_depth: calls (prefill chunks and decode steps) the undo log keeps; `/undo` of a turn
            with an evicting policy needs the turn's calls in it.
    """

    def __init__(self, model: GPT, tokenizer: Tokenizer, kv_cache: KVCacheConfig, undo_depth: int = 1024) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv_cache = kv_cache
        self.undo_depth = undo_depth
        self.history: list[int] = []
        self.turns: list[int] = []
        self.interrupted = False
        self.reset()

    @property
    def next_pos(self) -> int:
        last = self.model.last_pos
        return 0 if last is None else int(last[0]) + 1

    def reset(self) -> None:
        """Empty caches, history and turns."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. qh2o choosing its storage: said once at start
            self.model.set_kv_caches(self.model.build_kv_caches(self.kv_cache, 1))
        keep_undo_log(self.model, self.undo_depth)
        self.history, self.turns = [], []

    # -- a turn ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def turn(self, text: str, max_new_tokens: int, pick: Pick, out: TextIO, stop_at_newline: bool = True) -> list[int]:
        """Append `text` (and a newline) to the session and stream the reply to `out`.

        Returns:
            The reply's token ids (all of them are in the caches when this returns).
        """
        ids = self.tokenizer.encode(text + "\n", bos=None if not self.history else False).tolist()
        if not ids:
            return []
        self._check_room(len(ids) + max_new_tokens)
        hidden = self._feed(ids)
        reply: list[int] = []
        stream = _TextStream(self.tokenizer, out)
        eos = self.tokenizer.eos_id
        while not self.interrupted and len(reply) < max_new_tokens:
            token = int(pick(self.model.logits(hidden[:, -1]))[0])
            reply.append(token)
            hidden = self._feed([token])
            stream.add(token)
            if token == eos or (stop_at_newline and "\n" in self.tokenizer.decode(torch.tensor([token]))):
                break
        stream.finish()
        self.turns.append(len(ids) + len(reply))
        return reply

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` through the caches in chunks; hidden states `(1, T, n_embd)` of the last chunk."""
        step = self.kv_cache.chunk_length
        hidden = None
        for s in range(0, len(ids), step):
            part = torch.tensor([ids[s : s + step]], device=self.model.lm_head.weight.device)
            start = self.next_pos
            pos = torch.arange(start, start + part.shape[1], device=part.device)[None]
            hidden = self.model(part, pos, lm_head=False)
            self.history.extend(ids[s : s + step])
        return hidden

    def _check_room(self, needed: int) -> None:
        for cache in self.model.kv_caches:
            limit = type(cache).max_tokens(cache.config)
            if limit is not None and cache.num_filled + needed > limit:
                raise ValueError(
                    f"the {cache.config.policy} cache is full: {cache.num_filled} of {limit} slots used, this turn "
                    f"may need {needed} more; /undo, /reset, or restart with an evicting policy (--kv_cache h2o)"
                )

    # -- commands -------------------------------------------------------------------------------

    def undo(self) -> str:
        if not self.turns:
            return "nothing to undo"
        n = self.turns[-1]
        truncate(self.model, n)
        self.turns.pop()
        del self.history[len(self.history) - n :]
        return f"rolled back the last turn ({n} tokens)"

    def save(self, path: Path) -> str:
        state = snapshot(self.model, device="cpu", token_ids=[list(self.history)])
        state.save(path)
        return f"saved {len(self.history)} tokens to {path} ({state.nbytes() / 2**20:.2f} MiB of state)"

    def load(self, path: Path) -> str:
        state = CacheState.load(path)
        if state.batch_size != 1:
            raise ValueError(f"{path} holds {state.batch_size} rows; a chat session has one")
        restore(self.model, state)
        self.kv_cache = state.configs[0]
        self.history = list(state.token_ids[0]) if state.token_ids else []
        self.turns = []
        return f"loaded {len(self.history)} tokens from {path} (policy {self.kv_cache.policy})"

    def stats(self) -> str:
        caches = self.model.kv_caches
        held = int((caches[0].positions[0, 0] >= 0).sum())
        cache_bytes = sum(c.nbytes() for c in caches)
        return (
            f"tokens seen: {self.next_pos} | turns: {len(self.turns)} | slots held: {held} of "
            f"{caches[0].cache_length} per layer and head | cache: {self.kv_cache.policy}, "
            f"{cache_bytes / 2**20:.2f} MiB"
        )


class _TextStream:
    """Writes a reply's text as its tokens come. Only the new tokens are decoded, after the last written
    token as context (so that a word's leading space survives), and an incomplete character waits."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.context: list[int] = []
        self.pending: list[int] = []
        self.at_line_start = True

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(torch.tensor(ids, dtype=torch.long)) if ids else ""

    def add(self, token: int, final: bool = False) -> None:
        self.pending.append(token)
        head, text = self._decode(self.context), self._decode(self.context + self.pending)
        if text.endswith("\ufffd") and not final:
            return
        new = text[len(head) :]
        if new:
            self.out.write(new)
            self.out.flush()
            self.at_line_start = new.endswith("\n")
        self.context, self.pending = self.pending[-1:], []

    def finish(self) -> None:
        """Write what is left (an incomplete character included) and end the line."""
        if self.pending:
            self.add(self.pending.pop(), final=True)
        if not self.at_line_start:
            self.out.write("\n")
            self.out.flush()


def _command(session: ChatSession, line: str) -> str | None:
    """Run a `/command`; its message, or `None` for `/quit`."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return None
    if name in ("/save", "/load"):
        if not arg:
            raise ValueError(f"{name} needs a file name: {name} FILE")
        return session.save(Path(arg)) if name == "/save" else session.load(Path(arg))
    actions = {"/undo": session.undo, "/stats": session.stats, "/help": lambda: HELP}
    if name == "/reset":
        session.reset()
        return "session reset"
    if name not in actions:
        raise ValueError(f"unknown command {name!r}; {HELP}")
    return actions[name]()


def _read_line(interactive: bool) -> str | None:
    """A line of input without its newline; `None` at end of input."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def chat(
    checkpoint_dir: Path | None = None,
    kv_cache: KVCacheConfig = _DEFAULT_KV_CACHE,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 1234,
    session: Path | None = None,
    stop_at_newline: bool = True,
    undo_depth: int = 1024,
    precision: str | None = None,
    device: str | None = None,
    num_threads: int | None = None,
) -> None:
    """Chat with a checkpoint through a KV cache policy; each turn appends to the caches.

    Args:
        checkpoint_dir: LitGPT-layout directory. Default: the model shipped with litkv.
        kv_cache: KV cache policy and budget (``--kv_cache h2o`` lets the conversation run past the
            model's context length).
        max_new_tokens: Most tokens of one reply.
        temperature: Sampling temperature; 0 for greedy decoding.
        top_k: Sample among the k most likely tokens only.
        top_p: Nucleus sampling threshold in (0, 1].
        seed: Random seed of the sampler.
        session: A session file: loaded at start when it exists (its cache config wins), saved at exit.
        stop_at_newline: End a reply at its first newline (else at end-of-text or max_new_tokens).
        undo_depth: Calls (prefill chunks and decode steps) the undo log keeps for /undo.
        precision: "32-true", "bf16-true", "16-true" or "64-true". Default: bf16 on CUDA, else 32.
        device: "cpu", "cuda", ... Default: CUDA if available.
        num_threads: CPU threads for torch. Default: torch's choice.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    ckpt = check_checkpoint_dir(resolve_checkpoint_dir(checkpoint_dir))
    apply_num_threads(num_threads)
    dev = resolve_device(device)
    model = load_model(ckpt, device=dev, dtype=resolve_dtype(precision, dev))
    state = ChatSession(model, load_tokenizer(ckpt), kv_cache, undo_depth)
    if session is not None and Path(session).is_file():
        print(state.load(Path(session)), file=sys.stderr)
    generator = torch.Generator(device=dev).manual_seed(seed)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        return sample(logits, temperature, top_k, top_p, generator)

    interactive = sys.stdin.isatty()
    if interactive:
        print(f"litkv chat ({state.kv_cache.policy}, {state.kv_cache.cache_length} slots). {HELP}", file=sys.stderr)
    try:
        _loop(state, interactive, pick, max_new_tokens, stop_at_newline)
    finally:
        if session is not None:
            print(state.save(Path(session)), file=sys.stderr)


def _loop(state: ChatSession, interactive: bool, pick: Pick, max_new_tokens: int, stop_at_newline: bool) -> None:
    while True:
        try:
            line = _read_line(interactive)
        except KeyboardInterrupt:
            print("\n(Ctrl-C: type /quit or press Ctrl-D to exit)", file=sys.stderr)
            continue
        if line is None:
            return
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                message = _command(state, line)
                if message is None:
                    return
                print(message, flush=True)
                continue
            with _stop_on_sigint(state):
                state.turn(line, max_new_tokens, pick, sys.stdout, stop_at_newline)
            if state.interrupted:
                print("[reply stopped]", file=sys.stderr, flush=True)
        except (ValueError, TypeError, FileNotFoundError) as err:
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)


class _stop_on_sigint:  # noqa: N801 (used as a context manager)
    """While a reply runs, Ctrl-C sets `session.interrupted` (checked between decode steps) instead of
    raising, so that no call is cut between a cache's attend and evict."""

    def __init__(self, session: ChatSession) -> None:
        self.session = session
        self.previous = None

    def __enter__(self) -> None:
        self.session.interrupted = False

        def handler(signum: int, frame: object) -> None:
            self.session.interrupted = True

        try:
            self.previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: Ctrl-C keeps its default behaviour
            self.previous = None

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
