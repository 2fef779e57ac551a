"""A client that goes away while its non-streaming request runs (issue 50, item 4): the turn is cancelled
within a decode step, its row freed and nothing stored; before, it ran to its `max_tokens` holding its row.

A real `litkv serve` process (the `shared_server` of tests/serve/conftest.py); the reference is the same
request left to run: greedy, it decodes hundreds of tokens; the one whose client went away stops within
a fraction of them.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from pathlib import Path

import pytest
from servers import Server

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "the fox"}], "max_tokens": 512, "temperature": 0}
HEADERS = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}


def _log_since(log: Path, offset: int) -> str:
    """The server's log from byte `offset` on (the shared server's log holds other tests' turns before it)."""
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _turns(text: str) -> list[tuple[int, str]]:
    """(new tokens, stored) of each finished turn in a piece of the server's log."""
    return [(int(n), s) for n, s in re.findall(r"restored, (\d+) new, stored=(\w+)", text)]


@pytest.mark.slow
def test_a_non_streaming_client_that_disconnects_frees_its_row(shared_server: Server) -> None:
    log, host, port = shared_server.log, "127.0.0.1", shared_server.port
    offset = log.stat().st_size
    conn = http.client.HTTPConnection(host, int(port), timeout=120)  # left to run: the reference
    start = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps(BODY), HEADERS)
    reply = json.loads(conn.getresponse().read())
    full_s = time.monotonic() - start
    full = reply["usage"]["completion_tokens"]
    assert full > 200, reply["usage"]
    conn.close()

    gone = http.client.HTTPConnection(host, int(port), timeout=120)
    gone.request("POST", "/v1/chat/completions", json.dumps(BODY), HEADERS)
    time.sleep(min(0.5, full_s / 4))
    gone.sock.close()  # the client goes away before its answer
    deadline = time.monotonic() + 30
    while len(_turns(_log_since(log, offset))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "client went away" in _log_since(log, offset)
    new, stored = _turns(_log_since(log, offset))[1]
    assert stored == "False" and new < full / 2, (new, full, full_s)  # stopped early, nothing stored
    conn = http.client.HTTPConnection(host, int(port), timeout=120)  # the server goes on
    conn.request("POST", "/v1/chat/completions", json.dumps({**BODY, "max_tokens": 4}), HEADERS)
    assert conn.getresponse().status == 200
