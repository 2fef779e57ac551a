"""How `litkv generate` prints a batch's answers, and its prompt echo on stderr.

`--output text` (the default): one prompt's answer streams as it is produced; a batch's answers print at
the end, one line per prompt in prompt order, each answer's backslashes, newlines and carriage returns
written as `\\\\`, `\\n` and `\\r` (`escape_line`; `unescape_line` reverses it), so that `stdout.split("\\n")`
gives the answers back. `--output jsonl`: one JSON object per prompt and line (`answer_record`), for
programs. Prompts and headers go to stderr, a long prompt shortened there (`shorten_echo`).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from litgpt.tokenizer import Tokenizer

__all__ = ["OUTPUTS", "answer_record", "answer_text", "escape_line", "print_answers", "shorten_echo", "unescape_line"]

OUTPUTS = ("text", "jsonl")
ECHO_LINES = 8  # a prompt echo of more lines than this, or of more than ECHO_CHARS characters, is shortened
ECHO_CHARS = 800
_KEPT_CHARS = 300  # characters kept at each end of a shortened echo
_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r"}
_UNESCAPES = {"\\\\": "\\", "\\n": "\n", "\\r": "\r"}


def check_output(output: str) -> None:
    """ValueError naming `--output` unless it is one of `OUTPUTS`."""
    if output not in OUTPUTS:
        raise ValueError(f"--output must be one of {', '.join(OUTPUTS)}, got {output!r}")


def escape_line(text: str) -> str:
    """`text` on one line: backslash, newline and carriage return escaped (`unescape_line` reverses it)."""
    return re.sub(r"[\\\n\r]", lambda m: _ESCAPES[m.group(0)], text)


def unescape_line(line: str) -> str:
    """The text `escape_line` wrote as `line`."""
    return re.sub(r"\\[\\nr]", lambda m: _UNESCAPES[m.group(0)], line)


def finish_reason(tokens: Sequence[int], stop: Sequence[int]) -> str:
    """`"stop"` when the answer ended at one of its stop tokens (EOS, end of turn), else `"length"`."""
    return "stop" if tokens and tokens[-1] in set(stop) else "length"


def answer_text(tokenizer: Tokenizer, out: torch.Tensor, stop: Sequence[int]) -> str:
    """An answer's text `(n,)` ids -> text, without the stop token that ended it."""
    ids = out.tolist()
    return tokenizer.decode(out[:-1] if finish_reason(ids, stop) == "stop" else out)


def answer_record(
    index: int, tokenizer: Tokenizer, out: torch.Tensor, prompt_tokens: int, stop: Sequence[int]
) -> dict[str, object]:
    """One `--output jsonl` object: `index` (the prompt's place), `text` (without the stop token),
    `prompt_tokens`, `new_tokens` (the stop token included) and `finish_reason` (`"stop"`: a stop token,
    `"length"`: `--max_new_tokens` reached)."""
    return {
        "index": index,
        "text": answer_text(tokenizer, out, stop),
        "prompt_tokens": prompt_tokens,
        "new_tokens": int(out.numel()),
        "finish_reason": finish_reason(out.tolist(), stop),
    }


def print_answers(
    texts: Sequence[str],
    outputs: Sequence[torch.Tensor],
    lengths: Sequence[int],
    tokenizer: Tokenizer,
    stop: Sequence[int],
    output: str,
) -> None:
    """The answers on stdout: one JSON object per line (`jsonl`), or one escaped line each (`text`, with each
    prompt under a `--- prompt i ---` header on stderr)."""
    for i, (text, out) in enumerate(zip(texts, outputs, strict=True)):
        if output == "jsonl":
            print(json.dumps(answer_record(i, tokenizer, out, lengths[i], stop), ensure_ascii=False), flush=True)
            continue
        print(f"--- prompt {i} ---\n{shorten_echo(text, lengths[i])}", file=sys.stderr, flush=True)
        print(escape_line(answer_text(tokenizer, out, stop)), flush=True)


def shorten_echo(text: str, tokens: int) -> str:
    """`text` as echoed on stderr: itself, or for a long prompt (more than `ECHO_LINES` lines or
    `ECHO_CHARS` characters) its first and last lines (at most `_KEPT_CHARS` characters each end) around a
    line giving its size in tokens and lines (the whole prompt is fed; only the echo is short)."""
    lines = text.splitlines()
    if len(lines) <= ECHO_LINES and len(text) <= ECHO_CHARS:
        return text
    if len(lines) > 3:
        head, tail = "\n".join(lines[:3]), "\n".join(lines[max(3, len(lines) - 3) :])
    else:
        head = tail = text
    if len(head) > _KEPT_CHARS:
        head = head[:_KEPT_CHARS] + "..."
    if len(tail) > _KEPT_CHARS:
        tail = "..." + tail[-_KEPT_CHARS:]
    marker = f"[... the prompt, {tokens} tokens in {len(lines)} lines, is shortened here; all of it is fed ...]"
    return f"{head}\n{marker}\n{tail}"
