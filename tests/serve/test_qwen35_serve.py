"""A Gated DeltaNet hybrid in `litkv serve`'s engine and `litkv chat`'s conversation: the server stores the
state after each turn at the turn's end (no block granularity), so turn k+1 feeds only its new tokens
(counted at the model: every real token of every call), a restarted server resumes from its state directory
the same way, and the replies equal those of a server that keeps nothing and recomputes each conversation;
chat keeps its caches between turns and feeds only the new tokens too, and its /undo is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qwen35_helpers import random_hf_qwen35, tiny_qwen35_config
from tiny_checkpoint import train_tiny_tokenizer

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.checkpoints.convert import convert_hf_checkpoint
from litkv.inference.chat_template import RawFormat
from litkv.inference.conversation import Conversation
from litkv.inference.sampling import Sampling
from litkv.kvcache.config import KVCacheConfig
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult
from litkv.states.undo import truncate

KV = KVCacheConfig(policy="h2o", cache_length=32, chunk_size=8)
TURNS = ["The quick brown fox", "What is the passkey?", "Remember it.", "the lazy dog"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A converted Qwen3.5-shaped checkpoint (tiny tokenizer), loaded, with a counter of the real tokens fed."""
    tmp = tmp_path_factory.mktemp("qwen35-serve")
    config = tiny_qwen35_config()
    config.vocab_size = 384  # the tiny tokenizer's ids fit
    random_hf_qwen35(config, seed=1).save_pretrained(tmp / "hf")
    out = convert_hf_checkpoint(tmp / "hf", tmp / "ckpt")
    train_tiny_tokenizer(out)
    model, tok = load_model(out), load_tokenizer(out)
    fed: list[int] = []
    forward = model.forward

    def counting(idx: torch.Tensor, input_pos: torch.Tensor | None = None, *args: object, **kw: object) -> torch.Tensor:
        fed.append(idx.numel() if input_pos is None else int((input_pos >= 0).sum()))
        return forward(idx, input_pos, *args, **kw)

    model.forward = counting  # type: ignore[method-assign]
    return model, tok, fed


def _turn(engine: Engine, messages: list, fed: list[int]) -> tuple[TurnResult, int]:
    fed.clear()
    result = TurnResult()
    "".join(engine.run(TurnRequest(list(messages), 6, temperature=0.0), result))
    return result, sum(fed)


def test_each_turn_feeds_only_its_new_tokens_and_a_restart_resumes(served: tuple, tmp_path: Path) -> None:
    model, tok, fed = served
    engine = Engine(model, tok, KV, ConversationStore(1 << 30, tmp_path, model=model, kv_cache=KV))
    messages: list[tuple[str, str]] = []
    replies, held = [], 0
    for text in TURNS:
        messages.append(("user", text))
        result, tokens = _turn(engine, messages, fed)
        assert result.reused_tokens == held  # the whole conversation so far, restored at its exact end
        assert tokens == result.prompt_tokens - held + len(result.reply_ids)  # the delta, then the reply
        held = result.prompt_tokens + len(result.reply_ids)
        messages.append(("assistant", result.content))
        replies.append(result.reply_ids)
    assert engine.store.hits["memory"] == len(TURNS) - 1

    restarted = Engine(model, tok, KV, ConversationStore(1 << 30, tmp_path, model=model, kv_cache=KV))
    result, tokens = _turn(restarted, messages[:-1], fed)
    assert restarted.store.hits == {"memory": 0, "disk": 1}
    assert result.reply_ids == replies[-1]
    assert tokens == result.prompt_tokens - result.reused_tokens + len(result.reply_ids) < result.prompt_tokens

    recomputed = Engine(model, tok, KV, ConversationStore(0, model=model, kv_cache=KV))
    for k in range(len(TURNS)):
        result, _ = _turn(recomputed, messages[: 2 * k + 1], fed)
        assert result.reply_ids == replies[k]


def test_chat_conversation_feeds_only_each_turns_new_tokens_and_undo_is_exact(served: tuple) -> None:
    """`litkv chat`'s conversation engine on a Gated DeltaNet hybrid: turn k+1 runs only its new tokens (the
    caches, recurrent states included, stay attached between turns); undoing the last turn and replaying it
    gives its reply again (the undo log restores the recurrent states at the turn's start)."""
    model, tok, fed = served
    conv = Conversation(model, RawFormat(tok), KV, undo_depth=64)
    greedy = Sampling()
    messages: list[tuple[str, str]] = []
    replies = []
    for text in TURNS[:3]:
        messages.append(("user", text))
        pending = conv.prepare(messages, [*conv.replies, None])
        fed.clear()
        hidden = conv.feed(pending, messages, [*conv.replies, None])
        ids = list(conv.reply(hidden, 5, greedy))
        assert not pending.restart and sum(fed) == pending.num_tokens + len(ids)
        conv.end_reply(tok.decode(torch.tensor(ids)))
        messages = list(conv.messages)
        replies.append(ids)
    truncate(model, conv.turn_sizes()[-1])  # chat's /undo: the caches back, then the turn forgotten
    conv.drop_last_turn()
    messages = list(conv.messages)
    messages.append(("user", TURNS[2]))
    pending = conv.prepare(messages, [*conv.replies, None])
    hidden = conv.feed(pending, messages, [*conv.replies, None])
    assert list(conv.reply(hidden, 5, greedy)) == replies[-1]
