"""SIGTERM to `litkv serve`'s process group while replies run longer than the drain's limit (`--timeout`;
issue 47, item 7): the limit is kept, then a stream ends with an error event and `[DONE]` (it was cut with
neither: LitServe's shutdown closed the connection) and a non-streaming request gets a 503 with
`Retry-After` (it got a connection reset); the server exits with status 0. The stream's ending is also
checked without a server, on the spec alone (fast).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import pickle
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from fastapi import HTTPException
from litserve.utils import LitAPIStatus
from servers import KEY, launch_server
from test_serve_group_sigterm import _group_alive, _post

from litkv.kvcache.config import KVCacheConfig
from litkv.serve.api import ChatRequest, LitKVSpec, ServeOptions
from litkv.serve.drain import DRAIN_EXPIRED
from litkv.serve.guard import error_body

LIMIT_S = 2  # the drain's limit: --timeout
LONG = 20_000  # tokens: far more than the tiny model decodes in LIMIT_S


def _stream(
    spec: LitKVSpec, tokens: int | None, expire_after: int | None, run_dir: Path, error: object = None
) -> list[str]:
    """The events of `spec`'s stream over a worker that sends `tokens` tokens (None: without end), the drain's
    limit marked after `expire_after` of them; then, with `error`, the worker fails (LitServe relays `error`)."""

    async def worker():
        sent = 0
        while tokens is None or sent < tokens:
            await asyncio.sleep(0.005)
            sent += 1
            if sent == expire_after:
                (run_dir / DRAIN_EXPIRED).touch()
            yield json.dumps({"role": "assistant", "content": "x"}), LitAPIStatus.OK
        if error is not None:
            yield error, LitAPIStatus.ERROR

    async def read() -> list[str]:
        request = ChatRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)
        request.metadata = {"litkv_id": "turn-1"}
        return [chunk async for chunk in spec.streaming_completion(request, [worker()])]

    chunks = asyncio.run(asyncio.wait_for(read(), timeout=30))
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks), chunks[-2:]  # each a whole event
    return [c.removeprefix("data: ").strip() for c in chunks]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (pickle.dumps(RuntimeError("the batch loop broke")), "internal_error"),  # LitServe pickles other errors
        (HTTPException(400, error_body("no room left", "context_length_exceeded")), "context_length_exceeded"),
        (b"not a pickle", "internal_error"),
    ],
    ids=["other-error", "request-error", "unreadable"],
)
def test_a_worker_error_mid_stream_ends_with_an_error_event_and_done(
    ckpt: Path, tmp_path: Path, error: object, code: str
) -> None:
    """A worker that fails after 3 tokens: the stream's last events are an error (its OpenAI body, the
    request error's own when it was one) and `[DONE]`; LitServe's own ending had no `[DONE]`."""
    opts = ServeOptions(ckpt, KVCacheConfig(policy="h2o", cache_length=64), "tiny", cancel_dir=tmp_path)
    events = _stream(LitKVSpec(opts), tokens=3, expire_after=None, run_dir=tmp_path, error=error)
    assert events[-1] == "[DONE]" and len(events) == 5, events
    assert json.loads(events[-2])["error"]["code"] == code
    assert all(json.loads(e)["choices"][0]["delta"]["content"] == "x" for e in events[:3])


def test_a_stream_past_the_drain_limit_ends_with_an_error_event_and_done(ckpt: Path, tmp_path: Path) -> None:
    opts = ServeOptions(ckpt, KVCacheConfig(policy="h2o", cache_length=64), "tiny", cancel_dir=tmp_path)
    spec = LitKVSpec(opts)
    events = _stream(spec, tokens=20, expire_after=None, run_dir=tmp_path)  # no drain: the whole reply
    assert len(events) == 22 and events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"]
    assert not (tmp_path / "turn-1").exists()

    events = _stream(spec, tokens=None, expire_after=5, run_dir=tmp_path)  # a reply without end
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert all("error" not in json.loads(e) for e in events[:-2]) and 5 <= len(events) - 2 < 60
    assert (tmp_path / "turn-1").exists()  # its turn cancelled: the worker frees the row


@pytest.mark.slow  # about 70 s on the 2 shared cores, most of it the server's start
def test_replies_running_past_the_drain_limit_end_with_an_error(ckpt: Path, tmp_path: Path) -> None:
    args = [str(ckpt), "--kv_cache", "h2o", "--kv_cache.cache_length", "64", "--api_key", KEY, "--stop_at_newline",
            "false", "--max_tokens", str(LONG), "--model_name", "tiny", "--timeout", str(LIMIT_S)]  # fmt: skip
    server = launch_server(args, tmp_path / "server.log", new_session=True)
    proc, port, log = server.proc, server.port, server.log
    try:
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "The quick brown fox"}], "temperature": 0,
               "max_tokens": LONG}  # fmt: skip
        plain: list = []
        waiting = threading.Thread(target=lambda: plain.append(_post(port, ask)))
        waiting.start()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps({**ask, "stream": True}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        )
        with urllib.request.urlopen(request, timeout=120) as stream:
            assert stream.readline().startswith(b"data: ")
            os.killpg(proc.pid, signal.SIGTERM)
            sent = time.monotonic()
            try:
                rest = stream.read()
            except http.client.IncompleteRead as cut:  # a connection closed mid-stream
                rest = cut.partial
            ended = time.monotonic() - sent
        waiting.join(60)
        events = [line[6:] for line in rest.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and "drain time (--timeout)" in error["message"], error
        assert LIMIT_S - 0.1 <= ended < LIMIT_S + 10, ended  # the limit was kept, then the stream ended at once
        assert len(events) < LONG
        status, headers, body = plain[0]
        assert status == 503 and body["error"]["code"] == "server_shutting_down", body
        assert "drain time" in body["error"]["message"]  # stopped at the limit, not refused at the door
        assert headers.get("retry-after") == "5"
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert "stopping the replies still running" in log.read_text()
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
