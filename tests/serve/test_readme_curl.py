"""The README's `litkv serve` + `curl` example, run as written: the server on the shipped model with the
README's arguments (a free port instead of 8000, so the test never meets another server), then the
README's curl command verbatim but for that port. The reply is an OpenAI chat completion from the model
the README names. Then a SIGTERM: one drain message (LitServe's forked processes inherit the handler but do not
drain), no leaked-semaphore warning, no traceback, exit status 0 (this was tests/serve/test_serve_sigterm.py, on
an idle server; here the server has handled a request)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from servers import launch_server

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
    log = tmp_path / "server.log"
    server = launch_server(args, log, cwd=tmp_path)
    port = server.port
    try:
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
        assert server.stop() == 0, server.log_text()[-2000:]
    text = server.log_text()
    assert text.count("SIGTERM: draining") == 1, text[-2000:]
    assert "leaked semaphore" not in text and "Traceback" not in text, text[-2000:]
