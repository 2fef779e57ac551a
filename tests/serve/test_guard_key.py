"""The API key in front of every path but `/health` (issue 61 item 9): FastAPI's `/docs` and
`/openapi.json` need it as `/v1` does, and ``Authorization`` needs its ``Bearer`` scheme."""

from __future__ import annotations

import asyncio

import pytest

from litkv.serve.guard import Guard

KEY = "sk-test"


def _status(path: str, headers: dict[str, str], api_key: str | None = KEY) -> int:
    """The status the guard answers a GET of `path` with (200: it reached the app)."""

    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    scope = {"type": "http", "method": "GET", "path": path, "headers": raw}
    asyncio.run(Guard(app, api_key, 1024)(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/redoc", "/v1/models", "/info"])
def test_every_path_but_health_needs_the_key(path: str) -> None:
    assert _status(path, {}) == 401
    assert _status(path, {"Authorization": f"Bearer {KEY}"}) == 200
    assert _status(path, {"X-API-Key": KEY}) == 200
    assert _status(path, {}, api_key=None) == 200  # no key set: open


def test_health_stays_open() -> None:
    assert _status("/health", {}) == 200


@pytest.mark.parametrize("value", [KEY, f"Basic {KEY}", f"Token {KEY}", f"{KEY} {KEY}"])
def test_authorization_needs_the_bearer_scheme(value: str) -> None:
    assert _status("/v1/models", {"Authorization": value}) == 401


@pytest.mark.parametrize("value", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER   {KEY}"])
def test_bearer_scheme_is_case_insensitive(value: str) -> None:
    assert _status("/v1/models", {"Authorization": value}) == 200
