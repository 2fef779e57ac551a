"""A chat reply runs `generate`'s decode loop (issue 43 item 3: one decode loop, which chat's reply reuses).

Reference: `litkv.generate` on the conversation's token ids (the prompt the chat fed) with the same cache
config and the same `Sampling` (the format's stop tokens added): greedy and seeded sampling (a sampled reply
diverges at once if the two loops drew, fed or stopped differently), a dense and an evicting cache, a reply
that ends at a stop token and one that runs to `max_new_tokens`. A reply the caller stops early leaves
exactly the tokens it yielded in the caches and the model's input checks back on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_checkpoint import TEXT

from litkv import GPT, KVCacheConfig, Sampling, generate
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.inference.chat_template import RawFormat
from litkv.inference.conversation import Conversation

CACHES = {
    "dense": KVCacheConfig("dense", cache_length=160, chunk_size=16),
    "h2o": KVCacheConfig("h2o", cache_length=40, chunk_size=16),
}
SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 1.3, "top_k": 40, "top_p": 0.95}}
MESSAGE = [("user", TEXT[:240])]


@pytest.fixture(scope="module")
def loaded(tiny_ckpt: Path) -> tuple[GPT, object]:
    return load_model(tiny_ckpt), load_tokenizer(tiny_ckpt)


def _chat_reply(model: GPT, tok: object, cfg: KVCacheConfig, sampling: Sampling, n: int) -> tuple[Conversation, list]:
    conv = Conversation(model, RawFormat(tok), cfg)
    hidden = conv.feed(conv.prepare(MESSAGE, [None]), MESSAGE, [None])
    return conv, list(conv.reply(hidden, n, sampling))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("stops", [(), (177, 185)], ids=["format-stops", "more-stops"])  # 177: reached by step 5
def test_a_chat_reply_equals_generate_on_the_same_ids(loaded: tuple, cache: str, sampling: str, stops: tuple) -> None:
    model, tok = loaded
    cfg, options = CACHES[cache], SAMPLINGS[sampling]
    conv, reply = _chat_reply(model, tok, cfg, Sampling(**options, stop_tokens=stops, seed=7), 24)
    prompt = conv.history  # what the caches held before the reply
    assert conv.next_pos == len(prompt) + len(reply)  # every token of the reply is in the caches
    assert conv.end_reply("") == reply and conv.history == prompt + reply
    every_stop = sorted({*stops, *conv.format.stop_ids})
    (ref,) = generate(model, [torch.tensor(prompt)], 24, cfg, Sampling(**options, stop_tokens=every_stop, seed=7))
    assert reply == ref.tolist()
    if stops:  # the extra stop tokens end the reply early (else it runs to max_new_tokens)
        assert len(reply) < 24 and reply[-1] in stops
    else:
        assert len(reply) == 24


def test_a_reply_stopped_early_holds_what_it_yielded(loaded: tuple) -> None:
    model, tok = loaded
    conv = Conversation(model, RawFormat(tok), CACHES["h2o"])
    hidden = conv.feed(conv.prepare(MESSAGE, [None]), MESSAGE, [None])
    start = conv.next_pos
    tokens = conv.reply(hidden, 24, Sampling(temperature=1.0, seed=3))
    got = [next(tokens) for _ in range(3)]
    tokens.close()  # the caller stops (a newline, Ctrl-C): the loop's trusted inputs end with it
    assert conv.next_pos == start + 3 and conv.end_reply("x") == got
    with pytest.raises(ValueError, match="outside the vocabulary"):  # the model checks its inputs again
        model(torch.tensor([[10**6]]), torch.tensor([[conv.next_pos]]))


def test_a_reply_without_room_in_a_lossless_cache_is_refused_before_a_step(loaded: tuple) -> None:
    model, tok = loaded
    conv = Conversation(model, RawFormat(tok), KVCacheConfig("dense", cache_length=100, chunk_size=16))
    hidden = conv.feed(conv.prepare(MESSAGE, [None]), MESSAGE, [None])
    start = conv.next_pos
    with pytest.raises(ValueError, match="cache is full"):
        next(conv.reply(hidden, 100 - start + 1, Sampling()))
    assert conv.next_pos == start
    assert len(list(conv.reply(hidden, 100 - start, Sampling()))) <= 100 - start
