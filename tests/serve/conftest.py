"""`shared_server`: one real `litkv serve` process for the tests that only need a running server (tests that
SIGTERM, kill or restart a server launch their own with `servers.launch_server`); `real_smollm2`: the real
model, its tokenizer and chat template, loaded once for the tests that run it in process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import Server, launch_server, shared_server_args
from tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`litkv serve` on the tiny checkpoint with `servers.shared_server_args`; its log grows with every test (read
    it from an offset taken before the requests you look for). A SIGTERM at the end: exit status 0."""
    root = tmp_path_factory.mktemp("shared_server")
    make_tiny_checkpoint(root / "ckpt")
    args = shared_server_args(root / "ckpt", root / "states")
    server = launch_server(args, root / "server.log")
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log_text()[-2000:]


def real_checkpoint() -> Path | None:
    """SmolLM2-135M-Instruct's converted checkpoint in the cache, None when it is not there."""
    from litkv.checkpoints.download import cache_dir

    path = cache_dir("smollm2-135m-instruct")
    return path if (path / "model.safetensors").is_file() else None


@pytest.fixture(scope="session")
def real_smollm2() -> tuple[Path, Any, Any, Any]:
    """(checkpoint, model float32, tokenizer, chat format) of SmolLM2-135M-Instruct; skips without it. The model
    is shared: tests read it and build their own engines and caches around it."""
    from litkv.checkpoints.checkpoint import load_model, load_tokenizer
    from litkv.inference.chat_template import load_format

    ckpt = real_checkpoint()
    if ckpt is None:
        pytest.skip("run `litkv download smollm2-135m-instruct`")
    tok = load_tokenizer(ckpt)
    return ckpt, load_model(ckpt), tok, load_format(ckpt, tok, None)
