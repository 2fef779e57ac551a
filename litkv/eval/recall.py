"""The synthetic pass-key recall task, rebuilt from a checkpoint's `recall_format.json`.

An example of `length` tokens is `filler[:cut] + needle + filler[cut:] + question + answer`: every
part is tokenized on its own (no special tokens) and the token lists are concatenated; `filler` is a
window of natural text (from the format's `filler_file`) with as many tokens as needed to reach
`length`, and `cut = round(depth * len(filler))`. A model recalls the key if greedy decoding after
the question reproduces every answer token.

The multi-key variant (RULER's `niah_multikey`) hides several needles "The pass key of <word> is
<digits>." (the format's `multikey_needle`, keys drawn as for the single pass-key) at random depths
and asks for one of them (`multikey_question`); the answer is the format's `answer` with that key.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litkv.core.tokens import encode_plain

__all__ = ["MULTIKEY_WORDS", "RECALL_FILE", "RecallExample", "RecallFormat", "RecallTask"]

RECALL_FILE = "recall_format.json"
# Names of the needles of the multi-key task (each example draws distinct ones).
MULTIKEY_WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "maple", "violet", "harbor",
    "silver", "falcon", "meadow", "copper", "lantern", "orchid", "canyon", "ember",
)  # fmt: skip


@dataclass(frozen=True)
class RecallFormat:
    """The task's text templates and key alphabet (the fields of `recall_format.json` that matter)."""

    needle: str
    question: str
    answer: str
    num_digits: int = 5
    digits: str = "0123456789"
    first_digit_nonzero: bool = True
    distinct_digits: bool = False
    filler_file: str = "heldout.txt"
    context_length: int = 1024
    multikey_needle: str = "\nThe pass key of {word} is {key}. Remember it.\n"
    multikey_question: str = "\nWhat is the pass key of {word}? The pass key of {word} is"

    def __post_init__(self) -> None:
        for name, fields in (("needle", "{key}"), ("answer", "{key}"), ("multikey_needle", "{word} {key}")):
            for placeholder in fields.split():
                if placeholder not in getattr(self, name):
                    raise ValueError(
                        f"recall format field {name!r} must contain {placeholder!r}, got {getattr(self, name)!r}"
                    )
        if "{word}" not in self.multikey_question:
            raise ValueError(
                f"recall format field 'multikey_question' must contain '{{word}}', got {self.multikey_question!r}"
            )
        if not isinstance(self.num_digits, int) or self.num_digits < 1:
            raise ValueError(f"num_digits must be an int >= 1, got {self.num_digits!r}")
        if len(self.digits) < 2:
            raise ValueError(f"digits must hold at least 2 characters, got {self.digits!r}")
        if self.distinct_digits and self.num_digits > len(self.digits):
            raise ValueError(f"cannot draw {self.num_digits} distinct digits from {self.digits!r}")
        if not isinstance(self.context_length, int) or self.context_length < 1:
            raise ValueError(f"context_length must be an int >= 1, got {self.context_length!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RecallFormat:
        """Build from the JSON content; unknown (descriptive) keys are ignored, required ones checked."""
        missing = [key for key in ("needle", "question", "answer") if key not in data]
        if missing:
            raise ValueError(f"recall format lacks the fields {missing}")
        known = set(cls.__dataclass_fields__)
        return cls(**{key: value for key, value in data.items() if key in known})

    @classmethod
    def load(cls, path: str | Path) -> RecallFormat:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"recall task format {str(path)!r} does not exist")
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))


@dataclass(frozen=True)
class RecallExample:
    """One example: `ids[answer_start:]` are the answer tokens the model must produce."""

    ids: list[int]
    answer_start: int
    depth: float
    key: str
    word: str | None = None  # multi-key examples: the word whose key is asked

    @property
    def prompt(self) -> list[int]:
        return self.ids[: self.answer_start]

    @property
    def answer(self) -> list[int]:
        return self.ids[self.answer_start :]


class RecallTask:
    """Builds pass-key examples from a format, a tokenizer and a stream of filler tokens."""

    def __init__(self, fmt: RecallFormat, tokenizer: Any, filler_ids: Sequence[int]) -> None:
        self.fmt = fmt
        self.tokenizer = tokenizer
        self.filler_ids = list(filler_ids)
        self.question_ids = encode_plain(tokenizer, fmt.question)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, tokenizer: Any) -> RecallTask:
        """The task of `checkpoint_dir/recall_format.json`, filler from its `filler_file` (same directory)."""
        directory = Path(checkpoint_dir)
        fmt = RecallFormat.load(directory / RECALL_FILE)
        filler_path = directory / fmt.filler_file
        if not filler_path.is_file():
            raise FileNotFoundError(f"recall filler file {str(filler_path)!r} does not exist")
        return cls(fmt, tokenizer, encode_plain(tokenizer, filler_path.read_text(encoding="utf-8")))

    def random_key(self, rng: random.Random) -> str:
        """`num_digits` digits (all distinct if the format says so), redrawn while the first is a
        forbidden zero."""
        digits, n = list(self.fmt.digits), self.fmt.num_digits
        while True:
            key = rng.sample(digits, n) if self.fmt.distinct_digits else rng.choices(digits, k=n)
            if not (self.fmt.first_digit_nonzero and key[0] == "0"):
                return "".join(key)

    def make_example(self, filler_ids: Sequence[int], length: int, depth: float, key: str) -> RecallExample:
        """One example of exactly `length` tokens with the needle at relative `depth` in the filler."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        needle = encode_plain(self.tokenizer, self.fmt.needle.format(key=key))
        answer = encode_plain(self.tokenizer, self.fmt.answer.format(key=key))
        n_fill = length - len(needle) - len(self.question_ids) - len(answer)
        if n_fill < 0 or len(filler_ids) < n_fill:
            raise ValueError(
                f"cannot build a recall example of {length} tokens: needs {max(n_fill, 0)} filler tokens "
                f"and at least {length - max(n_fill, 0)} tokens for needle, question and answer; "
                f"got {len(filler_ids)} filler tokens"
            )
        cut = round(depth * n_fill)
        filler = list(filler_ids[:n_fill])
        ids = filler[:cut] + needle + filler[cut:] + self.question_ids + answer
        return RecallExample(ids, length - len(answer), depth, key)

    def examples(self, length: int, depths: Sequence[float], per_depth: int, seed: int = 0) -> list[RecallExample]:
        """`per_depth` examples at each depth, each on a random filler window, with a random key."""
        if len(self.filler_ids) <= length:
            raise ValueError(
                f"the filler text has {len(self.filler_ids)} tokens, fewer than the example length {length}"
            )
        rng = random.Random(seed)
        out = []
        for depth in depths:
            for _ in range(per_depth):
                start = rng.randrange(len(self.filler_ids) - length)
                window = self.filler_ids[start : start + length]
                out.append(self.make_example(window, length, depth, self.random_key(rng)))
        return out

    def make_multikey_example(
        self,
        filler_ids: Sequence[int],
        length: int,
        needles: Sequence[tuple[float, str, str]],
        asked: int,
    ) -> RecallExample:
        """One example of exactly `length` tokens with several needles, the `asked`-th one questioned.

        Args:
            filler_ids: at least as many filler tokens as the example needs.
            length: tokens of the example (answer included).
            needles: `(depth, word, key)` per needle; depth in [0, 1] is its relative place in the filler.
            asked: index into `needles` of the needle whose key is the answer.
        """
        if not needles or not 0 <= asked < len(needles):
            raise ValueError(f"asked must index one of the {len(needles)} needles, got {asked!r}")
        if any(not 0.0 <= depth <= 1.0 for depth, _, _ in needles):
            raise ValueError(f"needle depths must be in [0, 1], got {[d for d, _, _ in needles]}")
        depth, word, key = needles[asked]
        parts = [encode_plain(self.tokenizer, self.fmt.multikey_needle.format(word=w, key=k)) for _, w, k in needles]
        question = encode_plain(self.tokenizer, self.fmt.multikey_question.format(word=word))
        answer = encode_plain(self.tokenizer, self.fmt.answer.format(key=key))
        n_fill = length - sum(map(len, parts)) - len(question) - len(answer)
        if n_fill < 0 or len(filler_ids) < n_fill:
            raise ValueError(
                f"cannot build a multi-key example of {length} tokens: needles, question and answer take "
                f"{length - n_fill} tokens, leaving {n_fill} for filler; got {len(filler_ids)} filler tokens "
                "(use a longer example or fewer keys)"
            )
        filler = list(filler_ids[:n_fill])
        ids: list[int] = []
        prev = 0
        for (d, _, _), needle in sorted(zip(needles, parts, strict=True), key=lambda item: item[0][0]):
            cut = round(d * n_fill)
            ids += filler[prev:cut] + needle
            prev = cut
        ids += filler[prev:] + question + answer
        return RecallExample(ids, length - len(answer), depth, key, word)

    def multikey_examples(
        self, length: int, num_examples: int, num_keys: int = 4, seed: int = 0
    ) -> list[RecallExample]:
        """`num_examples` examples with `num_keys` needles (distinct words and keys) at random depths,
        each on a random filler window; one needle, drawn at random, is asked."""
        if not 1 <= num_keys <= len(MULTIKEY_WORDS):
            raise ValueError(f"num_keys must be in [1, {len(MULTIKEY_WORDS)}], got {num_keys!r}")
        if len(self.filler_ids) <= length:
            raise ValueError(
                f"the filler text has {len(self.filler_ids)} tokens, fewer than the example length {length}"
            )
        rng = random.Random(seed)
        out = []
        for _ in range(num_examples):
            start = rng.randrange(len(self.filler_ids) - length)
            words = rng.sample(MULTIKEY_WORDS, num_keys)
            keys: list[str] = []
            for _ in range(1000 * num_keys):
                key = self.random_key(rng)
                keys += [] if key in keys else [key]
                if len(keys) == num_keys:
                    break
            else:
                raise ValueError(f"cannot draw {num_keys} distinct keys from the format's key alphabet")
            needles = [(round(rng.random(), 3), w, k) for w, k in zip(words, keys, strict=True)]
            window = self.filler_ids[start : start + length]
            out.append(self.make_multikey_example(window, length, needles, rng.randrange(num_keys)))
        return out
