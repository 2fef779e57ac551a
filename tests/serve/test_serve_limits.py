"""`litkv serve` under attack, on one real server process (the `shared_server` of tests/serve/conftest.py):
bounded request bodies (chunked included) and body time, the OpenAI contract (`finish_reason`, 64-bit
seeds, lone surrogates, unimplemented fields, booleans), and the serving options checked at start. (503
while draining: tests/serve/test_serve.py's real server, which is SIGTERMed mid-stream.)
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from servers import KEY, SHARED_MAX_BODY, Server

from litkv.__main__ import main

REPO = Path(__file__).resolve().parents[2]
MAX_BODY = SHARED_MAX_BODY
CHUNKED_MB = 16


@pytest.fixture(scope="module")
def server(shared_server: Server) -> tuple[subprocess.Popen, int, Path]:
    """The `shared_server` (tests/serve/conftest.py: h2o 64 slots, replies not cut at newlines, a 64 KiB body
    limit, 2 s body time): (process, port, log)."""
    return shared_server.proc, shared_server.port, shared_server.log


def post(port: int, body: object, raw: bytes | None = None) -> tuple[int, dict]:
    """POST /v1/chat/completions: (status, JSON body)."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=data,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def chat(**kw: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "The quick brown fox"}], "temperature": 0, **kw}


def tree_rss_mb(pid: int) -> float:
    """Resident memory of process `pid` and all its descendants (LitServe's API and worker processes), MB."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0.0
    for p in tree:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0) / 1024
    return total


def _raw_request(port: int, headers: list[str]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = ["POST /v1/chat/completions HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY}",
            "Content-Type: application/json", *headers]  # fmt: skip
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    return sock


def _reply(sock: socket.socket) -> bytes:
    """The whole HTTP response on `sock` (headers and a Content-Length body)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        more = sock.recv(65536)
        if not more:
            break
        data += more
    return data


def _content_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    found = [line for line in head.split(b"\r\n") if line.startswith(b"content-length:")]
    return int(found[0].split(b":")[1]) if found else 0


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


@pytest.mark.slow
def test_a_chunked_body_is_cut_at_the_limit_and_memory_stays_bounded(server: tuple) -> None:
    """The round's finding: a 50 MB chunked body took the server from 1.5 to 13.2 GiB. Here 16 MB of one
    valid JSON message, sent chunked: 413 once 64 KiB are in, and the server's RSS barely moves."""
    proc, port, _ = server
    before = tree_rss_mb(proc.pid)
    sock = _raw_request(port, ["Transfer-Encoding: chunked"])
    pieces = [b'{"model": "tiny", "messages": [{"role": "user", "content": "'] + [b"the fox " * 8192] * (
        CHUNKED_MB * 16
    )
    reply, peak = b"", before
    try:
        for piece in pieces:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            peak = max(peak, tree_rss_mb(proc.pid))
            if select.select([sock], [], [], 0)[0]:
                break
        else:
            sock.sendall(b'0"}]}\r\n0\r\n\r\n')
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        reply = _reply(sock)
    finally:
        sock.close()
    assert _status(reply) == 413 and b"at most 65536 bytes" in reply, reply[:300]
    time.sleep(1.0)
    after = tree_rss_mb(proc.pid)
    print(f"server tree RSS: {before:.0f} MB before, {peak:.0f} MB peak, {after:.0f} MB after")
    assert max(peak, after) - before < 150, (before, peak, after)
    assert post(port, chat(max_tokens=2))[0] == 200  # and it still serves


@pytest.mark.slow
def test_a_body_short_of_its_content_length_times_out(server: tuple) -> None:
    _, port, _ = server
    sock = _raw_request(port, ["Content-Length: 1000"])
    sock.sendall(b'{"model": "tiny"')
    start = time.monotonic()
    reply = _reply(sock)
    sock.close()
    assert _status(reply) == 408 and b"did not arrive within 2 s" in reply, reply[:300]
    assert time.monotonic() - start < 30
    too_big = _raw_request(port, [f"Content-Length: {MAX_BODY + 1}"])
    assert _status(_reply(too_big)) == 413  # by the header alone, before a byte of the body
    too_big.close()


def test_finish_reason_is_length_when_max_tokens_cut_the_reply(server: tuple) -> None:
    _, port, _ = server
    status, cut = post(port, chat(max_tokens=3))
    assert status == 200 and cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 3
    text = cut["choices"][0]["message"]["content"]
    assert text.strip()
    status, stopped = post(port, chat(max_tokens=50, stop=[text]))  # greedy: the same start, cut by the stop string
    assert status == 200 and stopped["choices"][0]["finish_reason"] == "stop", stopped
    assert stopped["usage"]["completion_tokens"] < 50
    body = json.dumps(chat(max_tokens=3, stream=True)).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"seed": 1 << 64}, "seed", "64 bits"),
        ({"seed": -(1 << 63) - 1}, "seed", "64 bits"),
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages", "lone surrogate"),
        ({"stop": ["\udfff"]}, "stop", "lone surrogate"),
        ({"stream": True, "messages": [{"role": "user", "content": "\ud83d"}]}, "messages", "lone surrogate"),
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"logprobs": True}, "logprobs", "not supported"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"frequency_penalty": 1}, "frequency_penalty", "not supported"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
        ({"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
        ({"frobnicate": 1}, "frobnicate", "not supported"),
        ({"max_tokens": True}, "max_tokens", "not a boolean"),
        ({"temperature": False}, "temperature", "not a boolean"),
        ({"seed": True}, "seed", "not a boolean"),
        ({"stream": 1}, "stream", "boolean"),
    ],
)
def test_openai_fields_out_of_contract_are_400_naming_the_field(
    server: tuple, fields: dict, param: str, words: str
) -> None:
    _, port, _ = server
    raw = json.dumps(chat(**{"max_tokens": 2, **fields})).encode()  # ensure_ascii: surrogates as \\ud800 escapes
    status, body = post(port, None, raw=raw)
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_no_op_values_of_unimplemented_fields_are_accepted(server: tuple) -> None:
    _, port, _ = server
    fields = {"presence_penalty": 0, "frequency_penalty": 0.0, "response_format": {"type": "text"}, "logprobs": False,
              "user": "u1", "stream_options": None, "tool_choice": "auto", "seed": (1 << 64) - 1}  # fmt: skip
    status, body = post(port, chat(max_tokens=2, **fields))
    assert status == 200, body


@pytest.mark.slow
def test_serve_options_are_checked_at_start(ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """`--top_k 0` in a real process (started first: it imports while the others run through the same CLI entry
    point in process)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    real = subprocess.Popen([sys.executable, "-m", "litkv", "serve", str(ckpt), "--top_k", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    for args, words in (
        (["--timeout", "-1"], "--timeout must be a number of seconds > 0, got -1.0"),
        (["--body_timeout", "0"], "--body_timeout must be a number of seconds > 0"),
        (["--api_key", ""], "--api_key must not be empty"),
        (["--seed", str(1 << 64)], "--seed must be an int in [-9223372036854775808, 18446744073709551615]"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["serve", str(ckpt), *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 1 and len(err) == 1 and words in err[0], err

    import litkv.serve.api

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("stopped before serving")

    monkeypatch.setattr(litkv.serve.api, "build_server", refuse)
    with pytest.raises(SystemExit):
        main(["serve", str(ckpt), "--host", "0.0.0.0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("warning: --host 0.0.0.0 serves other machines without an API key"), err
    with pytest.raises(SystemExit):
        main(["serve", str(ckpt), "--host", "0.0.0.0", "--api_key", KEY])
    assert "warning" not in capsys.readouterr().err
    _, stderr = real.communicate(timeout=120)
    assert real.returncode == 1 and stderr.strip().splitlines() == [
        "error: --top_k must be an int >= 1 or null, got 0"  # answered before torch is imported (preflight)
    ]
