"""`litkv chat`: an interactive session on a checkpoint, through any KV cache policy.

The conversation itself (its messages in the checkpoint's chat template or as raw text, feeding through
the chunk runner, the reply loop) is `litkv.inference.conversation.Conversation`, shared with `litkv serve`; this
module is the terminal around it. Each turn appends the user's message and the reply to the caches: the
history is never prefilled again, and with an evicting policy the conversation can run past the
model's context length. Commands:
`/undo` (roll back the last turn), `/attach FILE` (a document for the next message: a KV block,
docs/blocks.md), `/save FILE`, `/load FILE`, `/reset`, `/stats`, `/help`, `/quit`.
Replies stream; Ctrl-C stops a reply (the part already produced stays in the session as a turn);
Ctrl-D (end of input) exits. Input may come from a terminal or a pipe.

`--session FILE` loads the session at start (when the file exists) and saves it, atomically, after
every completed turn and every command that changes it, so a crash loses at most the turn in progress.
The file holds the conversation (messages, turn boundaries: `/undo` works after a resume) and keeps its
cache settings (other `--kv_cache` settings are one warning line). While a chat runs, its session file
is locked (`.FILE.lock` next to it): a second chat on the same file is refused; the lock of a process
that died is free again. SIGTERM and SIGHUP end the chat cleanly: a reply in progress stops at the
next token, the session is saved, the process exits with status 0. No path, command or signal ends
the chat with a traceback.
"""

from __future__ import annotations

import json
import signal
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from litkv.checkpoints.checkpoint import check_checkpoint_dir, load_model, load_tokenizer
from litkv.checkpoints.runtime import apply_num_threads, resolve_device, resolve_dtype
from litkv.cli.common import resolve_checkpoint_dir
from litkv.core.atomic import remove_stale_temp_files
from litkv.core.validation import read_text_file
from litkv.inference.blocks import encode_document
from litkv.inference.chat_template import Format, RawFormat, load_format
from litkv.inference.conversation import Conversation, Pick
from litkv.inference.generate import check_sampling, sample
from litkv.modeling.config import KVCacheConfig
from litkv.modeling.model import GPT
from litkv.modeling.quant_weights import WeightQuant, parse_quantize, quantize_model
from litkv.states.block_store import BlockStore
from litkv.states.state import CacheState, restore, snapshot
from litkv.states.state_file import read_state_header
from litkv.states.undo import truncate

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

__all__ = ["ChatSession", "chat"]

#: This command, read by litkv/__main__.py from the source (never imported for it): `CommandSpec`.
COMMAND = {"name": "chat", "function": "chat", "checkpoint_positional": True, "repeated": ["--block_file"]}

_DEFAULT_KV_CACHE = KVCacheConfig()  # never mutated
BLOCK_STORE_BYTES = 1 << 30  # documents' KV kept in memory by a chat
#: Safetensors metadata key of a session file's chat data: `{"turns": [tokens of each turn]}` as JSON.
CHAT_METADATA = "litkv_chat"
HELP = (
    "commands: /undo (roll back the last turn), /attach FILE (a document for the next message), /save FILE, "
    "/load FILE, /reset, /stats, /help, /quit; "
    "Ctrl-C stops a reply, Ctrl-D exits"
)


class ChatSession:
    """The chat's side of a conversation (`litkv.inference.conversation.Conversation`, batch of one): the turn as
    the terminal runs it, `/undo` (turn boundaries), `/save`, `/load`, `/stats`.

    Args:
        model: the GPT (caches are attached to it for the session's life).
        tokenizer: LitGPT's tokenizer of the checkpoint.
        kv_cache: the cache config of every layer.
        undo_depth: calls (prefill chunks and decode steps) the undo log keeps; `/undo` of a turn
            with an evicting policy needs the turn's calls in it.
        fmt: how messages become tokens (default: raw text, `RawFormat`).
        blocks: where attached documents' KV is kept (default: in memory, `BLOCK_STORE_BYTES`).
        recompute: the fraction of each spliced document's tokens recomputed in context.
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        kv_cache: KVCacheConfig,
        undo_depth: int = 1024,
        fmt: Format | None = None,
        blocks: BlockStore | None = None,
        recompute: float = 0.0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.undo_depth = undo_depth
        blocks = BlockStore(BLOCK_STORE_BYTES) if blocks is None else blocks
        self.conversation = Conversation(model, fmt or RawFormat(tokenizer), kv_cache, undo_depth, blocks, recompute)
        self.attached: list[tuple[int, ...]] = []  # documents of the next user message
        self.loaded_turns = 0  # turns restored from a file: their undo history is not in the log
        self.interrupted = False

    @property
    def kv_cache(self) -> KVCacheConfig:
        return self.conversation.kv_cache

    @property
    def next_pos(self) -> int:
        return self.conversation.next_pos

    @property
    def history(self) -> list[int]:
        return self.conversation.history

    @property
    def turns(self) -> list[int]:
        """Tokens of each turn (the user's segment and the reply)."""
        return self.conversation.turn_sizes()

    def reset(self) -> None:
        """Empty caches, history and turns (and documents attached for the next message)."""
        self.conversation.reset()
        self.loaded_turns = 0
        self.attached = []

    def attach(self, path: Path) -> str:
        """Attach the text of `path` as a document (a KV block) to the next user message."""
        text = read_text_file("document file", path)  # a directory, a FIFO or a binary file: said so
        self.attached.append(encode_document(self.tokenizer, text, f"document {str(path)!r}"))
        return (
            f"attached {path} ({len(self.attached[-1])} tokens) to the next message ({len(self.attached)} document(s))"
        )

    # -- a turn ---------------------------------------------------------------------------------

    def turn(self, text: str, max_new_tokens: int, pick: Pick, out: TextIO, stop_at_newline: bool = True) -> list[int]:
        """Append the user's `text` to the session (in the conversation's format) and stream the reply to `out`.

        Returns:
            The reply's token ids (all of them are in the caches when this returns).
        """
        conv = self.conversation
        messages, replies = [*conv.messages, ("user", text)], [*conv.replies, None]
        documents = {**conv.documents, **({len(conv.messages): tuple(self.attached)} if self.attached else {})}
        pending = conv.prepare(messages, replies, documents)
        conv.check_room(pending, max_new_tokens)
        hidden = conv.feed(pending, messages, replies, documents)
        self.attached = []
        reply: list[int] = []
        stream = _TextStream(self.tokenizer, out)
        tokens = conv.reply(hidden, max_new_tokens, pick)
        while not self.interrupted:
            token = next(tokens, None)
            if token is None:
                break
            reply.append(token)
            stream.add(token)
            if stop_at_newline and "\n" in self.tokenizer.decode(torch.tensor([token])):
                break
        tokens.close()
        stream.finish()
        shown = reply[:-1] if reply and reply[-1] in conv.format.stop_ids else reply
        conv.end_reply(self.tokenizer.decode(torch.tensor(shown, dtype=torch.long)) if shown else "")
        return reply

    # -- commands -------------------------------------------------------------------------------

    def undo(self) -> str:
        turns = self.turns
        if not turns:
            return "nothing to undo"
        n = turns[-1]
        try:
            truncate(self.model, n)
        except ValueError as err:
            raise ValueError(self._undo_error(n)) from err
        self.conversation.drop_last_turn()
        self.loaded_turns = min(self.loaded_turns, len(turns) - 1)
        return f"rolled back the last turn ({n} tokens)"

    def _undo_error(self, n: int) -> str:
        """Why the last turn cannot be rolled back, in terms of the chat's options."""
        if len(self.turns) <= self.loaded_turns:
            return (
                f"cannot undo this turn ({n} tokens): it was loaded from a file, and a {self.kv_cache.policy} cache "
                "can only roll back turns taken since (a dense cache can roll back any turn)"
            )
        return (
            f"cannot undo this turn ({n} tokens): it took more calls than the undo log keeps "
            f"(--undo_depth {self.undo_depth}); restart with a larger --undo_depth"
        )

    def save(self, path: Path) -> str:
        """Write the session (caches, token history, messages and their segments) to `path`, atomically."""
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"cannot save to {str(path)!r}: it is a directory; give a file name")
        _check_not_foreign(path)
        history = self.history
        state = snapshot(self.model, device="cpu", token_ids=[history])
        data = {"turns": self.turns, **self.conversation.layout()}
        state.save(path, extra_metadata={CHAT_METADATA: json.dumps(data)})
        return f"saved {len(history)} tokens to {path} ({state.nbytes() / 2**20:.2f} MiB of state)"

    def load(self, path: Path) -> str:
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"cannot load {str(path)!r}: it is a directory, not a session file")
        state = CacheState.load(path)
        if state.batch_size != 1:
            raise ValueError(f"{path} holds {state.batch_size} rows; a chat session has one")
        history = list(state.token_ids[0]) if state.token_ids else []
        layout = _read_layout(path)
        restore(self.model, state)
        self.conversation.kv_cache = state.configs[0]
        try:
            self.conversation.resume(history, layout)
        except (TypeError, ValueError):
            message = f"{path}: its conversation data is invalid; its tokens are kept, /undo starts here"
            warnings.warn(message, stacklevel=2)
            self.conversation.resume(history, None)
        self.loaded_turns = len(self.turns)
        return f"loaded {len(history)} tokens ({self.loaded_turns} turns) from {path} (policy {self.kv_cache.policy})"

    def stats(self) -> str:
        caches = self.model.kv_caches
        held = int((caches[0].positions[0, 0] >= 0).sum())
        cache_bytes = sum(c.nbytes() for c in caches)
        return (
            f"tokens seen: {self.next_pos} | turns: {len(self.turns)} | slots held: {held} of "
            f"{caches[0].cache_length} per layer and head | cache: {self.kv_cache.policy}, "
            f"{cache_bytes / 2**20:.2f} MiB | documents: {self.conversation.blocks.hits} pieces restored, "
            f"{self.conversation.blocks.misses} computed"
        )


def _chat_metadata(path: Path) -> str | None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return (f.metadata() or {}).get(CHAT_METADATA)


def _read_turns(path: Path, history: int) -> list[int]:
    """The turn sizes stored in a session file; `[]` (with a warning) when absent or inconsistent."""
    raw = _chat_metadata(path)
    if raw is None:
        return []  # saved by `snapshot(...).save` or an earlier litkv: no turns to undo
    try:
        turns = json.loads(raw)["turns"]
    except (json.JSONDecodeError, KeyError, TypeError):
        turns = None
    valid = isinstance(turns, list) and all(type(t) is int and t >= 1 for t in turns) and sum(turns) <= history
    if not valid:
        warnings.warn(f"{path}: its turn boundaries are invalid ({raw[:80]!r}); /undo starts from here", stacklevel=2)
        return []
    return turns


def _read_layout(path: Path) -> dict[str, object] | None:
    """The conversation layout a session file holds (`Conversation.layout`), or `None` without one."""
    raw = _chat_metadata(path)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and "segments" not in data and "turns" in data:
        return None  # an earlier litkv's file: turn sizes only; its tokens are a prefix
    return data if isinstance(data, dict) else {"invalid": raw[:80]}


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


#: Commands after which the session file is written again (they change the session).
_CHANGING = ("/undo", "/reset", "/load")


def _command(session: ChatSession, line: str) -> str | None:
    """Run a `/command`; its message, or `None` for `/quit`."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return None
    if name in ("/save", "/load", "/attach"):
        if not arg:
            raise ValueError(f"{name} needs a file name: {name} FILE")
        return {"/save": session.save, "/load": session.load, "/attach": session.attach}[name](Path(arg))
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


def _check_not_foreign(path: Path) -> None:
    """ValueError when `path` is a regular file that is not a litkv session (a save never replaces a
    file of the user's: only an earlier session, or a device such as /dev/null, is written over)."""
    if not path.is_file():
        return
    try:
        read_state_header(path)
    except (OSError, ValueError):
        raise ValueError(
            f"cannot save to {str(path)!r}: it exists and is not a litkv session; give a new file name"
        ) from None


class _Terminate(BaseException):
    """Raised by the SIGTERM/SIGHUP handler while the chat waits for input (nothing is being computed)."""


class _Signals:
    """The chat's signal handling. While a turn runs and the session is saved (`busy`), Ctrl-C only
    sets `session.interrupted` (checked between decode steps, so no call is cut between a cache's
    attend and evict) and SIGTERM/SIGHUP also record that the chat must end after it; a second signal
    while busy (a save stuck on a slow device) ends the chat at once (the session file is as of the last
    complete save). While waiting for input, Ctrl-C raises KeyboardInterrupt (a hint is printed) and
    SIGTERM/SIGHUP end the chat."""

    def __init__(self, session: ChatSession) -> None:
        self.session = session
        self.busy = False
        self.terminate: int | None = None
        self.previous: dict[int, object] = {}

    def _on_sigint(self, signum: int, frame: object) -> None:
        if not self.busy or self.session.interrupted:  # a second Ctrl-C while busy: end the chat now
            raise KeyboardInterrupt
        self.session.interrupted = True

    def _on_terminate(self, signum: int, frame: object) -> None:
        again = self.terminate is not None
        self.terminate = signum
        if not self.busy or again:  # a second SIGTERM/SIGHUP while busy: end the chat now
            raise _Terminate
        self.session.interrupted = True

    def __enter__(self) -> _Signals:
        wanted = {signal.SIGINT: self._on_sigint, signal.SIGTERM: self._on_terminate}
        if hasattr(signal, "SIGHUP"):
            wanted[signal.SIGHUP] = self._on_terminate
        for signum, handler in wanted.items():
            try:
                self.previous[signum] = signal.signal(signum, handler)
            except ValueError:  # not the main thread: signals keep their default behaviour
                break
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    @contextmanager
    def protected(self) -> Iterator[None]:
        """Run a turn (and the save after it) to its end whatever signal comes."""
        self.session.interrupted = False
        self.busy = True
        try:
            yield
        finally:
            self.busy = False


def _session_path(session: Path | None) -> Path | None:
    """`--session` checked before anything is loaded: a file name (existing or not), never a directory."""
    if session is None:
        return None
    path = Path(session)
    if path.is_dir():
        raise ValueError(
            f"--session {str(path)!r} is a directory; give a session file name (e.g. {path / 'chat.safetensors'})"
        )
    if path.parent.exists() and not path.parent.is_dir():
        raise ValueError(f"--session {str(path)!r}: {str(path.parent)!r} is not a directory")
    return path


@contextmanager
def _session_lock(path: Path | None) -> Iterator[None]:
    """Hold the session file's lock (`.NAME.lock` next to it) for the chat's life; ValueError if another
    chat holds it. The lock is the kernel's (`flock`): a process that dies releases it."""
    if path is None:
        yield
        return
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path.parent / f".{path.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ValueError(
            f"--session {str(path)!r} is in use by another litkv chat (its lock {lock.lock_file!r} is held); "
            "end that chat first or give another --session file"
        ) from None
    try:
        removed = remove_stale_temp_files(path.parent, depth=0, quiet=True)
        if removed:
            print(f"(removed {len(removed)} temporary file(s) of interrupted saves in {path.parent})", file=sys.stderr)
        yield
    finally:
        lock.release()


def chat(
    checkpoint_dir: Path | None = None,
    kv_cache: KVCacheConfig = _DEFAULT_KV_CACHE,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 1234,
    session: Path | None = None,
    stop_at_newline: bool | None = None,
    chat_template: bool | None = None,
    undo_depth: int = 1024,
    precision: str | None = None,
    device: str | None = None,
    num_threads: int | None = None,
    quantize: str = "none",
    block_file: list[Path] | None = None,
    recompute: float = 0.0,
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
        session: A session file: loaded at start when it exists, saved after every turn and command that
            changes it; locked while the chat runs. Its cache settings win: given other --kv_cache
            settings, the chat says so in one line and goes on with the file's.
        stop_at_newline: End a reply at its first newline (else at end-of-text, the chat template's
            end-of-turn token or max_new_tokens). Default: true for raw text, false with a chat template.
        chat_template: Format the conversation with the checkpoint's chat template (system message,
            turns, generation prompt; tokenizer_config.json's ``chat_template``): true, false (raw text:
            base models, the shipped model), or unset: when the checkpoint has one.
        undo_depth: Calls (prefill chunks and decode steps) the undo log keeps for /undo.
        precision: "32-true", "bf16-true", "16-true" or "64-true". Default: bf16 on CUDA, else 32.
        device: "cpu", "cuda", ... Default: CUDA if available.
        num_threads: CPU threads for torch. Default: torch's choice.
        quantize: Weight-only quantisation of the linear layers at load (CPU only): "none", "int8"
            (per output channel), "int4" (groups of 32 input columns) or "int4-gN" (N = 64, 128, 256).
        block_file: Documents attached to the first message as KV blocks (repeat for several; later ones
            with /attach FILE): each tokenized alone, its KV computed once and spliced (docs/blocks.md).
        recompute: The fraction of each spliced document's tokens recomputed in context (0: pure splice).
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0.0 <= recompute <= 1.0:
        raise ValueError(f"--recompute must be a fraction in [0, 1] (0: pure splice), got {recompute!r}")
    quant = parse_quantize(quantize)
    path = _session_path(session)
    try:
        with _session_lock(path):
            state = _start(
                checkpoint_dir, kv_cache, chat_template, path, undo_depth, (precision, device, num_threads), quant
            )
            state.conversation.recompute = float(recompute)
            for doc in block_file or []:
                print(state.attach(Path(doc)), file=sys.stderr)
            if stop_at_newline is None:
                stop_at_newline = state.conversation.format.name == "raw"
            generator = torch.Generator(device=state.model.lm_head.weight.device).manual_seed(seed)

            def pick(logits: torch.Tensor) -> torch.Tensor:
                return sample(logits, temperature, top_k, top_p, generator)

            with _Signals(state) as signals:
                _run(state, signals, pick, path, max_new_tokens, stop_at_newline)
    except KeyboardInterrupt:  # Ctrl-C while starting (or at a moment no handler is installed)
        print("\n(interrupted; the session file, if any, is as of the last complete turn)", file=sys.stderr)
        raise SystemExit(130) from None


def _start(
    checkpoint_dir: Path | None,
    kv_cache: KVCacheConfig,
    chat_template: bool | None,
    session: Path | None,
    undo_depth: int,
    runtime: tuple[str | None, str | None, int | None],
    quant: WeightQuant,
) -> ChatSession:
    """Load the model (`runtime`: precision, device, threads; weights quantised as `quant`), the tokenizer,
    its chat format and the session file."""
    precision, device, num_threads = runtime
    ckpt = check_checkpoint_dir(resolve_checkpoint_dir(checkpoint_dir))
    apply_num_threads(num_threads)
    tokenizer = load_tokenizer(ckpt)
    fmt = load_format(ckpt, tokenizer, chat_template)
    dev = resolve_device(device)
    model = quantize_model(load_model(ckpt, device=dev, dtype=resolve_dtype(precision, dev)), quant)
    state = ChatSession(model, tokenizer, kv_cache, undo_depth, fmt)
    if session is not None and session.is_file():
        print(state.load(session), file=sys.stderr)
        if kv_cache != _DEFAULT_KV_CACHE and kv_cache != state.kv_cache:
            print(
                f"warning: --session {session} was saved with a {_describe(state.kv_cache)} cache; it goes on with "
                f"that, not the given {_describe(kv_cache)} (a session's cache cannot change; /reset starts over "
                "with the file's settings, another --session file with yours)",
                file=sys.stderr,
            )
    return state


def _describe(cfg: KVCacheConfig) -> str:
    """A cache config in a few words (what differs between two sessions' settings)."""
    options = f", {cfg.options}" if cfg.options else ""
    return f"{cfg.policy}/{cfg.cache_length} slots/{cfg.storage} storage/chunk {cfg.chunk_length}{options}"


def _run(
    state: ChatSession, signals: _Signals, pick: Pick, session: Path | None, max_new_tokens: int, stop_at_newline: bool
) -> None:
    """The chat until end of input, /quit or SIGTERM/SIGHUP; the session file is current at every return."""
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"litkv chat ({state.kv_cache.policy}, {state.kv_cache.cache_length} slots). {HELP}", file=sys.stderr)
    with suppress(_Terminate):
        _loop(state, signals, interactive, pick, session, max_new_tokens, stop_at_newline)
    if signals.terminate is not None:
        name = signal.Signals(signals.terminate).name
        kept = f"; {session} holds the session as of the last complete turn" if session is not None else ""
        print(f"\n(ending on {name}{kept})", file=sys.stderr, flush=True)


def _save_session(state: ChatSession, session: Path | None) -> None:
    """Write the session file (after a turn or a changing command); a failure is one line, the chat goes on."""
    if session is None:
        return
    try:
        state.save(session)
    except (OSError, ValueError) as err:
        print(f"error: the session was not saved: {' '.join(str(err).split())}", file=sys.stderr, flush=True)


def _loop(
    state: ChatSession,
    signals: _Signals,
    interactive: bool,
    pick: Pick,
    session: Path | None,
    max_new_tokens: int,
    stop_at_newline: bool,
) -> None:
    while signals.terminate is None:
        try:
            line = _read_line(interactive)
        except KeyboardInterrupt:
            print("\n(Ctrl-C: type /quit or press Ctrl-D to exit)", file=sys.stderr)
            continue
        if line is None or not line.strip():
            if line is None:
                return
            continue
        try:
            with signals.protected():
                if line.startswith("/"):
                    message = _command(state, line)
                    if message is None:
                        return
                    if line.split()[0] in _CHANGING:
                        _save_session(state, session)
                    print(message, flush=True)
                    continue
                state.turn(line, max_new_tokens, pick, sys.stdout, stop_at_newline)
                _save_session(state, session)
            if state.interrupted:
                kept = " and saved" if session is not None else ""
                print(f"[reply stopped] the turn so far is kept{kept} (/undo removes it)", file=sys.stderr, flush=True)
        except (ValueError, TypeError, OSError) as err:
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
