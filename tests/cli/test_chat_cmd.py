"""`litkv chat`: driven through a pipe (a real subprocess and in-process), and through a pseudo-terminal
as a person would (prompt, streamed reply, Ctrl-C stopping a reply, Ctrl-D leaving).

The shipped model and greedy decoding throughout, with an H2O cache small enough to evict.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import litkv.checkpoints.runtime as runtime
from litkv.__main__ import main

REPO = Path(__file__).resolve().parents[2]
H2O = ["--kv_cache", "h2o", "--kv_cache.cache_length", "64", "--kv_cache.chunk_size", "16"]
GREEDY = ["--temperature", "0", "--num_threads", "1", "--max_new_tokens", "24"]
TURNS = ("And it came to pass", "The king said unto them", "Then the people answered")


def _chat(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], lines: list[str], *args: str):  # noqa: ANN202
    """Run `litkv chat` in-process on `lines` as piped input: (stdout lines, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    main(["chat", *H2O, *GREEDY, *args])
    out = capsys.readouterr()
    return out.out.splitlines(), out.err


def test_session_saved_and_loaded_continues_like_an_uninterrupted_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Three turns in one session == two turns, exit (--session saved each turn), a new session (--session
    loads) and the third turn; the 64-slot cache has evicted by then (the replies run past 64 tokens)."""
    whole, _ = _chat(monkeypatch, capsys, list(TURNS))
    assert len(whole) == 3 and all(whole)
    session = tmp_path / "chat.safetensors"
    first, err = _chat(monkeypatch, capsys, list(TURNS[:2]), "--session", str(session))
    assert first == whole[:2] and session.is_file() and "error" not in err
    second, err = _chat(monkeypatch, capsys, [TURNS[2], "/stats"], "--session", str(session))
    assert "loaded" in err and "(2 turns)" in err
    assert second[0] == whole[2]
    seen = int(second[1].split("tokens seen: ")[1].split()[0])
    assert seen > 64 and "slots held: 64 of 64" in second[1] and "turns: 3" in second[1]


def test_undo_reset_save_load_commands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """/undo then the same turn gives the same reply (undo log over an evicting cache); /save + /load go back
    to the saved point; /reset starts over; bad commands are one error line and the session goes on."""
    path = tmp_path / "s.safetensors"
    lines = [
        TURNS[0], TURNS[1], "/undo", TURNS[1], f"/save {path}", TURNS[2], f"/load {path}", TURNS[2],
        "/reset", TURNS[0], "/undo", "/undo", "/save", "/load missing.safetensors", "/bogus", "/quit", TURNS[1],
    ]  # fmt: skip
    out, err = _chat(monkeypatch, capsys, lines)
    r0, r1, undo, r1b, saved, r2, loaded, r2b, reset, r0b, undo2, nothing = out
    assert undo.startswith("rolled back the last turn") and r1b == r1
    assert saved.startswith("saved") and loaded.startswith("loaded") and r2b == r2
    assert reset == "session reset" and r0b == r0 and undo2.startswith("rolled back") and nothing == "nothing to undo"
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 3
    assert "/save needs a file name" in errors[0] and "does not exist" in errors[1] and "unknown command" in errors[2]


@pytest.mark.slow
def test_conversation_runs_past_the_context_length(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped model's context is 1,024 tokens; through a 64-slot H2O cache a session goes past it."""
    lines = [TURNS[0], TURNS[1], "/stats"]
    out, err = _chat(monkeypatch, capsys, lines, "--max_new_tokens", "600", "--stop_at_newline", "false")
    seen = int(out[-1].split("tokens seen: ")[1].split()[0])
    assert seen > 1024 and "slots held: 64 of 64" in out[-1] and "error" not in err


def test_dense_cache_full_is_an_error_and_the_session_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out, err = _chat(
        monkeypatch, capsys, [TURNS[0], TURNS[1], "/undo"], "--kv_cache.policy", "dense", "--max_new_tokens", "50"
    )
    assert "error: the dense cache is full" in err
    assert len(out) == 2 and out[1].startswith(
        "rolled back the last turn"
    )  # the first turn: the refused one left nothing


def test_help_and_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    main(["chat", "--help"])  # the stored help: printed and returned (exit status 0), nothing imported
    assert capsys.readouterr().out.startswith("usage: litkv [options] chat")
    for args in (["--temperature", "-1"], ["--undo_depth", "0"], [str(REPO / "no_such_checkpoint")]):
        with pytest.raises(SystemExit) as exc:
            main(["chat", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 1 and len(err) == 1 and err[0].startswith("error: "), err


@pytest.mark.slow
def test_pipe_subprocess(chats: dict[str, Any]) -> None:
    """A real process reading its standard input from a pipe (written and closed when it started)."""
    proc = chats["pipe"]
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    out = stdout.splitlines()
    assert len(out) == 5 and out[1].startswith("tokens seen:") and out[2] == out[4] and out[0]
    assert "litkv chat" not in stderr  # no banner when the input is not a terminal


def _read_until(fd: int, needle: str, timeout: float = 60.0) -> str:
    """Read the pty until `needle` appears (or fail after `timeout` seconds)."""
    seen, end = "", time.monotonic() + timeout
    while needle not in seen:
        left = end - time.monotonic()
        assert left > 0, f"timed out waiting for {needle!r}; got {seen[-500:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            seen += chunk.decode("utf-8", "replace")
    return seen


def _controlling_terminal() -> None:
    """In the child: a new session whose controlling terminal is the pty on stdin (so Ctrl-C is SIGINT)."""
    import fcntl
    import termios

    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_pseudo_terminal_session(chats: dict[str, Any]) -> None:
    """As a person at a terminal: banner and prompt, a long reply streamed and stopped with Ctrl-C (the
    session stays: /stats counts the tokens), then Ctrl-D exits with status 0."""
    proc, main_fd = chats["pty"]
    try:
        banner = _read_until(main_fd, "> ")
        assert "litkv chat (h2o, 64 slots)" in banner
        os.write(main_fd, f"{TURNS[0]}\r".encode())
        streamed = _read_until(main_fd, TURNS[0])
        while len(streamed) < 400:  # the reply streams: well past the cache's 64 slots
            streamed += _read_until(main_fd, " ")
        os.write(main_fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT
        _read_until(main_fd, "[reply stopped]")
        os.write(main_fd, b"/stats\r")
        stats = _read_until(main_fd, "MiB")
        seen = int(stats.split("tokens seen: ")[1].split()[0])
        assert seen > 64 and "turns: 1" in stats
        os.write(main_fd, b"\x04")  # Ctrl-D at the prompt: end of input
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- sessions: per-turn saves, turn boundaries, bad paths, locks, signals ---------------------------------


def test_session_saved_after_every_turn_with_its_turn_boundaries(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The file is written after each turn (not only at exit); it stores the turns, so after a resume
    /undo rolls back the last turn (dense cache: exact for any turn) and /stats counts the turns."""
    from litkv.inference.chat_session import ChatSession

    session = tmp_path / "s.safetensors"
    sizes: list[int] = []
    save = ChatSession.save

    def spy(self: ChatSession, path: Path) -> str:
        message = save(self, path)
        sizes.append(len(self.turns))
        return message

    monkeypatch.setattr(ChatSession, "save", spy)
    dense = ["--kv_cache.policy", "dense", "--kv_cache.cache_length", "512"]
    whole, _ = _chat(monkeypatch, capsys, list(TURNS[:3]), *dense, "--session", str(session))
    assert sizes == [1, 2, 3]
    out, err = _chat(monkeypatch, capsys, ["/stats", "/undo", TURNS[2], "/stats"], *dense, "--session", str(session))
    assert "(3 turns)" in err and "turns: 3" in out[0] and out[1].startswith("rolled back the last turn")
    assert out[2] == whole[2] and "turns: 3" in out[3] and sizes[-2:] == [2, 3]


def test_undo_after_resume_with_an_evicting_cache_names_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    session = tmp_path / "s.safetensors"
    _chat(monkeypatch, capsys, [TURNS[0]], "--session", str(session))
    out, err = _chat(monkeypatch, capsys, ["/undo", TURNS[1], "/undo", "/stats"], "--session", str(session))
    assert "it was loaded from a file" in err and "keep_undo_log" not in err
    assert out[1].startswith("rolled back") and "turns: 1" in out[2]


def test_undo_beyond_the_log_names_the_cli_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out, err = _chat(monkeypatch, capsys, [TURNS[0], "/undo", "/stats"], "--undo_depth", "2")
    assert "--undo_depth 2" in err and "keep_undo_log" not in err and "turns: 1" in out[1]


def test_bad_save_and_load_paths_are_one_line_and_the_chat_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("x")
    lines = [
        TURNS[0], f"/save {tmp_path}", f"/load {tmp_path}", f"/save {tmp_path / 'file' / 'x'}",
        f"/load {tmp_path / 'file'}", f"/save {tmp_path / 'new' / 'dir' / 's.safetensors'}", "/stats",
    ]  # fmt: skip
    out, err = _chat(monkeypatch, capsys, lines)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 4 and "Traceback" not in err, err
    assert "is a directory" in errors[0] and "is a directory" in errors[1] and "not a directory" in errors[2]
    assert "not a readable safetensors file" in errors[3]
    assert out[1].startswith("saved") and "turns: 1" in out[2]


def test_session_that_is_a_directory_is_refused_at_start(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["chat", "--session", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 1 and len(err) == 1 and "--session" in err[0] and "is a directory" in err[0]


def test_a_second_chat_on_a_session_in_use_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The lock is held while a chat runs (here: another process holds it); once that process is gone
    (killed: its lock goes with it), the session opens."""
    session = tmp_path / "s.safetensors"
    code = "import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); lock.acquire(); "
    code += "print('held', flush=True); time.sleep(60)"
    lock_file = tmp_path / ".s.safetensors.lock"
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock_file)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(SystemExit) as exc:
            _chat(monkeypatch, capsys, [TURNS[0]], "--session", str(session))
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 1 and len(err) == 1 and "in use by another litkv chat" in err[0]
    finally:
        holder.kill()
        holder.wait()
    out, err = _chat(monkeypatch, capsys, [TURNS[0]], "--session", str(session))
    assert len(out) == 1 and session.is_file()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_save_and_exit_cleanly(chats: dict[str, Any], signum: int) -> None:
    """A real chat process, signalled while it waits for the next line: it ends with status 0, no
    traceback, and the session file holds both turns (a resume goes on from them)."""
    proc, session = chats[signal.Signals(signum).name]
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{TURNS[0]}\n{TURNS[1]}\n")
    proc.stdin.flush()
    replies = [proc.stdout.readline(), proc.stdout.readline()]
    end = time.monotonic() + 60
    while _saved_turns(session) < 2:  # the save after the second turn; then the chat waits for input
        assert time.monotonic() < end
        time.sleep(0.01)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err and signal.Signals(signum).name in err, err
    assert all(r.strip() for r in replies) and _saved_turns(session) == 2


def _saved_turns(session: Path) -> int:
    from litkv.inference.chat_session import read_turns
    from litkv.states.state import CacheState

    try:
        state = CacheState.load(session)
    except FileNotFoundError:
        return 0
    return len(read_turns(session, len(state.token_ids[0])))


# SIGINT while the model loads, in a child that restores Python's SIGINT handler first: a runner started with
# SIGINT ignored (a background job) passes the ignoring on, and a user's terminal does not.
_INTERRUPTED_START = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "import litkv.cli.chat_cmd as c; from litkv.__main__ import main\n"
    "load = c.load_for_inference\n"
    "def slow(*a, **k):\n"
    "    os.kill(os.getpid(), signal.SIGINT)\n"
    "    return load(*a, **k)\n"
    "c.load_for_inference = slow\n"
    "main(sys.argv[1:])\n"
)


@pytest.mark.slow
def test_ctrl_c_while_starting_exits_without_a_traceback(chats: dict[str, Any]) -> None:
    """SIGINT while the model loads (`_INTERRUPTED_START`): a short message, status 130, and no session file
    written."""
    proc, session = chats["interrupted_start"]
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in stderr and "interrupted" in stderr, stderr
    assert not session.exists()


@pytest.mark.slow
def test_ctrl_c_during_a_reply_keeps_and_saves_the_turn_and_says_so(chats: dict[str, Any]) -> None:
    """SIGINT while a long reply streams: the reply stops at the next token, the turn is kept and saved
    (the session file has it), the chat says so and goes on to the next line."""
    proc, session = chats["ctrl_c_reply"]
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{TURNS[0]}\n")
    proc.stdin.flush()
    proc.stdout.read(40)  # the reply is streaming
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate("/stats\n", timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "[reply stopped] the turn so far is kept and saved" in err and "turns: 1" in out
    assert _saved_turns(session) == 1


def test_quantized_weights_on_a_gpu_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`litkv chat --quantize int8` on a GPU is refused as `litkv generate` refuses it (the chat loads through
    `load_for_inference`), before a weight is read. The device is faked: no GPU needed."""
    monkeypatch.setattr(runtime, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(runtime, "load_model", lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(SystemExit) as exc:
        main(["chat", "--quantize", "int8", "--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 1 and len(err) == 1 and "--quantize int8 runs on the CPU only" in err[0], err


def test_session_with_other_cache_settings_says_so_and_goes_on_with_the_files(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 32 item 7: `--session F` given other --kv_cache settings than F's: one warning line naming
    both, and the chat goes on with the file's cache (its state was computed with it); the same
    settings again, or none given, say nothing."""
    session = tmp_path / "s.safetensors"
    _chat(monkeypatch, capsys, [TURNS[0]], "--session", str(session))
    other = ["--kv_cache.policy", "dense", "--kv_cache.cache_length", "512", "--session", str(session)]
    out, err = _chat(monkeypatch, capsys, ["/stats"], *other)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "h2o/64 slots" in warnings[0] and "dense/512 slots" in warnings[0], err
    assert "cache: h2o" in out[0] and "of 64 per layer" in out[0]
    _, err = _chat(monkeypatch, capsys, ["/stats"], "--session", str(session))
    assert "warning" not in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("/stats\n"))
    main(["chat", "--num_threads", "1", "--session", str(session)])  # no --kv_cache at all
    assert "warning" not in capsys.readouterr().err


# -- the real `litkv chat` processes of the subprocess tests ---------------------------------------


def _start_chat(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "litkv", "chat", *H2O, *GREEDY, *args]
    options = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.Popen(cmd, text=True, cwd=REPO, **options)


def _start_pty_chat() -> tuple[subprocess.Popen[bytes], int]:
    """A chat on a pseudo-terminal that is its controlling terminal: (process, the terminal's main side)."""
    import pty

    main_fd, child_fd = pty.openpty()
    cmd = [sys.executable, "-m", "litkv", "chat", *H2O, "--temperature", "0", "--num_threads", "1"]
    cmd += ["--max_new_tokens", "100000", "--stop_at_newline", "false"]
    proc = subprocess.Popen(
        cmd, stdin=child_fd, stdout=child_fd, stderr=child_fd, cwd=REPO, preexec_fn=_controlling_terminal
    )
    os.close(child_fd)
    return proc, main_fd


@pytest.fixture(scope="module", autouse=True)
def chats(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The real processes of this file's subprocess tests (those selected), all started when the module's
    first test runs: their imports and model loads (most of each one's time) run at once, beside the
    in-process tests, instead of one after another. Each test then drives its own process as before: a
    process waits for its input (or, for the pipe and the interrupted start, runs on its own) until then."""
    wanted = {item.originalname for item in request.session.items if item.module is request.module}
    work = tmp_path_factory.mktemp("chats")
    started: dict[str, Any] = {}
    if "test_pipe_subprocess" in wanted:  # its whole input, written at once (less than a pipe's buffer)
        read_end, write_end = os.pipe()
        started["pipe"] = _start_chat([], stdin=read_end)
        os.close(read_end)
        os.write(write_end, f"{TURNS[0]}\n/stats\n{TURNS[1]}\n/undo\n{TURNS[1]}\n".encode())
        os.close(write_end)
    if "test_pseudo_terminal_session" in wanted and sys.platform != "win32":
        started["pty"] = _start_pty_chat()
    if "test_sigterm_and_sighup_save_and_exit_cleanly" in wanted:
        for name in ("SIGTERM", "SIGHUP"):
            session = work / f"{name}.safetensors"
            started[name] = (_start_chat(["--session", str(session)]), session)
    if "test_ctrl_c_while_starting_exits_without_a_traceback" in wanted:
        session = work / "interrupted.safetensors"
        cmd = [sys.executable, "-c", _INTERRUPTED_START, "chat", "--session", str(session)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        started["interrupted_start"] = (proc, session)
    if "test_ctrl_c_during_a_reply_keeps_and_saves_the_turn_and_says_so" in wanted:
        session = work / "ctrl_c.safetensors"
        args = ["--session", str(session), "--max_new_tokens", "100000", "--stop_at_newline", "false"]
        started["ctrl_c_reply"] = (_start_chat(args), session)
    yield started
    for entry in started.values():
        proc = entry[0] if isinstance(entry, tuple) else entry
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a pipe to a process that is gone
                    pipe.close()
    if "pty" in started:
        os.close(started["pty"][1])
