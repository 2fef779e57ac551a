"""Training windows whose content carries what retrieval needs, made from training text (litkv's own
generator, for fitting eviction gates such as KVzap's on text where far tokens matter).

`retrieval_window(text, tokenizer, length, seed, index)` is exactly `length` token ids: passages of the
training `text` (consecutive lines from a point drawn by the seed) with, inserted at random line breaks,

- **facts**: a made-up person, a number and a thing (`"Arvel Tomasin keeps 417 copper bowls."`);
- **ledgers**: lists of coded entries and amounts (`"Ledger of Mirrowin:\\n- KT-3921: 5807 measures\\n..."`);
- **names repeated far apart**: a person and a place early, the same person with a second place much later;
- **questions and answers over the document**, at the end and, for some facts, in the middle after the
  fact: about the facts, the ledger entries, the places, and the words that follow a quoted phrase of a
  training passage in the window (its answer is in the window's own text).

Every window is a pure function of `(text, seed, index)` (its own `random.Random`), so a fit that stops can
regenerate window `index` and go on. The wording is litkv's own: none of RULER's tasks, templates or noise
sentences (`litkv.eval.ruler`) and not the pass-key format (`litkv.eval.recall`); the lines of `forbidden`
text (the held-out text) are taken out of the source, so they are never written.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from litkv.core.tokens import encode_plain

__all__ = ["Item", "check_source", "retrieval_window", "retrieval_windows"]

_SYLLABLES = (
    "ar", "vel", "to", "ma", "sin", "qu", "orn", "bel", "ith", "ra", "dun", "ke", "lo", "wen", "fa",
    "ris", "gal", "mo", "tev", "ny", "zar", "ul", "pe", "hal", "cor", "di", "mir", "ow", "sta", "ben",
)  # fmt: skip
_THINGS = ("copper bowls", "clay lamps", "woollen cloaks", "iron nails", "cedar planks", "silver rings", "goats",
           "barrels of oil", "sacks of barley", "glass beads", "bronze keys", "linen scrolls")  # fmt: skip
_UNITS = ("measures", "talents", "crates", "bushels", "bundles", "jars")
_MIN_LINE = 40  # lines of `forbidden` text at least this long are checked against the source


@dataclass(frozen=True)
class Item:
    """A piece of a window: `statement` goes into the text, `question` and `answer` into a question block
    (`question` empty: nothing is asked)."""

    statement: str
    question: str = ""
    answer: str = ""


def _name(rng: random.Random, parts: int = 2) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def _person(rng: random.Random) -> str:
    return f"{_name(rng, rng.randint(2, 3))} {_name(rng, rng.randint(2, 4))}"


def _fact(rng: random.Random) -> Item:
    who, thing, n = _person(rng), rng.choice(_THINGS), rng.randint(12, 9999)
    return Item(f"{who} keeps {n} {thing}.", f"How many {thing} does {who} keep?", str(n))


def _ledger(rng: random.Random) -> list[Item]:
    """A ledger block (the first item's statement) and one question per asked entry."""
    owner, unit = _name(rng, 3), rng.choice(_UNITS)
    entries = [(f"{rng.choice('BCDFGHKLMNPRSTVZ')}{rng.choice('AEKQTXY')}-{rng.randint(1000, 9999)}",
                str(rng.randint(100, 99999))) for _ in range(rng.randint(4, 9))]  # fmt: skip
    block = f"Ledger of {owner}:\n" + "\n".join(f"- {code}: {amount} {unit}" for code, amount in entries)
    asked = rng.sample(entries, k=min(2, len(entries)))
    items = [Item(block)]
    items += [Item("", f"In the ledger of {owner}, how many {unit} are written for {c}?", a) for c, a in asked]
    return items


def _travel(rng: random.Random) -> tuple[Item, Item]:
    """A person and a place (early), the same person moving on (later); the question asks the first place."""
    who, first, second = _person(rng), _name(rng, 3), _name(rng, 3)
    return (
        Item(f"{who} was a potter in the town of {first}."),
        Item(f"Years later {who} left for {second}.", f"In which town was {who} a potter?", first),
    )


def _quote(rng: random.Random, line: str) -> Item | None:
    """A question on a training line of the window: which words follow a quoted phrase of it."""
    words = line.split()
    if len(words) < 9:
        return None
    start = rng.randint(0, len(words) - 8)
    phrase, after = " ".join(words[start : start + 5]), " ".join(words[start + 5 : start + 8])
    return Item("", f'Which words follow "{phrase}" in the text?', after)


def check_source(text: str, forbidden: str = "") -> list[str]:
    """The non-empty lines of `text` without the lines of `forbidden` of at least 40 characters (held-out
    text never reaches a training window: a verse the KJV repeats in a held-out chapter is dropped);
    ValueError when fewer than 20 lines are left."""
    banned = {line.strip() for line in forbidden.splitlines() if len(line.strip()) >= _MIN_LINE}
    lines = [line.strip() for line in text.splitlines() if line.strip() and line.strip() not in banned]
    if len(lines) < 20:
        raise ValueError(f"retrieval windows need a source text of at least 20 lines, got {len(lines)}")
    return lines


def _plan(rng: random.Random, lines: Sequence[str], n_lines: int) -> tuple[list[str], list[Item], int]:
    """The window's body (training lines with statements at random breaks), its end questions and the
    index of the body's last line that a statement or a question needs."""
    start = rng.randrange(len(lines))
    body = [lines[(start + i) % len(lines)] for i in range(n_lines)]
    slots: list[tuple[int, Item]] = []
    asked: list[Item] = []
    for _ in range(max(2, n_lines // 6)):
        fact = _fact(rng)
        at = rng.randrange(n_lines)
        slots.append((at, fact))
        if rng.random() < 0.3 and at + 3 < n_lines:  # asked in the middle, a few lines later
            slots.append((rng.randrange(at + 1, n_lines), Item(f"Question: {fact.question} Answer: {fact.answer}.")))
        else:
            asked.append(fact)
    for _ in range(max(1, n_lines // 25)):
        ledger = _ledger(rng)
        slots.append((rng.randrange(n_lines), ledger[0]))
        asked += ledger[1:]
    for _ in range(max(1, n_lines // 15)):
        early, late = _travel(rng)
        at = rng.randrange(max(1, n_lines // 3))
        slots += [(at, early), (rng.randrange(min(at + n_lines // 2, n_lines - 1), n_lines), late)]
        asked.append(late)
    quoted = set()
    for at in rng.sample(range(n_lines), k=min(4, n_lines)):
        quote = _quote(rng, body[at])
        if quote is not None:
            asked.append(quote)
            quoted.add(at)
    out: list[str] = []
    needed = -1
    by_line: dict[int, list[Item]] = {}
    for at, item in slots:
        by_line.setdefault(at, []).append(item)
    for i, line in enumerate(body):
        out += [item.statement for item in by_line.get(i, [])]
        needed = len(out) - 1 if i in by_line else needed
        out.append(line)
        needed = len(out) - 1 if i in quoted else needed
    rng.shuffle(asked)
    return out, asked, needed


def retrieval_window(text: str | Sequence[str], tokenizer: Any, length: int, seed: int, index: int) -> list[int]:
    """`length` token ids of window `index` (module docstring); `text`: the training text or its lines
    (`check_source`). The question block ends the window; the body is cut to fit it (training text only is
    cut, after the last statement and the last quoted line)."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 256:
        raise ValueError(f"a retrieval window needs length >= 256 tokens, got {length!r}")
    lines = check_source(text) if isinstance(text, str) else list(text)
    rng = random.Random(f"litkv-retrieval-{seed}-{index}")
    n_lines = max(8, length // 30)
    while True:
        plan = random.Random(rng.random())
        body, asked, needed = _plan(plan, lines, n_lines)
        tail = _questions(tokenizer, asked)
        while len(tail) > length // 4 and len(asked) > 1:  # a short window asks fewer questions
            asked.pop()
            tail = _questions(tokenizer, asked)
        room = length - len(tail)
        if len(encode_plain(tokenizer, "\n".join(body[: needed + 1]))) > room:
            n_lines = max(1, int(n_lines * 0.9))  # too much to say: plan fewer lines
            continue
        more = plan.randrange(len(lines))
        ids = encode_plain(tokenizer, "\n".join(body))
        while len(ids) < room:  # training lines after the last statement fill the window
            body += [lines[(more + i) % len(lines)] for i in range(8)]
            more += 8
            ids = encode_plain(tokenizer, "\n".join(body))
        return ids[:room] + tail


def _questions(tokenizer: Any, asked: Sequence[Item]) -> list[int]:
    """Token ids of the question block that ends a window."""
    text = "\n\nQuestions on the text above, with their answers:\n"
    return encode_plain(tokenizer, text + "\n".join(f"Q: {item.question}\nA: {item.answer}." for item in asked))


def retrieval_windows(
    text: str, tokenizer: Any, num: int, length: int, seed: int, forbidden: str = "", start: int = 0
) -> list[list[int]]:
    """Windows `start .. start + num - 1` (`retrieval_window`) of the training `text`, checked against
    `forbidden` (`check_source`)."""
    lines = check_source(text, forbidden)
    return [retrieval_window(lines, tokenizer, length, seed, i) for i in range(start, start + num)]
