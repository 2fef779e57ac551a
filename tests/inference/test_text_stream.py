"""`TextStream` (litkv/inference/text_stream.py) against a brute-force reference: the tokenizer's decode of
the whole token list at every prefix, cut at the first stop string found by trying every position.

Tokenizers: the tiny checkpoint's byte-level BPE (multi-byte characters are split over byte tokens), a
SentencePiece-style Metaspace BPE (a decode drops the first token's leading space, so a decode of the new
tokens alone would be wrong), and the real SmolLM2 tokenizer when its checkpoint is here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_checkpoint import TEXT, train_tiny_tokenizer

from litkv.inference.text_stream import TextStream

UNICODE = "naïve café, Grüße: 世界 und 🙂🙃! And it came to pass, when the <|user|> said: done.\nSecond line."


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory: pytest.TempPathFactory):
    from litgpt.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("bpe")
    train_tiny_tokenizer(path)
    return Tokenizer(path)


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory: pytest.TempPathFactory):
    """A Llama-style tokenizer: Metaspace pre-tokenizer and decoder (the first token's `▁` is dropped)."""
    from litgpt.tokenizer import Tokenizer
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("metaspace")
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator([TEXT, " ".join(sorted(set(UNICODE)))], trainer=trainer)  # UNICODE's characters known
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "add_bos_token": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(path)


def _real_tokenizer():
    from litkv.checkpoints.known import known_checkpoint_dir

    try:
        path = known_checkpoint_dir("smollm2-135m-instruct")
    except (KeyError, ValueError, FileNotFoundError):
        return None
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        return None
    from litgpt.tokenizer import Tokenizer

    return Tokenizer(path)


def decode(tok, ids: list[int]) -> str:
    return tok.decode(torch.tensor(ids, dtype=torch.long)) if ids else ""


def reference_sent(text: str, stops: list[str], newline: bool, final: bool) -> tuple[str, bool]:
    """What may be sent of a decode `text`, found by brute force: cut before the first position where a stop
    string starts (after the first newline); else, unless `final`, stop before the first position from which
    the rest is the start of a stop string. Returns (text, stopped)."""
    stops = [s for s in stops if s]
    for i in range(len(text)):
        if any(text.startswith(s, i) for s in stops):
            return text[:i], True
        if newline and text[i] == "\n":
            return text[: i + 1], True
    if final:
        return text, False
    for i in range(len(text)):
        if any(s.startswith(text[i:]) for s in stops):
            return text[:i], False
    return text, False


def check_against_reference(tok, ids: list[int], stops: list[str] = (), newline: bool = False) -> str:
    """Feed `ids` one by one; at every prefix the text sent equals the reference's; the final flush too."""
    stream = TextStream(tok, stops, newline)
    sent, last_whole = "", ""
    for n in range(1, len(ids) + 1):
        sent += stream.add(ids[n - 1])
        whole = decode(tok, ids[:n])
        if not whole.endswith("\ufffd"):
            expected, stopped = reference_sent(whole, list(stops), newline, final=False)
            last_whole = expected
        else:  # an incomplete character: nothing more than at the step before
            expected, stopped = last_whole, stream.stopped
        assert sent == expected, (n, sent, expected)
        assert stream.stopped == stopped
        if stopped:
            break
    sent += stream.finish()
    expected, _ = reference_sent(decode(tok, ids[: len(stream.ids)]), list(stops), newline, final=True)
    assert sent == expected == stream.content == stream.sent_text
    return sent


def test_no_partial_character_and_exact_text(byte_bpe, metaspace) -> None:
    """Multi-byte characters split over tokens wait for their last byte; the text is the whole decode's."""
    ids = byte_bpe.encode(UNICODE).tolist()
    partial = [n for n in range(1, len(ids)) if decode(byte_bpe, ids[:n]).endswith("\ufffd")]
    assert len(partial) >= 8, "the test needs characters split over tokens"
    assert check_against_reference(byte_bpe, ids) == decode(byte_bpe, ids) == UNICODE
    ids = metaspace.encode(UNICODE).tolist()
    assert check_against_reference(metaspace, ids) == decode(metaspace, ids) == UNICODE


def test_leading_space_of_a_word_survives(metaspace) -> None:
    """With a Metaspace decoder the text is not the concatenation of the tokens' own decodes (each drops
    its `▁`): the stream still gives the whole decode."""
    ids = metaspace.encode("it came to pass").tolist()
    assert "".join(decode(metaspace, [t]) for t in ids) != decode(metaspace, ids)
    assert check_against_reference(metaspace, ids) == "it came to pass"


@pytest.mark.parametrize("stops", [["<|user|>"], ["came to"], ["zzz", "came to", "pass, w"], ["ü"], ["\n"]])
def test_stop_strings_split_across_tokens(byte_bpe, metaspace, stops: list[str]) -> None:
    """A stop string spread over tokens: its start is held back until it is decided, nothing of it goes out,
    the text ends before it; a tail that does not become one is sent."""
    for tok in (byte_bpe, metaspace):
        ids = tok.encode(UNICODE).tolist()
        if tok is byte_bpe and stops != ["\n"]:  # the stop string is spread over tokens there
            assert not any(s in decode(tok, [t]) for s in stops for t in ids)
        text = check_against_reference(tok, ids, stops)
        assert text == UNICODE[: min(UNICODE.find(s) for s in stops if s in UNICODE)]


def test_a_false_start_of_a_stop_string_is_sent(byte_bpe) -> None:
    """`came to` starts like the stop `came tx`: held back while it could become it, then sent; at the end a
    tail like `Second li` of `Second lime` is flushed."""
    ids = byte_bpe.encode(UNICODE).tolist()
    assert check_against_reference(byte_bpe, ids, ["came tx", "line!"]) == UNICODE


def test_newline_ends_the_text_after_it(byte_bpe) -> None:
    ids = byte_bpe.encode(UNICODE).tolist()
    text = check_against_reference(byte_bpe, ids, ["zz"], newline=True)
    assert text == UNICODE[: UNICODE.index("\n") + 1]


def test_final_flush_sends_an_incomplete_character(byte_bpe) -> None:
    ids = byte_bpe.encode("ok 世").tolist()
    stream = TextStream(byte_bpe)
    sent = "".join(stream.add(t) for t in ids[:-1])
    assert sent == "ok " and stream.finish() == decode(byte_bpe, ids[:-1])[3:] and stream.content.endswith("\ufffd")


def test_real_tokenizer_at_every_prefix() -> None:
    tok = _real_tokenizer()
    if tok is None:
        pytest.skip("the SmolLM2 checkpoint is absent: run `litkv download smollm2-135m-instruct`")
    ids = tok.encode(UNICODE).tolist()
    assert check_against_reference(tok, ids, ["<|user|>"]) == UNICODE[: UNICODE.index("<|user|>")]
    assert check_against_reference(tok, ids) == decode(tok, ids)
