"""SIGTERM to `litkv serve` (idle): one drain message (LitServe's forked workers inherit the handler but do
not drain), no leaked-semaphore warning, exit status 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sigterm_drains_once_and_exits_cleanly(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "litkv", "serve", "--port", str(port), "--num_threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        end = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < end, "the server did not become healthy"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert text.count("SIGTERM: draining") == 1, text[-2000:]
    assert "leaked semaphore" not in text and "Traceback" not in text, text[-2000:]
