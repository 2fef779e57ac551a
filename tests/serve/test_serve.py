"""`litkv serve`: the state-reuse contract (engine), the HTTP API and its errors (in process, through
LitServe's ASGI app), and one real `litkv serve` process driven by the `openai` client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import KEY, launch_server, wait_healthy

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.kvcache.config import KVCacheConfig
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult

KV = KVCacheConfig(policy="h2o", cache_length=32, chunk_size=8)
TURNS = [
    "The quick brown fox",
    "What is the passkey?",
    "Remember it.",
    "In the beginning was the word",
    "The passkey is 12345.",
    "the lazy dog",
    "was with the fox",
    "What is it?",
    "jumps over",
    "The word",
    "Remember the passkey.",
]


@pytest.fixture(scope="module")
def model_and_tok(ckpt: Path) -> tuple:
    return load_model(ckpt), load_tokenizer(ckpt)


def converse(engine: Engine, turns: list[str], max_tokens: int = 10, **kw: object) -> tuple[list, list]:
    """Run `turns` as one conversation, resending the history each time; (reply ids, messages)."""
    messages: list[tuple[str, str]] = []
    replies = []
    for text in turns:
        messages.append(("user", text))
        result = TurnResult()
        "".join(engine.run(TurnRequest(list(messages), max_tokens, **kw), result))
        messages.append(("assistant", result.content))
        replies.append(result.reply_ids)
    return replies, messages


# -- the contract ---------------------------------------------------------------------------------


def test_turns_equal_from_memory_disk_and_recomputed(model_and_tok: tuple, tmp_path: Path) -> None:
    model, tok = model_and_tok
    turns = TURNS[:6]
    memory = Engine(model, tok, KV, ConversationStore(1 << 30, tmp_path, model=model, kv_cache=KV))
    chat, messages = converse(memory, turns, temperature=0.0)
    assert memory.store.hits["memory"] == len(turns) - 1
    assert len(list(tmp_path.glob("*.safetensors"))) == len(turns)

    recomputed = Engine(
        model, tok, KV, ConversationStore(0, model=model, kv_cache=KV)
    )  # keeps nothing but the reply ids it generated
    assert converse(recomputed, turns, temperature=0.0)[0] == chat

    # a fresh store on the same directory (a restart): the last turn's state comes from disk
    disk = Engine(model, tok, KV, ConversationStore(1 << 30, tmp_path, model=model, kv_cache=KV))
    result = TurnResult()
    "".join(disk.run(TurnRequest(messages[:-1], 10, temperature=0.0), result))
    assert disk.store.hits == {"memory": 0, "disk": 1}
    assert result.reused_tokens > 0 and result.reply_ids == chat[-1]


def test_sampled_turn_same_from_store_and_recomputed(model_and_tok: tuple) -> None:
    model, tok = model_and_tok
    kw = {"temperature": 0.9, "top_p": 0.9, "seed": 7}
    stored, _ = converse(Engine(model, tok, KV, ConversationStore(1 << 30, model=model, kv_cache=KV)), TURNS[:4], **kw)
    recomputed, _ = converse(Engine(model, tok, KV, ConversationStore(0, model=model, kv_cache=KV)), TURNS[:4], **kw)
    assert stored == recomputed
    other, _ = converse(
        Engine(model, tok, KV, ConversationStore(1 << 30, model=model, kv_cache=KV)), TURNS[:4], temperature=0.9, seed=8
    )
    assert other != stored


def test_store_is_byte_bounded(model_and_tok: tuple) -> None:
    model, tok = model_and_tok
    engine = Engine(model, tok, KV, ConversationStore(1 << 30, model=model, kv_cache=KV))
    converse(engine, TURNS[:1])
    one = engine.store.nbytes
    bounded = Engine(model, tok, KV, ConversationStore(3 * one, model=model, kv_cache=KV))
    for i in range(5):
        converse(bounded, [f"{TURNS[i]} {i}"])
        assert bounded.store.nbytes <= 3 * one
    assert 2 <= len(bounded.store) < 5  # states differ in size (filled slots): the oldest went


def test_cancelled_turn_stores_nothing(model_and_tok: tuple) -> None:
    model, tok = model_and_tok
    engine = Engine(model, tok, KV, ConversationStore(1 << 30, model=model, kv_cache=KV), stop_at_newline=False)
    steps = iter(range(100))
    result = TurnResult()
    list(engine.run(TurnRequest([("user", TURNS[0])], 20), result, cancelled=lambda: next(steps) >= 3))
    assert 1 <= len(result.reply_ids) < 20 and result.finish_reason == "cancelled"
    assert not result.stored and len(engine.store) == 0


# -- the HTTP API, in process ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from fastapi.testclient import TestClient
    from litserve.utils import wrap_litserve_start

    from litkv.serve.api import ServeOptions, build_server

    dense = KVCacheConfig(policy="dense", cache_length=64, chunk_size=8)
    opts = ServeOptions(
        ckpt,
        dense,
        "tiny",
        api_key="sk-test",
        max_tokens=50,
        max_prompt_tokens=200,
        max_body_bytes=4096,
        num_threads=1,
        state_dir=tmp_path_factory.mktemp("states"),
    )
    server = build_server(opts, timeout=60)
    with wrap_litserve_start(server) as started, TestClient(started.app) as http:
        http.headers["Authorization"] = "Bearer sk-test"
        wait_healthy(lambda: http.get("/health").status_code)
        yield http


def chat_body(**kw: object) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": TURNS[0]}],
        "max_tokens": 8,
        "temperature": 0,
        **kw,
    }


@pytest.mark.slow
def test_api_models_health_and_completion(client) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    reply = client.post("/v1/chat/completions", json=chat_body())
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] >= 1 and body["usage"]["prompt_tokens"] > 0
    text = body["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["delta"]["content"] or "" for e in events[:-1])
    assert streamed == text
    # the second turn restores the first turn's state: only the new message is run
    messages = chat_body()["messages"] + [{"role": "assistant", "content": text}, {"role": "user", "content": "it"}]
    again = client.post("/v1/chat/completions", json=chat_body(messages=messages))
    assert again.status_code == 200, again.text


@pytest.mark.parametrize(
    ("kwargs", "status", "code"),
    [
        ({"model": "gpt-4"}, 404, "model_not_found"),
        ({"messages": []}, 400, "invalid_request_error"),
        ({"messages": None}, 400, "invalid_request_error"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_request_error"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "invalid_request_error"),
        ({"max_tokens": -1}, 400, "invalid_request_error"),
        ({"max_tokens": 10**9}, 400, "invalid_request_error"),
        ({"temperature": -1}, 400, "invalid_request_error"),
        ({"top_p": 0}, 400, "invalid_request_error"),
        ({"messages": [{"role": "user", "content": "the fox " * 60}]}, 400, "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "request_too_large"),
        ({"stream": True, "max_tokens": 0}, 400, "invalid_request_error"),
    ],
)
def test_api_errors_are_4xx_with_openai_body(client, kwargs: dict, status: int, code: str) -> None:
    reply = client.post("/v1/chat/completions", json=chat_body(**kwargs))
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["code"] == code


def test_api_documents_are_spliced_and_bounded(client) -> None:
    """`documents` (litkv's field): the last user message's documents as KV blocks; the server's limits
    (ServeOptions: 8 documents, 8192 tokens, and the cache) are one 400 naming the limit."""
    plain = client.post("/v1/chat/completions", json=chat_body()).json()["usage"]["prompt_tokens"]
    docs = ["The passkey is 12345. ", "the quick brown fox"]
    reply = client.post("/v1/chat/completions", json=chat_body(documents=docs))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] > plain + len(docs)
    for documents, code, expected in [
        (["a"] * 9, "invalid_request_error", "at most 8 per request, got 9"),
        ([""], "invalid_request_error", "documents[0] must be a non-empty string"),
        (["the fox " * 60], "context_length_exceeded", "do not fit the dense cache's 64 slots"),
    ]:
        bad = client.post("/v1/chat/completions", json=chat_body(documents=documents))
        assert bad.status_code == 400 and bad.json()["error"]["code"] == code, bad.text
        assert expected in bad.json()["error"]["message"]


def test_api_key_malformed_json_and_worker_alive(client) -> None:
    bad = client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    for scheme in ("bearer", "BEARER", "BeArEr"):  # RFC 7235: the scheme is case-insensitive (issue 50, item 6)
        ok = client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": f"{scheme}  sk-test"})
        assert ok.status_code == 200, (scheme, ok.text)
    for header in ({"Authorization": "Basic sk-test"}, {"Authorization": "bearer sk-tes"}, {"X-API-Key": "sk-tesT"}):
        assert client.post("/v1/chat/completions", json=chat_body(), headers=header).status_code == 401, header
    broken = client.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


# -- a real `litkv serve` process and the openai client -------------------------------------------


def server_args(ckpt: Path, state_dir: Path) -> list[str]:
    """`litkv serve`'s arguments for this module's server: h2o 32 slots (`KV`), replies not cut at newlines."""
    return [str(ckpt), "--kv-cache", "h2o", "--kv_cache.cache_length", "32", "--kv_cache.chunk_size", "8",
            "--state_dir", str(state_dir), "--stop_at_newline", "false", "--model_name", "tiny",
            "--api_key", KEY]  # fmt: skip


def openai_turns(client, turns: list[str], stream: bool, history: list | None = None) -> tuple[list[str], list]:
    messages = list(history or [])
    replies = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        kw = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0.8, "seed": 3}
        if stream:
            chunks = client.chat.completions.create(stream=True, **kw)
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            reply = client.chat.completions.create(**kw).choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies, messages


@pytest.mark.slow
def test_real_server_with_openai_client(ckpt: Path, model_and_tok: tuple, tmp_path: Path) -> None:
    import concurrent.futures

    import httpx
    import openai

    model, tok = model_and_tok
    solo = Engine(model, tok, KV, ConversationStore(0, model=model, kv_cache=KV), stop_at_newline=False)
    expected = converse(solo, TURNS, max_tokens=6, temperature=0.8, seed=3)[1]
    expected_text = [c for r, c in expected if r == "assistant"]
    log = tmp_path / "server.log"
    server = launch_server(server_args(ckpt, tmp_path / "states"), log)
    url = server.url
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", timeout=60, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in client.models.list()] == ["tiny"]
        # 10 turns, alternating streaming and not: the text of every turn is the in-process engine's
        first, history = openai_turns(client, TURNS[:5], stream=True)
        second, history = openai_turns(client, TURNS[5:10], stream=False, history=history)
        assert first + second == expected_text[:10]
        # 4 concurrent clients x 3 turns: each equals its solo run
        prompts = [[f"{t} {i}" for t in TURNS[i : i + 3]] for i in range(4)]
        solos = [[c for r, c in converse(solo, p, 6, temperature=0.8, seed=3)[1] if r == "assistant"] for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: openai_turns(client, p, stream=True)[0], prompts))
        assert together == solos
        # a client that goes away mid-stream: no state stored for that turn, the server goes on
        stored = len(list((tmp_path / "states").glob("*.safetensors")))
        body = {"model": "tiny", "messages": [{"role": "user", "content": "the fox"}], "max_tokens": 50, "stream": True}
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, timeout=30, headers={"Authorization": "Bearer sk-test"}
        ) as r:
            next(r.iter_lines())
        time.sleep(1.0)
        assert openai_turns(client, ["the dog"], stream=False)[0]
        assert len(list((tmp_path / "states").glob("*.safetensors"))) == stored + 1
    finally:
        assert server.stop() == 0
    # a restart on the same --state_dir: turn 11 restores turn 10's state from disk, same text as without
    server = launch_server(server_args(ckpt, tmp_path / "states"), log)
    url = server.url
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", timeout=60, max_retries=0)
        eleventh, _ = openai_turns(client, TURNS[10:11], stream=True, history=history)
        assert eleventh == expected_text[10:11]
        # SIGTERM while a reply streams: a new request gets 503 with Retry-After, the reply ends normally, then
        # the server exits with 0
        import signal

        body = {"model": "tiny", "messages": [{"role": "user", "content": "the dog"}], "max_tokens": 900}
        body["stream"] = True
        headers = {"Authorization": "Bearer sk-test"}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60, headers=headers) as r:
            lines = r.iter_lines()
            next(lines)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            refused = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, headers=headers)
            rest = [line for line in lines if line]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down", refused.text
        assert refused.headers.get("retry-after") == "5"
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["usage"]["completion_tokens"] > 100
        assert server.proc.wait(timeout=30) == 0
    finally:
        if server.proc.poll() is None:
            server.stop()
    text = log.read_text()
    assert text.count("SIGTERM: draining") == 2, text[-2000:]  # once per run: not once per LitServe process
    assert "leaked semaphore" not in text and "Traceback" not in text, text[-2000:]
    import re

    reused = [int(m) for m in re.findall(r"prompt tokens \((\d+) reused\)", text)]
    assert len(reused) == 10 + 12 + 1 + 1 + 1 + 1 and reused[-2] > 0  # after the restart, turn 10's state from disk
    assert text.count("stored=False") == 1  # the turn whose client went away
