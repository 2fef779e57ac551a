"""The ASGI guard in front of `litkv serve`'s app: the API key, the request body's bounds, and draining.

Everything is answered with OpenAI-style error bodies before the app sees the request:

- every path but `/health` (`/v1`, and FastAPI's `/docs`, `/redoc` and `/openapi.json`) needs the API key
  (``Authorization: Bearer KEY`` or ``X-API-Key``) when one is set (401); ``Authorization`` needs its
  ``Bearer`` scheme;
- while the server drains (SIGTERM; a `DRAINING` file in `run_dir`), new `/v1` requests get 503 with
  `Retry-After` until the listener closes;
- a request body is read here, counted as it streams in, and handed on only when complete: more than
  `max_body_bytes` (by Content-Length or, for chunked transfer encoding, by the bytes received) is a
  413 and reading stops there; a body that does not arrive within `body_timeout` seconds (one that
  stops short of its Content-Length) is a 408. So one request holds at most `max_body_bytes` of body.
- each chat request in flight has a marker file in `run_dir`, so a drain waits for it; with
  `max_inflight` chat requests in flight (the running batch and its queue full), a new one gets 503
  with `Retry-After` (code `server_overloaded`).
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse

__all__ = ["DRAINING", "INFLIGHT", "Guard", "error_body"]

DRAINING = "DRAINING"  # marker file in the run directory: refuse new requests
INFLIGHT = "inflight-"  # one marker file per chat request in flight
OPEN_PATHS = frozenset({"/health"})  # what a load balancer probes; everything else needs the key when one is set


def error_body(message: str, code: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = "authentication_error" if code == "invalid_api_key" else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Guard:
    """ASGI middleware: API key, bounded body (size and time), 503 while draining, in-flight markers."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        max_body_bytes: int,
        run_dir: Path | None = None,
        body_timeout: float = 30.0,
        max_inflight: int | None = None,
    ) -> None:
        self.app = app
        self.max_inflight = max_inflight
        self.run_dir = run_dir
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self._refusal(scope.get("path", ""), headers)
        if refusal is None and scope.get("method", "GET") not in ("GET", "HEAD", "OPTIONS"):
            body, refusal = await self._read_body(receive)
            receive = _replay(body, receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        marker = None
        if self.run_dir is not None and scope.get("path", "").startswith("/v1/chat"):
            if self.max_inflight is not None and self._inflight() >= self.max_inflight:
                await self._overloaded()(scope, receive, send)
                return
            marker = Path(self.run_dir) / f"{INFLIGHT}{uuid.uuid4().hex}"
            marker.touch()
        try:
            await self.app(scope, receive, send)
        finally:
            if marker is not None:
                marker.unlink(missing_ok=True)

    def _inflight(self) -> int:
        return sum(1 for p in Path(self.run_dir).iterdir() if p.name.startswith(INFLIGHT))  # type: ignore[arg-type]

    def _overloaded(self) -> JSONResponse:
        message = f"the server is full ({self.max_inflight} requests running or queued); retry later"
        return JSONResponse(error_body(message, "server_overloaded"), status_code=503, headers={"Retry-After": "1"})

    def _too_large(self) -> JSONResponse:
        message = f"the request body must be at most {self.max_body_bytes} bytes"
        return JSONResponse(error_body(message, "request_too_large"), status_code=413)

    def _refusal(self, path: str, headers: dict[str, str]) -> JSONResponse | None:
        if self.run_dir is not None and path.startswith("/v1") and (Path(self.run_dir) / DRAINING).exists():
            body = error_body("the server is shutting down", "server_shutting_down")
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        keyed = self.api_key is not None and path not in OPEN_PATHS
        if keyed and not hmac.compare_digest(_given_key(headers).encode(), str(self.api_key).encode()):
            return JSONResponse(error_body("invalid or missing API key", "invalid_api_key"), status_code=401)
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            return JSONResponse(error_body(f"Content-Length must be a number, got {length!r}"), status_code=400)
        if length is not None and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    async def _read_body(self, receive: Any) -> tuple[bytes, JSONResponse | None]:
        """The whole body, read as it streams in: `(body, None)`, or a 413/408 refusal (reading stops)."""
        chunks: list[bytes] = []
        size = 0
        end = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(end - time.monotonic(), 0.0))
            except TimeoutError:
                message = f"the request body did not arrive within {self.body_timeout:g} s"
                return b"", JSONResponse(error_body(message, "request_timeout"), status_code=408)
            if message["type"] != "http.request":  # the client went away
                return b"", None
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return b"", self._too_large()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI `receive` that gives `body` once, then what `receive` gives (a disconnect, later)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _given_key(headers: Any) -> str:
    """The key a request gives: ``X-API-Key``, else ``Authorization``'s credentials after the ``Bearer``
    scheme, matched case-insensitively (RFC 7235); an ``Authorization`` without that scheme gives no key."""
    if headers.get("x-api-key"):
        return str(headers.get("x-api-key"))
    scheme, _, credentials = str(headers.get("authorization", "")).strip().partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else ""
