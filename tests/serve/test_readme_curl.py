"""The README's `litkv serve` + `curl` example, run as written: the server on the shipped model with the
README's arguments (a free port instead of 8000, so the test never meets another server), then the
README's curl command verbatim but for that port. The reply is an OpenAI chat completion from the model
the README names."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from test_serve import _free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")]


def readme_serve_lines() -> tuple[list[str], str]:
    """The README's `litkv serve` command (its arguments, comment dropped) and its curl command."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    serve = re.search(r"^litkv serve\b([^#\n]*)", text, re.M)
    curl = re.search(r"^curl .*?(?<!\\)\n", text, re.M | re.S)
    assert serve and curl, "README.md lost its `litkv serve` / curl example"
    return shlex.split(serve.group(1)), curl.group(0).replace("\\\n", " ")


def test_readme_curl_example_gets_a_completion(tmp_path: Path) -> None:
    args, curl = readme_serve_lines()
    assert "http://127.0.0.1:8000/" in curl
    port = _free_port()
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "litkv", "serve", *args, "--port", str(port), "--num_threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"

    def health() -> int:
        if proc.poll() is not None:
            raise RuntimeError(f"litkv serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status

    try:
        wait_healthy(health, seconds=240)
        out = subprocess.run(
            ["bash", "-c", curl.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout
        reply = json.loads(out)
        assert reply["object"] == "chat.completion", out
        assert reply["model"] == json.loads(re.search(r"-d '(.*)'", curl).group(1))["model"]
        assert reply["choices"][0]["message"]["content"].strip(), out
        assert 0 < reply["usage"]["completion_tokens"] <= 32
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
