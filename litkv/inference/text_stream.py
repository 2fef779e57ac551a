"""A reply's text as its tokens come: the one incremental detokenizer of `litkv generate`, `chat` and `serve`.

`TextStream.add(token)` gives the text that is safe to send after that token, `finish()` the rest. The
text sent so far is always a prefix of the decode of all the tokens so far (the tokenizer's whole-list
decode, so a word's leading space and a multi-token character come out as a decode of the reply would
give them), and:

- **no partial character**: while the decode ends with U+FFFD (a multi-byte character whose bytes have
  not all come), nothing more is sent; `finish` sends it as it is;
- **no partial stop string**: with `stops`, the text ends before the first occurrence of any of them
  (left out), and a tail that could still grow into one (`"<|us"` of `"<|user|>"`) is held back until
  the next token decides; with `newline`, the text ends after its first newline (kept);
- **final flush**: `finish` sends what was held back (an incomplete character, a tail that did not
  become a stop string).

`content` is the reply's text so far, cut at the stop (the whole text once `finish` ran); `stopped` says
a stop string (or the newline) ended it, after which `add` sends nothing.

Each call decodes the whole token list: a reply of `n` tokens costs `n` decodes of at most `n` tokens,
microseconds each next to a decode step, and exact for any tokenizer whose decode of a list depends on
more than its last tokens (SentencePiece's leading space, a multi-byte character split over tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["Decoder", "TextStream"]


class Decoder(Protocol):
    """What a stream needs of a tokenizer (LitGPT's `Tokenizer`): token ids `(T,)` to text."""

    def decode(self, tensor: torch.Tensor) -> str: ...


class TextStream:
    """The text of a reply, token by token, safe to send at every step.

    Args:
        tokenizer: decodes the reply's token ids (`decode(tensor (T,)) -> str`).
        stops: strings that end the reply's text (the first one found; left out). Empty ones are ignored.
        newline: end the text after its first newline (kept), as `litkv serve` does for raw text.
    """

    def __init__(self, tokenizer: Decoder, stops: Sequence[str] = (), newline: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.newline = newline
        self.ids: list[int] = []
        self.content = ""
        self.sent = 0  # characters of `content` handed out
        self.stopped = False

    @property
    def sent_text(self) -> str:
        """The text handed out so far."""
        return self.content[: self.sent]

    def add(self, token: int) -> str:
        """Take the next token; the new text safe to send (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(int(token))
        return self._update(final=False)

    def finish(self) -> str:
        """The text held back (an incomplete character, the start of a stop string that did not come); the
        last call of a stream."""
        if self.stopped:
            return ""
        return self._update(final=True)

    def _decode(self) -> str:
        return self.tokenizer.decode(torch.tensor(self.ids, dtype=torch.long)) if self.ids else ""

    def _update(self, final: bool) -> str:
        text = self._decode()
        if text.endswith("\ufffd") and not final:
            return ""  # the rest of a multi-byte character is still to come
        cut = self._cut(text)
        if cut is not None:
            self.content, self.stopped = text[:cut], True
            return self._send(cut)
        self.content = text
        return self._send(len(text) if final else len(text) - self._held(text))

    def _cut(self, text: str) -> int | None:
        """Where the text ends: before the first stop string, after the first newline; None: not yet."""
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if self.newline and "\n" in text:
            cuts.append(text.index("\n") + 1)
        return min(cuts, default=None)

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that begins a stop string (it may become one)."""
        return max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)

    def _send(self, upto: int) -> str:
        delta = self.content[self.sent : upto]
        self.sent = max(self.sent, upto)
        return delta
