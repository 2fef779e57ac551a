"""The retrieval windows of litkv/finetune/retrieval_data.py: exactly `length` tokens, a pure function of
(text, seed, index), every answer written in the window before its question, held-out lines never written,
and none of the RULER generator's templates, noise sentences or the pass-key wording."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.eval.recall import RecallFormat
from litkv.eval.ruler import CWE_PROMPT, FWE_PROMPT, NOISE, VT_PROMPT, NiahFormat
from litkv.finetune.retrieval_data import check_source, retrieval_window, retrieval_windows

ASSETS = Path(__file__).resolve().parents[2] / "litkv" / "assets" / "default"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ASSETS)


def _text(n: int = 400) -> str:
    words = ["river", "stone", "lamp", "field", "bread", "door", "wind", "cloth", "seed", "hill", "gate", "fire"]
    lines = (" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(6 + i % 9)) + f" {i}." for i in range(n))
    return "\n".join(lines)


def _fragments() -> set[str]:
    """Fixed phrases (5 words or more) of RULER's templates and noise and of the pass-key format."""
    texts = [VT_PROMPT, CWE_PROMPT, FWE_PROMPT, NOISE, *vars(NiahFormat()).values()]
    texts += [v for v in json.loads((ASSETS / "recall_format.json").read_text()).values() if isinstance(v, str)]
    out = set()
    for text in texts:
        if not isinstance(text, str):
            continue
        for part in re.split(r"\{[a-z_]+\}", text):
            words = part.split()
            out |= {" ".join(words[i : i + 5]) for i in range(len(words) - 4)}
    return out


@pytest.mark.parametrize("length", [256, 2048])
def test_windows_are_exact_length_and_deterministic(tokenizer, length: int) -> None:
    text = _text()
    first = retrieval_windows(text, tokenizer, 3, length, seed=4)
    assert [len(w) for w in first] == [length] * 3
    assert retrieval_windows(text, tokenizer, 2, length, seed=4, start=1) == first[1:]  # window i alone
    assert retrieval_window(check_source(text), tokenizer, length, 4, 0) == first[0]
    assert retrieval_windows(text, tokenizer, 1, length, seed=5)[0] != first[0]
    assert len({tuple(w) for w in first}) == 3


def test_answers_are_in_the_window_before_the_questions(tokenizer) -> None:
    ids = retrieval_windows(_text(), tokenizer, 1, 2048, seed=0)[0]
    text = tokenizer.decode(__import__("torch").tensor(ids))
    body, questions = text.split("\nQuestions on the text above, with their answers:\n")
    pairs = re.findall(r"Q: (.*)\nA: (.*)\.", questions)
    assert len(pairs) >= 5
    kinds = {"keep?": 0, "ledger": 0, "potter": 0, "follow": 0}
    for question, answer in pairs:
        assert answer in body, (question, answer)
        for kind in kinds:
            kinds[kind] += kind in question
    assert all(kinds.values()), kinds  # every kind of item is asked about
    for who in re.findall(r"In which town was (.*) a potter\?", questions):  # a name repeated far apart
        first, last = body.index(f"{who} was a potter"), body.index(f"Years later {who} left")
        assert last - first > len(body) // 5


def test_no_ruler_template_and_no_held_out_line(tokenizer) -> None:
    text = _text()
    held = "\n".join(text.splitlines()[100:140])
    with pytest.raises(ValueError, match="at least 20 lines"):
        check_source(held, held)
    windows = retrieval_windows(text, tokenizer, 4, 1024, seed=2, forbidden=held)
    decoded = [tokenizer.decode(__import__("torch").tensor(w)) for w in windows]
    banned = {line for line in held.splitlines() if len(line) >= 40}
    assert banned and not any(line in d for d in decoded for line in banned)
    fragments = _fragments()
    assert len(fragments) > 50
    hits = {f for f in fragments for d in decoded if f in d}
    assert not hits, hits
    assert not any(re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-", d) for d in decoded)  # no RULER-style uuids
    assert RecallFormat.load(ASSETS / "recall_format.json") is not None
