"""The token ids `litkv generate` feeds for a text, from Python: one input for one text.

`litkv generate` renders the checkpoint's chat template by default (`--chat_template`): the prompt is one
user message with the generation prompt, and the reply ends at the template's end-of-turn token or EOS.
`chat_prompt(tokenizer, messages)` returns those ids and `chat_stop_tokens(tokenizer)` those stop tokens,
so that `litkv.generate(model, [chat_prompt(tokenizer, text)], ..., sampling=Sampling(stop_tokens=
chat_stop_tokens(tokenizer)))` answers as the command does. A checkpoint without a template (a base model,
the small model shipped with litkv) gets the raw text, as the command feeds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from litkv.inference.chat_template import Format, Message, RawFormat, load_format

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

__all__ = ["Messages", "chat_prompt", "chat_stop_tokens", "encode_prompt", "prompt_format"]

#: A text (one user message) or a conversation: `(role, content)` pairs or `{"role": ..., "content": ...}`.
Messages = str | Sequence[Message] | Sequence[dict]


def prompt_format(
    tokenizer: Tokenizer, checkpoint_dir: str | Path | None = None, chat_template: bool | None = None
) -> Format:
    """The format `litkv generate --chat_template VALUE` uses for `tokenizer`'s checkpoint.

    Args:
        tokenizer: a tokenizer from `litkv.load` or `litkv.checkpoints.checkpoint.load_tokenizer` (it knows
            its checkpoint directory), or any LitGPT tokenizer with `checkpoint_dir` given.
        checkpoint_dir: the checkpoint the tokenizer is from (default: the one it was loaded from).
        chat_template: True, False (raw text) or None (the template when the checkpoint has one).
    """
    where = checkpoint_dir if checkpoint_dir is not None else getattr(tokenizer, "checkpoint_dir", None)
    if where is None:
        raise ValueError(
            "this tokenizer does not say which checkpoint it is from: load it with litkv.load or "
            "litkv.checkpoints.checkpoint.load_tokenizer, or give checkpoint_dir="
        )
    return load_format(Path(where), tokenizer, chat_template)


def encode_prompt(
    fmt: Format, tokenizer: Tokenizer, messages: Messages, device: torch.device | str | None = None
) -> torch.Tensor:
    """The ids `(T,)` (int64) of `messages` in `fmt`: a text in raw format is the tokenizer's encoding (BOS
    as the tokenizer says); otherwise the messages as `fmt` renders them, with the generation prompt."""
    if isinstance(messages, str):
        if isinstance(fmt, RawFormat):
            return tokenizer.encode(messages, device=device).long()
        messages = [("user", messages)]
    pairs = [_pair(i, m) for i, m in enumerate(messages)]
    if not pairs:
        raise ValueError("messages is empty: give a text or at least one (role, content) message")
    ids = [t for seg in fmt.segments(pairs, [None] * len(pairs), True, True) for t in seg.ids]
    return torch.tensor(ids, dtype=torch.long, device=device)


def chat_prompt(
    tokenizer: Tokenizer,
    messages: Messages,
    *,
    checkpoint_dir: str | Path | None = None,
    chat_template: bool | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The token ids `(T,)` that `litkv generate --prompt TEXT` feeds (`messages=TEXT`), or those of a
    conversation (a list of `(role, content)` or `{"role", "content"}` messages) with the generation prompt.

    Args:
        tokenizer: the checkpoint's tokenizer (`litkv.load`).
        messages: a text (one user message) or the conversation so far.
        checkpoint_dir: the checkpoint (default: the one the tokenizer was loaded from).
        chat_template: as `litkv generate --chat_template`: None uses the checkpoint's template if it has one.
        device: where the ids go.
    """
    return encode_prompt(prompt_format(tokenizer, checkpoint_dir, chat_template), tokenizer, messages, device)


def chat_stop_tokens(
    tokenizer: Tokenizer, *, checkpoint_dir: str | Path | None = None, chat_template: bool | None = None
) -> list[int]:
    """The tokens that end `litkv generate`'s answer (the template's end-of-turn token and EOS), sorted: give
    them to `litkv.Sampling(stop_tokens=...)`."""
    return sorted(prompt_format(tokenizer, checkpoint_dir, chat_template).stop_ids)


def _pair(index: int, message: object) -> Message:
    """`(role, content)` of one message, or ValueError naming it."""
    if isinstance(message, dict):
        message = (message.get("role"), message.get("content"))
    if isinstance(message, (tuple, list)) and len(message) == 2 and all(isinstance(part, str) for part in message):
        return (message[0], message[1])
    raise ValueError(f"message {index} must be (role, content) strings or a dict with them, got {message!r:.80}")
