"""`stop_litserve`: the drain wakes LitServe's main thread, and a later poll of the shutdown event (LitServe's
worker-monitoring thread) answers without the manager process that LitServe shuts down next."""

from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace

import pytest

from litkv.serve.drain import stop_litserve


def test_a_poll_after_the_manager_is_gone_still_says_set() -> None:
    manager = mp.Manager()
    event = manager.Event()
    server = SimpleNamespace(_shutdown_event=event)
    stop_litserve(server)
    assert event.is_set()  # LitServe's main thread, waiting on the event itself, wakes
    manager.shutdown()
    with pytest.raises((ConnectionError, EOFError, BrokenPipeError)):
        event.is_set()  # what the monitoring thread's poll hit before
    assert server._shutdown_event.is_set()  # what it now asks: no manager needed
    stop_litserve(server)  # twice: nothing more to do


def test_no_event_yet_is_left_alone() -> None:
    server = SimpleNamespace(_shutdown_event=None)
    stop_litserve(server)
    assert server._shutdown_event is None
