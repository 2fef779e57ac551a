"""`litkv chat`: an interactive session on a checkpoint, through any KV cache policy.

The conversation itself (its messages in the checkpoint's chat template or as raw text, feeding through
the chunk runner, the reply loop) is `litkv.inference.conversation.Conversation`, shared with `litkv serve`;
the session (turns, `/undo`, `/attach`, `/save`, `/load`, `/stats`, the session file's format) is
`litkv.inference.chat_session.ChatSession`; this module is the terminal around them (input, commands,
signals, the session file's lock). Each turn appends the user's message and the reply to the caches: the
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

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from litkv.checkpoints.checkpoint import check_checkpoint_dir, load_tokenizer
from litkv.checkpoints.runtime import load_for_inference
from litkv.cli.common import resolve_checkpoint_dir
from litkv.core.atomic import remove_stale_temp_files
from litkv.inference.blocks import check_recompute
from litkv.inference.chat_session import ChatSession
from litkv.inference.chat_template import load_format
from litkv.inference.conversation import refuse_one_shot
from litkv.inference.sampling import Sampling, check_sampling
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.quant_weights import WeightQuant, parse_quantize

__all__ = ["ChatSession", "chat"]

#: This command, read by litkv/__main__.py from the source (never imported for it): `CommandSpec`.
COMMAND = {"name": "chat", "function": "chat", "checkpoint_positional": True, "repeated": ["--block_file"]}

_DEFAULT_KV_CACHE = KVCacheConfig()  # never mutated
HELP = (
    "commands: /undo (roll back the last turn), /attach FILE (a document for the next message), /save FILE, "
    "/load FILE, /reset, /stats, /help, /quit; "
    "Ctrl-C stops a reply, Ctrl-D exits"
)


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
    refuse_one_shot(kv_cache, "litkv chat")
    recompute = check_recompute(recompute, "--recompute")
    quant = parse_quantize(quantize)
    path = _session_path(session)
    try:
        with _session_lock(path):
            state = _start(
                checkpoint_dir, kv_cache, chat_template, path, undo_depth, (precision, device, num_threads), quant
            )
            state.conversation.recompute = recompute
            for doc in block_file or []:
                print(state.attach(Path(doc)), file=sys.stderr)
            if stop_at_newline is None:
                stop_at_newline = state.conversation.format.name == "raw"
            generator = torch.Generator(device=state.model.lm_head.weight.device).manual_seed(seed)
            sampling = Sampling(temperature, top_k, top_p, generator=generator)  # one draw sequence across turns
            with _Signals(state) as signals:
                _run(state, signals, sampling, path, max_new_tokens, stop_at_newline)
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
    """Load the tokenizer and its chat format, then the model as every inference command does
    (`load_for_inference`; `runtime`: precision, device, threads; weights quantised as `quant`), and the session
    file."""
    precision, device, num_threads = runtime
    ckpt = check_checkpoint_dir(resolve_checkpoint_dir(checkpoint_dir))
    tokenizer = load_tokenizer(ckpt)
    fmt = load_format(ckpt, tokenizer, chat_template)
    model, _ = load_for_inference(ckpt, precision, device, num_threads, quant.name)
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
    state: ChatSession,
    signals: _Signals,
    sampling: Sampling,
    session: Path | None,
    max_new_tokens: int,
    stop_at_newline: bool,
) -> None:
    """The chat until end of input, /quit or SIGTERM/SIGHUP; the session file is current at every return."""
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"litkv chat ({state.kv_cache.policy}, {state.kv_cache.cache_length} slots). {HELP}", file=sys.stderr)
    with suppress(_Terminate):
        _loop(state, signals, interactive, sampling, session, max_new_tokens, stop_at_newline)
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
    sampling: Sampling,
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
                state.turn(line, max_new_tokens, sampling, sys.stdout, stop_at_newline)
                _save_session(state, session)
            if state.interrupted:
                kept = " and saved" if session is not None else ""
                print(f"[reply stopped] the turn so far is kept{kept} (/undo removes it)", file=sys.stderr, flush=True)
        except (ValueError, TypeError, OSError) as err:
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
