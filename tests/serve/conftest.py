"""`shared_server`: one real `litkv serve` process for the tests that only need a running server (tests that
SIGTERM, kill or restart a server launch their own with `servers.launch_server`)."""

from __future__ import annotations

from collections.abc import Iterator

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
