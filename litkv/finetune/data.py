"""Fine-tuning data: LitGPT's JSON instruction format or a plain text file, split, ordered, batched.

A text file can be mixed with synthetic pass-key recall and digit-copy rows (`--data.recall_share`,
`--data.copy_share`; `litkv.finetune.recall_data`), the mix the shipped default model was trained on.

An example is a pair `(input_ids, targets)` of 1-D int64 tensors of the same length, already shifted:
`targets[t]` is the token that should follow `input_ids[:t + 1]`, or -100 where no loss is taken
(the prompt of an instruction example). The order of the training examples is a pure function of
`(seed, step)` (`DataOrder`), so resuming at a step restores it exactly.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from litkv.core.validation import require_file, require_int
from litkv.eval.recall import RECALL_FILE
from litkv.finetune.recall_data import check_shares, load_recall_task, mix_recall_rows

__all__ = [
    "IGNORE_INDEX",
    "DataArgs",
    "Example",
    "load_examples",
    "read_json_records",
    "split_examples",
    "collate",
    "DataOrder",
]

IGNORE_INDEX = -100
Example = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DataArgs:
    """Where the fine-tuning data comes from.

    Args:
        path: A ``.json`` file in LitGPT's instruction format (a list of ``{"instruction", "input",
            "output"}`` objects; the loss is taken on the response only) or a plain text file (any other
            suffix), cut into sequences of `seq_length` tokens for long-context language modelling.
        prompt_style: LitGPT prompt style for JSON data (``alpaca``, ``chatml``, ``llama3``, ...).
        seq_length: Text files: tokens per training sequence. JSON: longer examples are truncated.
        val_fraction: Fraction of the examples held out for validation (at least one when > 0).
        mask_prompt: JSON data: take no loss on the prompt tokens.
        recall_share: Text files: share of the sequences turned into pass-key recall rows (needle at a
            random depth, question and answer at the end; loss on the answer only).
        copy_share: Text files: share of the sequences turned into digit-copy rows (a digit string
            written twice; loss on the predictable copied digits).
        recall_format: The pass-key task of the recall rows (a ``recall_format.json``). Default: the
            checkpoint's own ``recall_format.json``.
    """

    path: Path | None = None
    prompt_style: str = "alpaca"
    seq_length: int = 1024
    val_fraction: float = 0.05
    mask_prompt: bool = True
    recall_share: float = 0.0
    copy_share: float = 0.0
    recall_format: Path | None = None

    def __post_init__(self) -> None:
        if self.path is not None:
            self.path = Path(self.path)
        if self.recall_format is not None:
            self.recall_format = Path(self.recall_format)
        check_shares(self.recall_share, self.copy_share)
        if self.mixes_recall and self.is_json:
            raise ValueError(
                f"data.recall_share ({self.recall_share}) and data.copy_share ({self.copy_share}) apply to a text "
                f"file, got the instruction file {str(self.path)!r}; set both to 0 for JSON data"
            )
        require_int("data.seq_length", self.seq_length, 1)
        if not isinstance(self.val_fraction, (int, float)) or not 0 <= self.val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction!r}")
        from litgpt.prompts import prompt_styles

        if self.prompt_style not in prompt_styles:
            raise ValueError(
                f"unknown data.prompt_style {self.prompt_style!r}; known: {', '.join(sorted(prompt_styles))}"
            )

    @property
    def is_json(self) -> bool:
        return self.path is not None and self.path.suffix.lower() == ".json"

    @property
    def mixes_recall(self) -> bool:
        return self.recall_share > 0 or self.copy_share > 0


def load_examples(
    args: DataArgs, tokenizer, seed: int = 0, checkpoint_dir: Path | None = None
) -> list[Example]:  # tokenizer: litgpt.tokenizer.Tokenizer
    """Tokenize `args.path` into examples (see the module docstring).

    `seed` draws the recall and copy rows; `checkpoint_dir` holds the default `recall_format.json`.
    """
    if args.path is None:
        raise ValueError("no fine-tuning data: pass --data.path (a .json instruction file or a text file)")
    require_file("--data.path", args.path)
    if args.is_json:
        return _json_examples(args, tokenizer)
    examples = _text_examples(args, tokenizer)
    if not args.mixes_recall:
        return examples
    task = load_recall_task(_recall_format_path(args, checkpoint_dir), tokenizer)
    return mix_recall_rows(examples, task, args.recall_share, args.copy_share, seed)


def _recall_format_path(args: DataArgs, checkpoint_dir: Path | None) -> Path:
    if args.recall_format is not None:
        return args.recall_format
    if checkpoint_dir is None or not (Path(checkpoint_dir) / RECALL_FILE).is_file():
        raise FileNotFoundError(
            f"data.recall_share/copy_share need the pass-key task: pass --data.recall_format (a {RECALL_FILE}); "
            f"the checkpoint directory {str(checkpoint_dir)!r} has no {RECALL_FILE}"
        )
    return Path(checkpoint_dir) / RECALL_FILE


def _json_examples(args: DataArgs, tokenizer) -> list[Example]:
    from litgpt.data.base import SFTDataset

    records = read_json_records(args.path)
    dataset = SFTDataset(
        records,
        tokenizer,
        args.prompt_style,
        max_seq_length=args.seq_length + 1,
        mask_prompt=args.mask_prompt,
        ignore_index=IGNORE_INDEX,
    )
    examples, skipped = [], 0
    for i in range(len(dataset)):
        item = dataset[i]
        ids, labels = item["input_ids"].long(), item["labels"].long()
        if ids.numel() < 2 or bool((labels[1:] == IGNORE_INDEX).all()):
            skipped += 1  # nothing to learn: the response was truncated away
            continue
        examples.append((ids[:-1], labels[1:]))
    if skipped:
        warnings.warn(
            f"{args.path}: skipped {skipped} of {len(dataset)} records whose response does not fit in "
            f"data.seq_length={args.seq_length} tokens",
            stacklevel=2,
        )
    if not examples:
        raise ValueError(f"{args.path}: no record has a response within data.seq_length={args.seq_length} tokens")
    return examples


def read_json_records(path: Path) -> list[dict[str, str]]:
    """The records of a LitGPT instruction file, checked: a non-empty JSON list of objects whose
    `instruction`, `output` (required) and `input` (optional) are strings.

    Raises:
        ValueError: naming the file and, for a bad record, its index and what is wrong with it.
    """
    try:
        records = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not a UTF-8 text file: {err}") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from err
    if not isinstance(records, list) or not records:
        raise ValueError(
            f"{path} must hold a non-empty JSON list of {{'instruction', 'input', 'output'}} objects, "
            f"got {'an empty list' if records == [] else type(records).__name__}"
        )
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"{path}: record {i} must be an object, got {type(record).__name__} {record!r:.100}")
        missing = [key for key in ("instruction", "output") if key not in record]
        if missing:
            raise ValueError(f"{path}: record {i} has no {' and no '.join(repr(k) for k in missing)}")
        for key in ("instruction", "input", "output"):
            if key in record and not isinstance(record[key], str):
                value = record[key]
                raise ValueError(
                    f"{path}: record {i}: {key!r} must be a string, got {type(value).__name__} {value!r:.100}"
                )
    return records


def _text_examples(args: DataArgs, tokenizer) -> list[Example]:
    try:
        text = args.path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{args.path} is not a UTF-8 text file: {err}") from err
    tokens = tokenizer.encode(text).long()
    window = args.seq_length + 1
    if tokens.numel() < window:
        raise ValueError(
            f"{args.path} has {tokens.numel()} tokens, fewer than data.seq_length + 1 = {window}: "
            "lower --data.seq_length or use a longer file"
        )
    starts = range(0, tokens.numel() - window + 1, args.seq_length)
    return [(tokens[s : s + window - 1], tokens[s + 1 : s + window]) for s in starts]


def split_examples(examples: list[Example], val_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """A seeded random split into (train, validation); validation gets at least one example if > 0."""
    n = len(examples)
    n_val = 0 if val_fraction == 0 else max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise ValueError(f"{n} examples are too few to hold out val_fraction={val_fraction} and still train")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [examples[i] for i in perm[n_val:]], [examples[i] for i in perm[:n_val]]


def collate(examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad into `input_ids` `(B, T_max)` (pad token 0) and `targets` `(B, T_max)` (pad -100).

    Pads sit after every real token, so causal attention keeps them out of the real tokens' outputs.
    """
    t_max = max(ids.numel() for ids, _ in examples)
    input_ids = torch.zeros(len(examples), t_max, dtype=torch.long)
    targets = torch.full((len(examples), t_max), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, tgt) in enumerate(examples):
        input_ids[row, : ids.numel()] = ids
        targets[row, : tgt.numel()] = tgt
    return input_ids, targets


class DataOrder:
    """Which examples each optimizer step uses: a fresh seeded permutation per epoch.

    Step `s` takes the examples at stream positions `[s * G, (s + 1) * G)` (`G`: global batch size);
    stream position `k` is example `perm(k // n)[k % n]` with `perm(e)` seeded by `seed + e`.
    """

    def __init__(self, num_examples: int, global_batch_size: int, seed: int) -> None:
        if num_examples < 1:
            raise ValueError(f"need at least one training example, got {num_examples}")
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = torch.randperm(self.num_examples, generator=generator).tolist()
        return self._perms[epoch]

    def step_indices(self, step: int) -> list[int]:
        """Example indices of the global batch of `step`."""
        n, g = self.num_examples, self.global_batch_size
        return [self._perm(k // n)[k % n] for k in range(step * g, (step + 1) * g)]

    def rank_micro_batches(self, step: int, rank: int, world_size: int, micro_batch_size: int) -> list[list[int]]:
        """This rank's share of the step's global batch (every `world_size`-th), in micro-batches."""
        mine = self.step_indices(step)[rank::world_size]
        return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
