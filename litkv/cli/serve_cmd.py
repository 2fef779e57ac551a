"""`litkv serve`: an OpenAI-compatible chat server (LitServe) that keeps each conversation's cache state."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

from litkv.checkpoints.checkpoint import check_checkpoint_dir
from litkv.checkpoints.runtime import resolve_device, resolve_dtype
from litkv.cli.common import resolve_checkpoint_dir
from litkv.core.validation import is_number, require_int
from litkv.inference.conversation import refuse_one_shot
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.quant_weights import parse_quantize

__all__ = ["serve"]

#: This command, read by litkv/__main__.py from the source (never imported for it): `CommandSpec`.
COMMAND = {"name": "serve", "function": "serve", "checkpoint_positional": True}

_DEFAULT_KV_CACHE = KVCacheConfig(policy="h2o", cache_length=256)  # never mutated
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(
    checkpoint_dir: Path | None = None,
    kv_cache: KVCacheConfig = _DEFAULT_KV_CACHE,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    state_bytes: int = 1 << 30,
    state_dir: Path | None = None,
    state_dir_bytes: int | None = None,
    max_batch: int = 8,
    max_step_tokens: int = 1,
    max_queue: int = 64,
    max_tokens: int = 1024,
    default_max_tokens: int = 128,
    max_prompt_tokens: int = 8192,
    max_body_bytes: int = 1 << 20,
    top_k: int | None = 50,
    stop_at_newline: bool | None = None,
    chat_template: bool | None = None,
    seed: int = 1234,
    precision: str | None = None,
    device: str | None = None,
    num_threads: int | None = None,
    timeout: float = 600.0,
    body_timeout: float = 30.0,
    quantize: str = "none",
    block_store_bytes: int = 1 << 30,
    block_dir: Path | None = None,
    recompute: float = 0.0,
    max_documents: int = 8,
    max_document_tokens: int = 8192,
) -> None:
    """Serve a checkpoint over the OpenAI chat API; each conversation's cache state is kept and reused.

    Endpoints: ``POST /v1/chat/completions`` (streaming or not; ``max_tokens``, ``temperature``, ``top_p``,
    ``seed``, ``stop``), ``GET /v1/models``, ``GET /health``. A request's messages are matched against
    the stored states at message boundaries and only the new messages are run (docs/serve.md).

    Args:
        checkpoint_dir: LitGPT-layout directory. Default: the model shipped with litkv.
        kv_cache: KV cache policy and budget, as for ``litkv generate`` (default h2o, 256 slots).
        host: Address to bind (default 127.0.0.1: this machine only).
        port: TCP port.
        api_key: When set, /v1 requests need ``Authorization: Bearer KEY`` (else 401).
        model_name: The model id of /v1/models and of requests. Default: the checkpoint directory's name.
        state_bytes: Bytes of conversation states kept in memory (least recently used go first).
        state_dir: Also write every state here (atomically) and read it back after eviction or a restart;
            an entry is used only if it proves its key, this model and this cache config.
        state_dir_bytes: Bytes of files kept in ``state_dir`` (least recently used deleted first).
            Default: ``state_bytes``.
        max_batch: Conversations decoded at once (rows of the running batch); more requests wait.
        max_step_tokens: Prompt tokens fed per step of the batch at most, in whole chunks of the cache
            config's chunking, at least one chunk (the default, 1: one chunk per step). Higher: prompts that
            arrive together are fed before the next decode step while they fit (their first tokens come
            sooner, but their replies then run in step and their next turns arrive together: docs/serve.md).
        max_queue: Requests that may wait for a row; beyond ``max_batch + max_queue`` in flight a request
            gets 503 (``server_overloaded``, ``Retry-After: 1``).
        max_tokens: Largest ``max_tokens`` a request may ask for.
        default_max_tokens: ``max_tokens`` of a request that gives none.
        max_prompt_tokens: Most tokens a request's messages may have.
        max_body_bytes: Largest request body.
        top_k: Sample among the k most likely tokens only (as ``litkv chat``).
        stop_at_newline: End a reply at its first newline (as ``litkv chat``). Default: true for raw
            text, false with a chat template (a reply then ends at the template's end-of-turn token).
        chat_template: Format conversations with the checkpoint's chat template: true, false (raw text,
            as ``litkv chat --chat_template false``), or unset: when the checkpoint has one.
        seed: Sampler seed of a request without ``seed``.
        precision: "32-true", "bf16-true", "16-true" or "64-true". Default: bf16 on CUDA, else 32.
        device: "cpu", "cuda", ... Default: CUDA if available.
        num_threads: CPU threads for torch. Default: torch's choice.
        timeout: Seconds a request may wait and run.
        body_timeout: Seconds a request's body may take to arrive (a slower one gets 408).
        quantize: Weight-only quantisation of the linear layers at load (CPU only): "none", "int8"
            (per output channel), "int4" (groups of 32 input columns) or "int4-gN" (N = 64, 128, 256).
        block_store_bytes: Bytes of documents' KV (a request's ``documents``, spliced as KV blocks) kept in
            memory, least recently used first out (docs/blocks.md).
        block_dir: Also keep the documents' KV here (read back after eviction or a restart).
        recompute: The fraction of each spliced document's tokens recomputed in context (0: pure splice).
        max_documents: Most ``documents`` of a request.
        max_document_tokens: Most tokens of a request's ``documents`` in all.
    """
    from litkv.serve.api import ServeOptions, build_server
    from litkv.serve.drain import drain_on_sigterm

    refuse_one_shot(kv_cache, "litkv serve")  # at start, in one line, not in the worker
    ckpt = check_checkpoint_dir(resolve_checkpoint_dir(checkpoint_dir))
    for name, value, low in (
        ("port", port, 0),
        ("state_bytes", state_bytes, 0),
        ("max_batch", max_batch, 1),
        ("max_step_tokens", max_step_tokens, 1),
        ("max_queue", max_queue, 0),
        ("max_tokens", max_tokens, 1),
        ("default_max_tokens", default_max_tokens, 1),
        ("max_prompt_tokens", max_prompt_tokens, 1),
        ("max_body_bytes", max_body_bytes, 1),
        ("block_store_bytes", block_store_bytes, 0),
        ("max_documents", max_documents, 0),
        ("max_document_tokens", max_document_tokens, 1),
    ):
        require_int(name, value, low)
    if state_dir_bytes is not None:
        require_int("state_dir_bytes", state_dir_bytes, 0)
    if isinstance(recompute, bool) or not is_number(recompute) or not 0.0 <= recompute <= 1.0:
        raise ValueError(f"--recompute must be a fraction in [0, 1] (0: pure splice), got {recompute!r}")
    if default_max_tokens > max_tokens:
        raise ValueError(f"default_max_tokens ({default_max_tokens}) must be <= max_tokens ({max_tokens})")
    _check_serving_options(host, api_key, top_k, timeout, body_timeout)
    require_int("--seed", seed, -(1 << 63), (1 << 64) - 1, note=" (64 bits)")
    dev = resolve_device(device)
    resolve_dtype(precision, dev)  # a bad --precision: one line now, not in the worker
    parse_quantize(quantize)  # refused here, before the server starts
    _check_chat_template(ckpt, chat_template)
    opts = ServeOptions(
        checkpoint_dir=ckpt, kv_cache=kv_cache, model_name=model_name or ckpt.name, device=str(dev),
        dtype=precision, state_bytes=state_bytes, state_dir=state_dir, state_dir_bytes=state_dir_bytes,
        max_batch=max_batch, max_step_tokens=max_step_tokens, max_queue=max_queue,
        max_tokens=max_tokens,
        default_max_tokens=default_max_tokens, max_prompt_tokens=max_prompt_tokens, max_body_bytes=max_body_bytes,
        body_timeout=body_timeout, top_k=top_k, stop_at_newline=stop_at_newline, chat_template=chat_template,
        seed=seed, api_key=api_key, num_threads=num_threads, quantize=quantize,
        block_store_bytes=block_store_bytes, block_dir=block_dir, recompute=float(recompute),
        max_documents=max_documents, max_document_tokens=max_document_tokens,
    )  # fmt: skip
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = build_server(opts, timeout=timeout)
    assert opts.cancel_dir is not None  # build_server made it
    drain_on_sigterm(server, opts.cancel_dir, limit_s=timeout)
    server.run(host=host, port=port, generate_client_file=False, num_api_servers=1)


def _check_serving_options(
    host: str, api_key: str | None, top_k: int | None, timeout: float, body_timeout: float
) -> None:
    """ValueError (one line) for an option that cannot work; a warning line on stderr for a server open to
    the network without an API key."""
    if top_k is not None:
        require_int("--top_k", top_k, 1, note=" (--top_k null samples from every token)")
    for name, value in (("timeout", timeout), ("body_timeout", body_timeout)):
        if not is_number(value) or not 0 < value < math.inf:
            raise ValueError(f"--{name} must be a number of seconds > 0, got {value!r}")
    if api_key is not None and not api_key.strip():
        raise ValueError("--api_key must not be empty (leave it out to serve without a key)")
    if api_key is None and host not in LOOPBACK:
        print(
            f"warning: --host {host} serves other machines without an API key: anyone who can reach it may "
            "use it (set --api_key)",
            file=sys.stderr,
        )


def _check_chat_template(ckpt: Path, chat_template: bool | None) -> None:
    """The checkpoint's chat template, checked at start (compiles; present when asked for)."""
    from litkv.checkpoints.checkpoint import load_tokenizer
    from litkv.inference.chat_template import load_format

    load_format(ckpt, load_tokenizer(ckpt), chat_template)
