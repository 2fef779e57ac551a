"""A system prompt shared by conversations is prefilled once (`litkv serve`, issue 49 item 3).

The planning (`litkv.inference.conversation.plan_segments`) ends a segment at the end of the leading system
messages when that is a clean token boundary; the server stores the row's state there and restores it for
another conversation with the same system messages. References: a fresh server with an empty store
(`ConversationStore(0)`: everything recomputed) must give bitwise the same prompt hidden states and reply,
and `litkv chat`'s `Conversation` the same tokens for the same messages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.inference.chat_template import ChatTemplate, Format, RawFormat, TemplateFormat
from litkv.inference.conversation import Conversation, held_segments, plan_segments
from litkv.inference.sampling import Sampling
from litkv.kvcache.config import KVCacheConfig
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult

CHATML = (  # a ChatML template with a default system prompt (as SmolLM2-135M-Instruct's)
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FOLDED = (  # a template that writes the system prompt inside the first user turn: no boundary after it
    "{% for message in messages %}{% if message['role'] == 'user' %}<|im_start|>user\n"
    "{% if loop.index0 == 1 and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM = "You are a terse assistant. The passkey is 12345; never tell it. Answer in the words of the fox and the dog."
USERS = ["the quick brown fox", "in the beginning was the word", "what is the passkey"]
DENSE = KVCacheConfig(policy="dense", cache_length=256, chunk_size=8, prefill_length=16)
H2O = KVCacheConfig(policy="h2o", cache_length=40, chunk_size=8)  # evicts during the system prompt's prefill


@pytest.fixture(scope="module")
def parts(ckpt: Path) -> tuple:
    return load_model(ckpt), load_tokenizer(ckpt)


def make_format(tok: object, name: str, ckpt: Path) -> Format:
    if name == "raw":
        return RawFormat(tok)  # type: ignore[arg-type]
    source = CHATML if name == "chatml" else FOLDED
    return TemplateFormat(ChatTemplate(source, ckpt / "tokenizer_config.json"), tok)  # type: ignore[arg-type]


def make_engine(parts: tuple, fmt: Format, kv: KVCacheConfig, state_bytes: int = 1 << 30) -> Engine:
    model, tok = parts
    store = ConversationStore(state_bytes, model=model, kv_cache=kv)
    return Engine(model, tok, kv, store, fmt=fmt, stop_at_newline=False, max_batch=2)


def record_hidden(engine: Engine) -> list[torch.Tensor]:
    """The last prompt token's hidden state of each turn (what its first token is sampled from; a copy)."""
    seen: list[torch.Tensor] = []
    logits = engine.batch.logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.reshape(-1).clone())
        return logits(hidden)

    engine.batch.logits = record  # type: ignore[method-assign]
    return seen


def turn(engine: Engine, messages: list, n: int = 6) -> TurnResult:
    result = TurnResult()
    "".join(engine.run(TurnRequest(list(messages), n, temperature=0.8, seed=7), result))
    return result


def system_tokens(fmt: Format) -> int:
    return sum(len(s.ids) for s in held_segments(fmt, [("system", SYSTEM)], [None]))


@pytest.mark.parametrize("name", ["raw", "chatml"])
def test_the_plan_ends_a_segment_after_the_system_prompt_with_the_same_ids(parts: tuple, ckpt: Path, name: str) -> None:
    fmt = make_format(parts[1], name, ckpt)
    messages = [("system", SYSTEM), ("user", USERS[0]), ("assistant", "a fox"), ("user", USERS[1])]
    replies = [None, None, None, None]
    whole = fmt.segments(messages, replies, True, True)
    planned = plan_segments(fmt, messages, replies)
    assert [t for s in planned for t in s.ids] == [t for s in whole for t in s.ids]
    alone = [t for s in fmt.segments(messages[:1], [None], True, False) for t in s.ids]
    assert list(planned[0].ids) == alone and len(planned) == len(whole) + (name == "chatml")


def test_a_template_that_folds_the_system_prompt_into_the_user_turn_is_not_split(parts: tuple, ckpt: Path) -> None:
    fmt = make_format(parts[1], "folded", ckpt)
    messages = [("system", SYSTEM), ("user", USERS[0])]
    assert plan_segments(fmt, messages, [None, None]) == fmt.segments(messages, [None, None], True, True)
    engine = make_engine(parts, fmt, DENSE)
    turn(engine, messages)
    second = turn(engine, [("system", SYSTEM), ("user", USERS[1])])
    assert second.reused_tokens == 0 and len(engine.store) == 2  # the two replies' states only


@pytest.mark.parametrize("kv", [DENSE, H2O], ids=["dense", "h2o"])
@pytest.mark.parametrize("name", ["raw", "chatml"])
def test_conversations_sharing_a_system_prompt_reuse_it_and_equal_a_fresh_server(
    parts: tuple, ckpt: Path, name: str, kv: KVCacheConfig
) -> None:
    fmt = make_format(parts[1], name, ckpt)
    shared = make_engine(parts, fmt, kv)
    seen = record_hidden(shared)
    n_system = system_tokens(fmt)
    for i, user in enumerate(USERS):
        messages = [("system", SYSTEM), ("user", user)]
        result = turn(shared, messages)
        fresh = make_engine(parts, fmt, kv, state_bytes=0)
        fresh_seen = record_hidden(fresh)
        expected = turn(fresh, messages)
        assert result.reused_tokens == (0 if i == 0 else n_system) and expected.reused_tokens == 0
        assert result.reply_ids == expected.reply_ids and torch.equal(seen[-1], fresh_seen[-1])
        # the next turn restores at the reply (the longer prefix); the fresh server (its reply ids noted, no
        # state kept) recomputes it all
        later = [*messages, ("assistant", result.content), ("user", USERS[(i + 1) % len(USERS)])]
        again, recomputed = turn(shared, later), turn(fresh, later)
        assert again.reused_tokens == result.prompt_tokens + len(result.reply_ids) and recomputed.reused_tokens == 0
        assert again.reply_ids == recomputed.reply_ids and torch.equal(seen[-1], fresh_seen[-1])
    assert shared.store.hits["memory"] >= 2 * len(USERS) - 1


@pytest.mark.parametrize("name", ["raw", "chatml"])
def test_chat_and_serve_give_the_same_tokens_with_a_system_prompt(parts: tuple, ckpt: Path, name: str) -> None:
    model, tok = parts
    fmt = make_format(tok, name, ckpt)
    engine = make_engine(parts, fmt, DENSE)
    turn(engine, [("system", SYSTEM), ("user", USERS[0])])  # the system prompt's state is now stored
    messages = [("system", SYSTEM), ("user", USERS[1])]
    result = TurnResult()
    "".join(engine.run(TurnRequest(list(messages), 8), result))  # greedy
    assert result.reused_tokens == system_tokens(fmt)
    conv = Conversation(model, fmt, DENSE)
    hidden = conv.feed(conv.prepare(messages, [None, None]), messages, [None, None])
    ids = []
    for token in conv.reply(hidden, 8, Sampling()):
        if token in fmt.stop_ids:
            break
        ids.append(token)
    assert ids == result.reply_ids and conv.fed[0] == plan_segments(fmt, messages, [None, None])[0]
