"""Real `litkv serve` processes for the tests: `launch_server` (one helper for every test that starts one) and
`Server` (its process, port and log; `stop`).

A test that only needs *a* running server with the common flags uses the `shared_server` fixture of
tests/serve/conftest.py; a test that SIGTERMs, kills or restarts its server launches its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-test"
SHARED_MAX_BODY = 1 << 16  # the shared server's --max_body_bytes
SHARED_BODY_TIMEOUT_S = 2  # and its --body_timeout


def shared_server_args(ckpt: Path, state_dir: Path) -> list[str]:
    """The `shared_server`'s arguments (tests/serve/conftest.py): `ckpt` served as "tiny", h2o 64 slots, replies
    not cut at newlines, at most 1,000 tokens a reply, a 64 KiB body limit, 2 s body time, API key `KEY`."""
    return [str(ckpt), "--kv_cache", "h2o", "--kv_cache.cache_length", "64", "--api_key", KEY,
            "--stop_at_newline", "false", "--max_tokens", "1000", "--max_body_bytes", str(SHARED_MAX_BODY),
            "--body_timeout", str(SHARED_BODY_TIMEOUT_S), "--model_name", "tiny",
            "--state_dir", str(state_dir)]  # fmt: skip


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(status: Callable[[], int], seconds: float = 90) -> None:
    """Until `status()` says 200 (the worker has loaded the model), at most `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if status() == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server was not healthy within {seconds} s")


@dataclass
class Server:
    """A `litkv serve` process on 127.0.0.1:`port`, its output (stdout and stderr) appended to `log`."""

    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (the process only) and its exit status; killed (and the timeout raised) past `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL to the process (its process group too when it has its own) and wait for it."""
        if self.proc.poll() is None:
            try:
                if os.getpgid(self.proc.pid) == self.proc.pid:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
            except ProcessLookupError:
                pass
        self.proc.wait(30)


def launch_server(
    args: list[str], log: Path, *, new_session: bool = False, cwd: Path | None = None, seconds: float = 300
) -> Server:
    """`python -m litkv serve ARGS --port P --num_threads 1` on a free port P (litkv from this checkout), healthy.

    Args:
        args: the arguments after `serve` (checkpoint and options).
        log: the file its output is appended to.
        new_session: a session (and process group) of its own, as under systemd: `os.killpg(proc.pid, ...)`.
        cwd: its working directory (default: the test's).
        seconds: how long it may take to become healthy (a start takes seconds on an idle machine, minutes on a
            loaded one); a server that does not is stopped and the error raised.
    """
    port = free_port()
    argv = [sys.executable, "-m", "litkv", "serve", *args, "--port", str(port)]
    if "--num_threads" not in args:
        argv += ["--num_threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=new_session
        )
    server = Server(proc, port, log)

    def health() -> int:
        if proc.poll() is not None:
            raise RuntimeError(f"litkv serve exited with {proc.returncode}: {server.log_text()[-2000:]}")
        with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
            return r.status

    try:
        wait_healthy(health, seconds)
    except BaseException:
        with contextlib.suppress(subprocess.TimeoutExpired):  # a server that never became healthy is not left
            server.stop()  # running (SIGTERM ends its workers)
        raise
    return server
