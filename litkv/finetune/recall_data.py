"""Pass-key recall and digit-copy rows mixed into text fine-tuning data (the default model's training mix).

`scripts/train_default_model.py` trains the shipped model on natural text in which half of the rows
carry a pass-key needle and a question at the end (`recall_format.json`, built by `litkv.eval.recall`)
and a quarter carry a string of digits written twice. `mix_recall_rows` turns text windows into the
same mix for `litkv finetune` (`--data.recall_share`, `--data.copy_share`):

- a recall row is `filler[:cut] + needle + filler[cut:] + question + answer` built from the window
  (needle at a uniform random depth, random key); the loss is taken on the answer tokens only;
- a copy row is the window with one string of 5 to 10 distinct digits written at two random places;
  the loss is taken on the copied digits that can be predicted (all but the first token of the
  second copy);
- the other rows stay plain text with the loss on every token.

Because `litkv finetune` averages the loss per micro-batch, a recall row with micro-batch size 1
weighs as much as a whole text row: the answer is not drowned by the filler's language-model loss.
The mix is a pure function of the windows and the seed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from litkv.core.tokens import encode_plain
from litkv.core.validation import is_number
from litkv.eval.recall import RecallFormat, RecallTask

__all__ = ["check_shares", "copy_row", "load_recall_task", "mix_recall_rows", "recall_row"]

IGNORE_INDEX = -100
Example = tuple[torch.Tensor, torch.Tensor]


def load_recall_task(recall_format: Path, tokenizer: Any) -> RecallTask:
    """The pass-key task of `recall_format` (a `recall_format.json`); no filler is read (rows bring theirs)."""
    return RecallTask(RecallFormat.load(recall_format), tokenizer, [])


def _window(example: Example) -> list[int]:
    """The `T + 1` tokens of a shifted text example `(input_ids (T,), targets (T,))`."""
    ids, targets = example
    if ids.dim() != 1 or ids.shape != targets.shape or ids.numel() < 1:
        raise ValueError(
            f"a text example must be two 1-D tensors of the same length >= 1, got shapes "
            f"{tuple(ids.shape)} and {tuple(targets.shape)}"
        )
    if bool((targets == IGNORE_INDEX).any()) or not torch.equal(ids[1:], targets[:-1]):
        raise ValueError("recall rows are built from plain text windows (targets = inputs shifted by one)")
    return ids.tolist() + targets[-1:].tolist()


def _shifted(ids: list[int], scored: range) -> Example:
    """`(input_ids (T,), targets (T,))` of the `T + 1` tokens `ids`, loss only on tokens at `scored`."""
    tokens = torch.tensor(ids, dtype=torch.long)
    targets = torch.full((len(ids) - 1,), IGNORE_INDEX, dtype=torch.long)
    positions = torch.tensor(list(scored), dtype=torch.long)
    targets[positions - 1] = tokens[positions]
    return tokens[:-1], targets


def recall_row(task: RecallTask, window: list[int], depth: float, key: str) -> Example:
    """A pass-key row of `len(window)` tokens (the window's first tokens are the filler); loss on the answer.

    Raises:
        ValueError: the window is too short for needle, question and answer.
    """
    example = task.make_example(window, len(window), depth, key)
    return _shifted(example.ids, range(example.answer_start, len(example.ids)))


def copy_row(tokenizer: Any, window: list[int], rng: random.Random, max_digits: int = 10) -> Example:
    """The window with a string of 5 to `max_digits` distinct digits written twice at random places.

    Same construction as `scripts/train_default_model.py:make_copy_example`; the loss is taken on
    the tokens of the second copy that its first token makes predictable.

    Raises:
        ValueError: the window is too short for two copies.
    """
    string = encode_plain(tokenizer, " " + "".join(rng.sample("0123456789", rng.randint(5, max_digits))))
    n_fill = len(window) - 2 * len(string)
    if n_fill < 0:
        raise ValueError(f"cannot write two copies of {len(string)} tokens into a row of {len(window)} tokens")
    first, second = sorted(rng.randint(0, n_fill) for _ in range(2))
    filler = window[:n_fill]
    ids = filler[:first] + string + filler[first:second] + string + filler[second:]
    begin = second + len(string)
    return _shifted(ids, range(begin + 1, begin + len(string)))


def check_shares(recall_share: float, copy_share: float) -> None:
    for name, value in (("recall_share", recall_share), ("copy_share", copy_share)):
        if not is_number(value) or not 0 <= value <= 1:
            raise ValueError(f"data.{name} must be a number in [0, 1], got {value!r}")
    if recall_share + copy_share > 1:
        raise ValueError(
            f"data.recall_share + data.copy_share must be <= 1, got {recall_share} + {copy_share} = "
            f"{recall_share + copy_share}"
        )


def mix_recall_rows(
    examples: list[Example],
    task: RecallTask,
    recall_share: float,
    copy_share: float,
    seed: int,
) -> list[Example]:
    """Turn each text example into a recall row (probability `recall_share`), a copy row (`copy_share`)
    or leave it as it is; seeded by `seed`.

    Args:
        examples: plain text examples `(input_ids (T,), targets (T,))` (`litkv.finetune.data`).
        task: the pass-key task (`load_recall_task`).
        recall_share: share of recall rows, in [0, 1].
        copy_share: share of copy rows, in [0, 1]; `recall_share + copy_share <= 1`.
        seed: the seed of the draws (row kind, needle depth, key, digits, places).

    Returns:
        As many examples, each of the same length as the one it replaces.
    """
    check_shares(recall_share, copy_share)
    rng = random.Random(seed)
    out: list[Example] = []
    for example in examples:
        draw = rng.random()
        if draw < recall_share:
            out.append(recall_row(task, _window(example), rng.random(), task.random_key(rng)))
        elif draw < recall_share + copy_share:
            out.append(copy_row(task.tokenizer, _window(example), rng))
        else:
            out.append(example)
    return out
