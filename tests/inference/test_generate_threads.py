"""Two `litkv.generate` calls on one model at once (issue 61 item 8): the second is refused with an error
that names the model as busy, from another thread or from the first's own `on_tokens`; the first's tokens
are those of the same call alone, and the model takes a next generate once the first has returned."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import random_tokens, tiny_gpt

from litkv import GPT, KVCacheConfig, generate

KV = KVCacheConfig("h2o", cache_length=24, chunk_size=8)
PROMPT = random_tokens(1, 20, seed=3)[0]


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_gpt(7, config="SmolLM2-135M")


def test_second_thread_is_refused_naming_the_model(model: GPT) -> None:
    alone = generate(model, [PROMPT], 6, KV)[0]
    started, tried = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold(_: torch.Tensor) -> None:  # the first generate waits inside its decode loop for the second's try
        started.set()
        assert tried.wait(30)

    def second() -> None:
        assert started.wait(30)
        try:
            generate(model, [PROMPT], 3, KV)
        except RuntimeError as e:
            errors.append(e)
        finally:
            tried.set()

    thread = threading.Thread(target=second)
    thread.start()
    first = generate(model, [PROMPT], 6, KV, on_tokens=hold)[0]
    thread.join(30)
    assert len(errors) == 1
    message = str(errors[0])
    assert "busy" in message and repr(model.config.name) in message
    assert torch.equal(first, alone)  # the refused call touched nothing of the running one
    assert torch.equal(generate(model, [PROMPT], 6, KV)[0], alone)  # free again


def test_reentry_from_on_tokens_is_refused(model: GPT) -> None:
    def again(_: torch.Tensor) -> None:
        generate(model, [PROMPT], 2, KV)

    with pytest.raises(RuntimeError, match="busy"):
        generate(model, [PROMPT], 4, KV, on_tokens=again)
    assert generate(model, [PROMPT], 4, KV)[0].numel() == 4  # the error left the model free


def test_two_models_run_at_once() -> None:
    a, b = tiny_gpt(7, config="SmolLM2-135M"), tiny_gpt(7, config="SmolLM2-135M")
    alone = generate(a, [PROMPT], 5, KV)[0]
    out: dict[str, torch.Tensor] = {}
    threads = [
        threading.Thread(target=lambda m=m, k=k: out.__setitem__(k, generate(m, [PROMPT], 5, KV)[0]))
        for k, m in (("a", a), ("b", b))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(out["a"], alone) and torch.equal(out["b"], alone)
