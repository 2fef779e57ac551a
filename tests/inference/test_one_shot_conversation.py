"""One-shot policies in a conversation (issue 61 item 4): `litkv chat` and `litkv serve` refuse a cache in
mode one-shot in one line naming the mode and the policy, since its compression runs once at the end of
one prompt; before, chat ran such a cache dense (h2o or kvzip one-shot with budget 1 gave dense's exact
reply) and serve took the options at start. Continuous caches still converse."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.inference.chat_template import RawFormat
from litkv.inference.conversation import Conversation
from litkv.modeling.config import KVCacheConfig
from litkv.serve import ConversationStore, Engine

ONE_SHOT = {
    "h2o": KVCacheConfig("h2o", cache_length=256, chunk_size=16, options={"mode": "one-shot", "budget": 1}),
}  # kvzip (one-shot only) gets its own one-line refusal: tests/inference/test_kvzip_everywhere.py
WORDS = ("does not apply --kv_cache.mode one-shot", "stay dense")


@pytest.fixture(scope="module")
def model_and_tok(ckpt: Path) -> tuple:
    return load_model(ckpt), load_tokenizer(ckpt)


@pytest.mark.parametrize("policy", sorted(ONE_SHOT))
def test_chat_refuses_a_one_shot_cache(model_and_tok: tuple, policy: str) -> None:
    model, tok = model_and_tok
    with pytest.raises(ValueError, match=f"litkv chat .* \\(policy '{policy}'\\)") as err:
        Conversation(model, RawFormat(tok), ONE_SHOT[policy])
    assert all(w in str(err.value) for w in WORDS) and "\n" not in str(err.value)
    continuous = KVCacheConfig("h2o", cache_length=64, chunk_size=16)
    assert Conversation(model, RawFormat(tok), continuous).kv_cache == continuous


@pytest.mark.parametrize("policy", sorted(ONE_SHOT))
def test_serve_engine_refuses_a_one_shot_cache(model_and_tok: tuple, policy: str) -> None:
    model, tok = model_and_tok
    store = ConversationStore(1 << 20, model=model, kv_cache=ONE_SHOT[policy])
    with pytest.raises(ValueError, match=f"litkv serve .* \\(policy '{policy}'\\)"):
        Engine(model, tok, ONE_SHOT[policy], store)


def test_cli_chat_and_serve_refuse_at_start(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands answer one line and start nothing (serve: no server built, no port taken)."""
    args = ["--checkpoint_dir", str(ckpt), "--kv_cache", "h2o", "--kv_cache.cache_length", "256",
            "--kv_cache.mode", "one-shot", "--kv_cache.budget", "1"]  # fmt: skip
    for command in ("chat", "serve"):
        monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
        with pytest.raises(SystemExit) as exit_:
            main([command, *args])
        assert exit_.value.code not in (0, None)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"litkv {command} does not apply --kv_cache.mode one-shot" in err[0], err
