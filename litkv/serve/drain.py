"""How `litkv serve` stops on SIGTERM: refuse new requests, let the replies in flight finish within a
limit, end the ones still running with an error, then stop LitServe. Also the errors a stream that cannot
finish ends with (then `[DONE]`): the drain's (`drain_error`) and a failed worker's (`worker_error`).

The main process and LitServe's workers share a run directory: the guard's `DRAINING` and `INFLIGHT*`
markers (litkv.serve.guard) and `DRAIN_EXPIRED`, which this module writes when the limit passes and which
each reply in flight polls (`DrainStopper`).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import litserve as ls
from fastapi import HTTPException

from litkv.serve.guard import DRAINING, INFLIGHT, error_body

__all__ = [
    "DRAIN_EXPIRED",
    "STOP_POLL_S",
    "DrainStopper",
    "drain_error",
    "drain_on_sigterm",
    "leave_process_group",
    "stop_litserve",
    "until_stopped",
    "worker_error",
]

log = logging.getLogger(__name__)

DRAIN_EXPIRED = "DRAIN-EXPIRED"  # marker file in the run directory: the drain's limit passed, stop what runs
STOP_POLL_S = 0.1  # how often a reply in flight looks for that marker
STOP_GRACE_S = 5.0  # how long the drain then waits for the stopped replies' last bytes


def drain_error() -> dict[str, Any]:
    """The error a reply still running at the drain's limit ends with (an event of a stream, or a 503)."""
    message = "the server is shutting down and this reply did not finish within its drain time (--timeout); retry"
    return error_body(message, "server_shutting_down")


def worker_error(response: Any) -> dict[str, Any]:
    """The error a stream ends with when its worker failed mid-reply. `response` is what LitServe relays from
    the worker: an `HTTPException` (a request error: its OpenAI body), pickled, or another error (a 500's)."""
    if isinstance(response, bytes):
        try:  # only an HTTPException is rebuilt: any other class named in the bytes is refused, never imported
            response = _HTTPExceptionOnly(io.BytesIO(response)).load()
        except (pickle.UnpicklingError, ValueError, TypeError, EOFError, AttributeError):
            response = None
    if isinstance(response, HTTPException) and isinstance(response.detail, dict) and "error" in response.detail:
        return response.detail
    body = error_body("the server failed while generating this reply (see its log); retry", "internal_error")
    body["error"]["type"] = "server_error"
    return body


class _HTTPExceptionOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in (("fastapi.exceptions", "HTTPException"), ("starlette.exceptions", "HTTPException")):
            return HTTPException
        raise pickle.UnpicklingError(f"refused: {module}.{name}")


class DrainStopper:
    """Whether the drain's limit has passed (the `DRAIN_EXPIRED` marker), looked up at most every
    `STOP_POLL_S` seconds."""

    def __init__(self, run_dir: Path | None) -> None:
        self.marker = None if run_dir is None else Path(run_dir) / DRAIN_EXPIRED
        self.next_look = 0.0

    def expired(self) -> bool:
        if self.marker is None or time.monotonic() < self.next_look:
            return False
        self.next_look = time.monotonic() + STOP_POLL_S
        return self.marker.exists()


async def until_stopped(chunks: AsyncIterator[str], stopper: DrainStopper) -> AsyncIterator[str | None]:
    """`chunks` as they come, then `None` once `stopper` says the drain's limit passed (instead of the rest)."""
    pending: asyncio.Future[str] | None = None
    try:
        while not stopper.expired():
            if pending is None:
                pending = asyncio.ensure_future(anext(chunks))
            done, _ = await asyncio.wait({pending}, timeout=STOP_POLL_S)
            if not done:
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield chunk
        yield None
    finally:
        if pending is not None:  # the stream stopped, or its client went away while waiting for a chunk
            pending.cancel()


def leave_process_group() -> None:
    """Put this process (a LitServe API server, worker or queue manager) in a process group of its own, dying
    with its parent: a SIGTERM to the server's process group (systemd, docker, a shell's `kill -- -PGID`)
    then reaches only the main process, which drains the requests in flight and stops the others itself."""
    try:
        os.setpgid(0, 0)
    except OSError:  # a session leader cannot move; it keeps the group's signals
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the server
    except (OSError, AttributeError):  # not Linux: a SIGKILL of the main process leaves them to the user
        pass


def drain_on_sigterm(server: ls.LitServer, run_dir: Path, limit_s: float = 120.0) -> None:
    """On SIGTERM (to the process or its process group): refuse new requests (503 with `Retry-After`), wait
    (at most `limit_s`) for those in flight to finish, then stop LitServe (its shutdown would otherwise cut
    the streams in flight). Replies still running at `limit_s` are stopped first (`DRAIN_EXPIRED`): a stream
    ends with an error event and `[DONE]`, a non-streaming request gets a 503 (at most `STOP_GRACE_S` more).
    The processes LitServe forks from here on leave the group (`leave_process_group`), so the group's
    SIGTERM does not kill them mid-stream."""
    os.register_at_fork(after_in_child=leave_process_group)

    def drain() -> None:
        (Path(run_dir) / DRAINING).touch()
        log.info("SIGTERM: draining the requests in flight (at most %.0f s)", limit_s)
        _wait_inflight(run_dir, limit_s)
        if any(Path(run_dir).glob(f"{INFLIGHT}*")):  # past the limit: each reply ends with an error, not cut
            log.warning("SIGTERM: the drain's %.0f s are over; stopping the replies still running", limit_s)
            (Path(run_dir) / DRAIN_EXPIRED).touch()
            _wait_inflight(run_dir, STOP_GRACE_S)
        time.sleep(0.2)  # the last bytes of the last response
        stop_litserve(server)

    owner = os.getpid()
    previous: Any = None

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != owner:  # a worker LitServe forked inherited this handler: end as it would have
            _pass_on(signum, frame, previous)
            return
        threading.Thread(target=drain, name="litkv-drain", daemon=True).start()

    previous = signal.signal(signal.SIGTERM, handler)


class _Stopped:
    """LitServe's shutdown event once the drain has set it: `is_set` answers without asking the manager
    process that holds the event, which LitServe shuts down next (its worker-monitoring thread polls
    `is_set` every 2 s, and a poll that reached a manager already gone logged a traceback)."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def is_set(self) -> bool:
        return True

    def set(self) -> None:
        self.event.set()

    def wait(self, timeout: float | None = None) -> bool:
        return True


def stop_litserve(server: Any) -> None:
    """Wake LitServe's main thread (waiting on `server._shutdown_event`) so that it shuts the server down,
    after pointing the attribute at a stand-in that says it is set (`_Stopped`)."""
    event = server._shutdown_event
    if event is None or isinstance(event, _Stopped):
        return
    server._shutdown_event = _Stopped(event)
    event.set()


def _wait_inflight(run_dir: Path, seconds: float) -> None:
    """Until no request is in flight (the guard's markers in `run_dir`), at most `seconds`."""
    end = time.monotonic() + seconds
    while any(Path(run_dir).glob(f"{INFLIGHT}*")) and time.monotonic() < end:
        time.sleep(0.1)


def _pass_on(signum: int, frame: Any, previous: Any) -> None:
    """SIGTERM in a forked worker: the handler it had before `drain_on_sigterm`, or the default (exit), so
    that only the server's own process drains (and says so once)."""
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
