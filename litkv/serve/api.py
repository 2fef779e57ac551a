"""The HTTP side of `litkv serve`: a LitServe `LitAPI` and an `OpenAISpec` that checks requests first.

The spec (in the API server process) refuses a bad request with a 4xx and an OpenAI-style error body
before it reaches the inference worker, so that a streaming request gets its error as a status, not in
the stream; the worker (`LitKVAPI`) runs the turn through the `Engine`. A client that goes
away, streaming or not, marks its request cancelled (a file in a directory both processes see); the
worker stops at the next decode step, frees the row and stores nothing for that turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import uuid
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import litserve as ls
from fastapi import BackgroundTasks, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from litserve.specs.openai import ChatCompletionRequest, OpenAISpec
from litserve.utils import LitAPIStatus
from pydantic import BeforeValidator, ConfigDict, StrictBool
from starlette.requests import Request

from litkv.kvcache.config import KVCacheConfig
from litkv.serve.drain import DrainStopper, drain_error, leave_process_group, until_stopped, worker_error
from litkv.serve.engine import (
    Engine,
    RequestError,
    TurnRequest,
    TurnResult,
    check_messages,
    count_prompt_tokens,
    document_ids,
)
from litkv.serve.fields import NO_OP, unsupported_field
from litkv.serve.guard import Guard, error_body
from litkv.serve.scheduler import Job
from litkv.serve.store import ConversationStore
from litkv.states.block_store import BlockStore

__all__ = ["LitKVAPI", "LitKVSpec", "ServeOptions", "build_server", "error_body"]

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    """Everything the server process and the inference worker need (plain values: it is pickled)."""

    checkpoint_dir: Path
    kv_cache: KVCacheConfig
    model_name: str
    device: str = "cpu"
    dtype: str | None = None
    quantize: str = "none"
    state_bytes: int = 1 << 30
    state_dir: Path | None = None
    state_dir_bytes: int | None = None
    max_batch: int = 8
    max_step_tokens: int = 1
    max_queue: int = 64
    max_tokens: int = 1024
    default_max_tokens: int = 128
    max_prompt_tokens: int = 8192
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0
    top_k: int | None = 50
    stop_at_newline: bool | None = None
    chat_template: bool | None = None
    seed: int = 1234
    api_key: str | None = None
    num_threads: int | None = None
    cancel_dir: Path | None = None
    log_level: str = "INFO"
    block_store_bytes: int = 1 << 30
    block_dir: Path | None = None
    recompute: float = 0.0
    max_documents: int = 8
    max_document_tokens: int = 8192


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not a boolean ({str(value).lower()})")  # noqa: TRY004 (pydantic's error)
    return value


Number = Annotated[float, BeforeValidator(_not_bool)]
Integer = Annotated[int, BeforeValidator(_not_bool)]
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


class ChatRequest(ChatCompletionRequest):
    """OpenAI's chat completion body, with the `seed` field LitServe's model leaves out; numbers are not
    booleans (nor booleans numbers), and unknown fields are kept so that they can be refused by name."""

    model_config = ConfigDict(extra="allow")

    seed: Integer | None = None
    max_tokens: Integer | None = None
    max_completion_tokens: Integer | None = None
    n: Integer | None = 1
    temperature: Number | None = 0.7
    top_p: Number | None = 1.0
    presence_penalty: Number | None = 0.0
    frequency_penalty: Number | None = 0.0
    stream: StrictBool | None = False
    tools: Any = None  # not implemented: any value but an empty one is refused by name (litkv.serve.fields)
    tool_choice: Any = None
    response_format: Any = None
    reasoning_effort: Any = None
    documents: list[str] | None = None  # litkv: texts spliced as KV blocks into the last user message


def _http_error(err: RequestError) -> HTTPException:
    return HTTPException(err.status, detail=error_body(str(err), err.code, err.param))


def _valid_unicode(text: str, where: str) -> str:
    """`text`, or RequestError for a lone surrogate (JSON's `\\ud800`: not a character, no token)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(
            f"{where} is not valid Unicode: a lone surrogate {text[err.start]!r} at character {err.start}",
            param=where.split("[")[0].split(".")[0],
        ) from None
    return text


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return _valid_unicode(content, f"messages[{index}].content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if getattr(part, "type", None) != "text":
                raise RequestError(f"messages[{index}].content: only text parts are supported", param="messages")
            parts.append(part.text)
        return _valid_unicode("".join(parts), f"messages[{index}].content")
    raise RequestError(f"messages[{index}].content must be a string", param="messages")


def parse_request(request: ChatCompletionRequest, opts: ServeOptions) -> TurnRequest:
    """The checked turn of a request; RequestError (a 4xx) for anything out of bounds or not implemented."""
    given = {name: getattr(request, name) for name in request.model_fields_set if name in NO_OP}
    field = unsupported_field({**given, **(request.model_extra or {})})
    if field is not None:
        raise RequestError(f"{field!r} is not supported by this server; leave it out", param=field)
    if request.model not in (None, "", opts.model_name):
        raise RequestError(
            f"model {request.model!r} does not exist; this server serves {opts.model_name!r}",
            status=404,
            code="model_not_found",
            param="model",
        )
    messages = [
        (m.role, "" if m.content is None and m.role == "assistant" else _message_text(m.content, i))
        for i, m in enumerate(request.messages)
    ]
    check_messages(messages)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    max_tokens = opts.default_max_tokens if max_tokens is None else max_tokens
    if not 1 <= max_tokens <= opts.max_tokens:
        raise RequestError(f"max_tokens must be in [1, {opts.max_tokens}], got {max_tokens}", param="max_tokens")
    temperature = 1.0 if request.temperature is None else request.temperature
    if not (math.isfinite(temperature) and 0 <= temperature <= 2):
        raise RequestError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
    top_p = request.top_p
    if top_p is not None and not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if request.n not in (None, 1):
        raise RequestError("n must be 1", param="n")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a non-empty string or a list of at most 4 of them", param="stop")
    stop = [_valid_unicode(s, "stop") for s in stop]
    documents = list(getattr(request, "documents", None) or [])
    if len(documents) > opts.max_documents:
        count = len(documents)
        raise RequestError(f"documents: at most {opts.max_documents} per request, got {count}", param="documents")
    documents = [_valid_unicode(d, f"documents[{k}]") for k, d in enumerate(documents)]
    seed = getattr(request, "seed", None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise RequestError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (64 bits), got {seed}", param="seed")
    return TurnRequest(
        messages,
        max_tokens,
        temperature,
        None if top_p == 1.0 else top_p,
        seed,
        stop,
        (request.metadata or {}).get("litkv_id", ""),
        documents,
    )


DISCONNECT_POLL_S = 0.05  # how often a non-streaming request looks whether its client is still there


class LitKVSpec(OpenAISpec):
    """OpenAISpec that checks a request (bounds, prompt tokens, cache room) before queueing it, serves
    `GET /v1/models`, and cancels a stream's turn when its client goes away."""

    def __init__(self, opts: ServeOptions) -> None:
        super().__init__()
        self.opts = opts
        self._format = None
        self._limit = opts.kv_cache.policy_class.max_tokens(opts.kv_cache)

    def pre_setup(self, lit_api: ls.LitAPI) -> None:
        super().pre_setup(lit_api)
        self.add_endpoint("/v1/models", self.list_models, ["GET"])

    async def list_models(self) -> dict[str, Any]:
        card = {"id": self.opts.model_name, "object": "model", "created": 0, "owned_by": "litkv"}
        return {"object": "list", "data": [card]}

    def _count_tokens(self, turn: TurnRequest) -> int:
        if self._format is None:
            from litkv.checkpoints.checkpoint import load_tokenizer
            from litkv.inference.chat_template import load_format

            tokenizer = load_tokenizer(self.opts.checkpoint_dir)
            self._format = load_format(self.opts.checkpoint_dir, tokenizer, self.opts.chat_template)
        opts = self.opts
        docs = document_ids(self._format.tokenizer, turn.documents, opts.max_documents, opts.max_document_tokens)
        return count_prompt_tokens(self._format, turn.messages, {len(turn.messages) - 1: docs} if docs else None)

    def check(self, request: ChatCompletionRequest) -> TurnRequest:
        turn = parse_request(request, self.opts)
        prompt = self._count_tokens(turn)
        if prompt > self.opts.max_prompt_tokens:
            raise RequestError(
                f"the messages have {prompt} tokens, more than this server's limit of {self.opts.max_prompt_tokens}",
                code="context_length_exceeded",
                param="messages",
            )
        if self._limit is not None and prompt + turn.max_tokens > self._limit:
            raise RequestError(
                f"the messages ({prompt} tokens) and max_tokens ({turn.max_tokens}) do not fit the "
                f"{self.opts.kv_cache.policy} cache's {self._limit} slots; use an evicting policy",
                code="context_length_exceeded",
                param="messages",
            )
        return turn

    async def chat_completion(self, request: ChatRequest, background_tasks: BackgroundTasks, http: Request) -> Any:
        try:
            self.check(request)
        except RequestError as err:
            raise _http_error(err) from None
        request.metadata = {**(request.metadata or {}), "litkv_id": uuid.uuid4().hex}
        if request.stream:  # a stream notices its client going away as it writes (streaming_completion)
            return await super().chat_completion(request, background_tasks)
        answer = asyncio.ensure_future(super().chat_completion(request, background_tasks))
        stopper = DrainStopper(self.opts.cancel_dir)
        while not answer.done():  # a non-streaming client that goes away cancels its turn at the next step
            await asyncio.wait({answer}, timeout=DISCONNECT_POLL_S)
            if not answer.done() and await http.is_disconnected():
                self._cancel(request.metadata["litkv_id"])
                break
            if not answer.done() and stopper.expired():  # the drain's limit: a 503, not a cut connection
                self._cancel(request.metadata["litkv_id"], "drain limit")
                answer.cancel()
                raise HTTPException(503, detail=drain_error(), headers={"Retry-After": "5"})
        return await answer

    def _cancel(self, turn_id: str, why: str = "client went away") -> None:
        """Mark turn `turn_id` cancelled: the worker stops it at its next decode step and frees its row."""
        if self.opts.cancel_dir is not None:
            (Path(self.opts.cancel_dir) / turn_id).touch()
            log.info("%s: turn %s cancelled", why, turn_id)

    async def non_streaming_completion(self, request: ChatCompletionRequest, generator_list: list) -> Any:
        reasons: dict[str, str] = {}
        response = await super().non_streaming_completion(request, [_finish_reason(g, reasons) for g in generator_list])
        for choice in response.choices:
            choice.finish_reason = reasons.get("finish_reason", "stop")
        return response

    async def streaming_completion(self, request: ChatCompletionRequest, pipe_responses: list) -> Any:
        """LitServe's stream, its last chunk's `finish_reason` corrected. A stream that cannot finish ends with an
        error event and `[DONE]`: one still running when the drain's limit passes (its turn cancelled), and
        one whose worker failed mid-reply (LitServe's own ending has no `[DONE]`)."""
        finished = False
        reasons: dict[str, Any] = {}
        pipes = [_finish_reason(p, reasons) for p in pipe_responses]
        chunks = super().streaming_completion(request, pipes)
        try:
            async for chunk in until_stopped(chunks, DrainStopper(self.opts.cancel_dir)):
                if chunk is None or "error" in reasons:  # LitServe's chunk after a worker's error is its own
                    if chunk is None:
                        self._cancel(request.metadata["litkv_id"], "drain limit (the stream ends with an error event)")
                    yield f"data: {json.dumps(drain_error() if chunk is None else reasons['error'])}\n\n"
                    yield "data: [DONE]\n\n"
                    break
                if reasons.get("finish_reason", "stop") != "stop":  # LitServe's last chunk says "stop"
                    chunk = chunk.replace('"finish_reason":"stop"', f'"finish_reason":"{reasons["finish_reason"]}"')
                yield chunk
            finished = True
        finally:
            if not finished:
                self._cancel(request.metadata["litkv_id"])


async def _finish_reason(pipe: Any, seen: dict[str, Any]) -> Any:
    """Pass a worker's outputs on, noting the `finish_reason` of the turn's last one in `seen` (and, when the
    worker failed, the error the stream ends with under "error")."""
    async for response, status in pipe:
        if status == LitAPIStatus.ERROR:
            seen["error"] = worker_error(response)
        elif isinstance(response, str) and '"finish_reason"' in response:
            seen["finish_reason"] = json.loads(response).get("finish_reason") or "stop"
        yield response, status


class LitKVAPI(ls.LitAPI):
    """The inference worker: one model, one `Engine` whose batch loop runs in its own thread; each request
    is an asyncio task (LitServe's `enable_async`) that submits its turn and relays its text."""

    def __init__(self, opts: ServeOptions) -> None:
        with warnings.catch_warnings():  # LitServe asyncifies the spec's encode_response itself
            warnings.filterwarnings("ignore", message="encode_response should be an async")
            super().__init__(spec=LitKVSpec(opts), max_batch_size=1, enable_async=True)
        self.opts = opts

    def setup(self, device: str) -> None:
        from litkv.checkpoints.checkpoint import load_tokenizer
        from litkv.checkpoints.runtime import load_for_inference
        from litkv.inference.chat_template import load_format

        leave_process_group()  # a SIGTERM to the server's group is the main process's to handle (a drain)
        _worker_logging(self.opts.log_level)
        opts = self.opts
        model, _ = load_for_inference(opts.checkpoint_dir, opts.dtype, opts.device, opts.num_threads, opts.quantize)
        store = ConversationStore(
            self.opts.state_bytes,
            self.opts.state_dir,
            model=model,
            kv_cache=self.opts.kv_cache,
            max_prompt_tokens=self.opts.max_prompt_tokens,
            disk_bytes=self.opts.state_dir_bytes,
        )
        tokenizer = load_tokenizer(self.opts.checkpoint_dir)
        self.engine = Engine(
            model,
            tokenizer,
            self.opts.kv_cache,
            store,
            self.opts.top_k,
            self.opts.stop_at_newline,
            self.opts.seed,
            load_format(self.opts.checkpoint_dir, tokenizer, self.opts.chat_template),
            max_batch=self.opts.max_batch,
            max_step_tokens=self.opts.max_step_tokens,
            blocks=BlockStore(opts.block_store_bytes, opts.block_dir),
            recompute=opts.recompute,
            max_documents=opts.max_documents,
            max_document_tokens=opts.max_document_tokens,
        )
        self.engine.scheduler.start()
        rows = self.engine.batch
        log.info("batch of %d rows: %.1f MiB of caches, allocated once", rows.rows, rows.batch.nbytes() / 2**20)

    async def decode_request(self, request: ChatCompletionRequest, **kwargs: Any) -> TurnRequest:
        try:
            return parse_request(request, self.opts)
        except RequestError as err:
            raise _http_error(err) from None

    def _cancelled(self, request_id: str) -> bool:
        return (
            self.opts.cancel_dir is not None and bool(request_id) and (Path(self.opts.cancel_dir) / request_id).exists()
        )

    async def predict(self, turn: TurnRequest, **kwargs: Any) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def emit(kind: str, value: Any) -> None:  # from the batch loop's thread
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

        result = TurnResult()
        job = Job(turn, result, lambda: self._cancelled(turn.request_id), emit)
        self.engine.scheduler.submit(job)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "text":
                    yield value
                elif kind == "error":
                    if isinstance(value, RequestError):
                        raise _http_error(value)
                    raise value
                else:
                    break
        finally:
            if self.opts.cancel_dir is not None and turn.request_id:
                (Path(self.opts.cancel_dir) / turn.request_id).unlink(missing_ok=True)
        log.info(
            "turn %s: %d prompt tokens (%d reused), %d document tokens restored, %d new, stored=%s",
            turn.request_id[:8],
            result.prompt_tokens,
            result.reused_tokens,
            result.block_tokens,
            result.generated,
            result.stored,
        )
        yield {
            "role": "assistant",
            "content": "",
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.generated,
            "total_tokens": result.prompt_tokens + result.generated,
            "finish_reason": result.finish_reason,
        }


def _worker_logging(level: str) -> None:
    """The inference worker is a spawned process: give litkv's loggers a handler there, and tqdm (the prefill's
    progress bar, off when serving) a thread lock: its default, a multiprocessing lock made at the first bar,
    is a named semaphore that LitServe's shutdown leaves behind ("leaked semaphore" warning after SIGTERM)."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    root = logging.getLogger("litkv")
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        root.addHandler(handler)
        root.propagate = False  # LitServe's own handlers would print each line twice


async def _http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    detail = exc.detail if isinstance(exc.detail, dict) and "error" in exc.detail else error_body(str(exc.detail))
    return JSONResponse(detail, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"invalid request: {where + ': ' if where else ''}{first.get('msg', 'malformed body')}"
    if any(e.get("type") == "json_invalid" for e in errors):
        message = "the request body is not valid JSON"
    return JSONResponse(error_body(message, param=where or None), status_code=400)


def build_server(opts: ServeOptions, timeout: float = 600.0) -> ls.LitServer:
    """The LitServer for `opts` (not started)."""
    if opts.cancel_dir is None:
        import tempfile

        opts.cancel_dir = Path(tempfile.mkdtemp(prefix="litkv-serve-cancel-"))
    os.makedirs(opts.cancel_dir, exist_ok=True)
    accelerator = "cuda" if str(opts.device).startswith("cuda") else "cpu"
    server = ls.LitServer(
        LitKVAPI(opts),
        accelerator=accelerator,
        devices=1,
        workers_per_device=1,
        timeout=timeout,
        middlewares=[
            (
                Guard,
                {
                    "api_key": opts.api_key,
                    "max_body_bytes": opts.max_body_bytes,
                    "run_dir": opts.cancel_dir,
                    "body_timeout": opts.body_timeout,
                    "max_inflight": opts.max_batch + opts.max_queue,
                },
            )
        ],  # fmt: skip
    )
    server.app.add_exception_handler(HTTPException, _http_exception)
    server.app.add_exception_handler(RequestValidationError, _validation_error)
    return server
