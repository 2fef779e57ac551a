"""`litkv chat`: driven through a pipe (a real subprocess and in-process), and through a pseudo-terminal
as a person would (prompt, streamed reply, Ctrl-C stopping a reply, Ctrl-D leaving).

The shipped model and greedy decoding throughout, with an H2O cache small enough to evict.
"""

from __future__ import annotations

import io
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from litkv.__main__ import main

REPO = Path(__file__).resolve().parents[1]
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
    """Three turns in one session == two turns, exit (--session saves), a new session (--session loads) and
    the third turn; the 64-slot cache has evicted by then (the replies run past 64 tokens)."""
    whole, _ = _chat(monkeypatch, capsys, list(TURNS))
    assert len(whole) == 3 and all(whole)
    session = tmp_path / "chat.safetensors"
    first, err = _chat(monkeypatch, capsys, list(TURNS[:2]), "--session", str(session))
    assert first == whole[:2] and "saved" in err and session.is_file()
    second, err = _chat(monkeypatch, capsys, [TURNS[2], "/stats"], "--session", str(session))
    assert "loaded" in err
    assert second[0] == whole[2]
    seen = int(second[1].split("tokens seen: ")[1].split()[0])
    assert seen > 64 and "slots held: 64 of 64" in second[1]


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
    with pytest.raises(SystemExit) as exc:
        main(["chat", "--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("usage: litkv [options] chat")
    for args in (["--temperature", "-1"], ["--undo_depth", "0"], [str(REPO / "no_such_checkpoint")]):
        with pytest.raises(SystemExit) as exc:
            main(["chat", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 1 and len(err) == 1 and err[0].startswith("error: "), err


def test_pipe_subprocess() -> None:
    """A real process reading its standard input from a pipe."""
    cmd = [sys.executable, "-m", "litkv", "chat", *H2O, *GREEDY]
    text = f"{TURNS[0]}\n/stats\n{TURNS[1]}\n/undo\n{TURNS[1]}\n"
    done = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert len(out) == 5 and out[1].startswith("tokens seen:") and out[2] == out[4] and out[0]
    assert "litkv chat" not in done.stderr  # no banner when the input is not a terminal


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


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_pseudo_terminal_session() -> None:
    """As a person at a terminal: banner and prompt, a long reply streamed and stopped with Ctrl-C (the
    session stays: /stats counts the tokens), then Ctrl-D exits with status 0."""
    import pty

    main_fd, child_fd = pty.openpty()
    cmd = [sys.executable, "-m", "litkv", "chat", *H2O, "--temperature", "0", "--num_threads", "1"]
    cmd += ["--max_new_tokens", "100000", "--stop_at_newline", "false"]
    proc = subprocess.Popen(
        cmd, stdin=child_fd, stdout=child_fd, stderr=child_fd, cwd=REPO, preexec_fn=_controlling_terminal
    )
    os.close(child_fd)
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
        os.close(main_fd)
