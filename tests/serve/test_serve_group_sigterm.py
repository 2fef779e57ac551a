"""SIGTERM to `litkv serve`'s whole process group (systemd, docker, `kill -- -PGID`) while a reply streams
(issue 47, item 7). The round's finding: the stream was cut after 11 events with no `[DONE]` and no
error, and new requests got connection resets, not 503: every LitServe process died of the signal.
Now only the main process takes it and drains: the stream ends normally, a new request gets 503 with
`Retry-After`, the server exits with status 0 and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from servers import KEY, launch_server


def _post(port: int, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, json.loads(err.read())


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_sigterm_to_the_process_group_drains_the_stream_and_refuses_new_requests(ckpt: Path, tmp_path: Path) -> None:
    args = [str(ckpt), "--kv_cache", "h2o", "--kv_cache.cache_length", "64", "--api_key", KEY, "--stop_at_newline",
            "false", "--max_tokens", "1000", "--model_name", "tiny"]  # fmt: skip
    # a session of its own: its process group is the server's alone (pgid == pid), as under systemd
    server = launch_server(args, tmp_path / "server.log", new_session=True)
    proc, port, log = server.proc, server.port, server.log
    children: list[int] = []
    try:
        children = _children(proc.pid)
        assert children  # LitServe's API server, inference worker and queue manager
        body = {"model": "tiny", "messages": [{"role": "user", "content": "The quick brown fox"}],
                "temperature": 0, "max_tokens": 400, "stream": True}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        )
        with urllib.request.urlopen(request, timeout=120) as stream:
            assert stream.readline().startswith(b"data: ")
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(0.5)
            status, headers, refused = _post(port, {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
            rest = stream.read().decode().splitlines()
        assert status == 503 and refused["error"]["code"] == "server_shutting_down", refused
        assert headers.get("retry-after") == "5"
        events = [line[6:] for line in rest if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 400
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(30)
