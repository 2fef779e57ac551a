"""A chat session: one conversation (`litkv.inference.conversation.Conversation`, batch of one) as `litkv chat`
runs it, its turns (for `/undo`), documents attached to the next message, and its session file.

**The session file** is a cache state file (`litkv.states.state.CacheState.save`: the caches, the token
history) whose safetensors metadata holds, under `CHAT_METADATA`, the chat's data as JSON: `{"turns":
[tokens of each turn], **Conversation.layout()}` (format, prefix, segments, messages, documents). A file
without it (`snapshot(...).save`) or with an earlier litkv's (turn sizes only) loads as a prefix the
conversation goes on after; invalid data is one warning, the tokens are kept. A save never replaces a
regular file that is not a litkv state file.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from litkv.core.validation import read_text_file
from litkv.inference.blocks import encode_document
from litkv.inference.chat_template import Format, RawFormat
from litkv.inference.conversation import Conversation
from litkv.inference.sampling import Sampling
from litkv.inference.text_stream import TextStream
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.model import GPT
from litkv.states.block_store import BlockStore
from litkv.states.state import CacheState, restore, snapshot
from litkv.states.state_file import read_state_header
from litkv.states.undo import truncate

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

__all__ = ["BLOCK_STORE_BYTES", "CHAT_METADATA", "ChatSession", "read_layout", "read_turns"]

BLOCK_STORE_BYTES = 1 << 30  # documents' KV kept in memory by a chat
#: Safetensors metadata key of a session file's chat data: `{"turns": [tokens of each turn], ...}` as JSON.
CHAT_METADATA = "litkv_chat"


class ChatSession:
    """The chat's side of a conversation (`litkv.inference.conversation.Conversation`, batch of one): the turn as
    the terminal runs it, `/undo` (turn boundaries), `/save`, `/load`, `/stats`.

    Args:
        model: the GPT (caches are attached to it for the session's life).
        tokenizer: LitGPT's tokenizer of the checkpoint.
        kv_cache: the cache config of every layer.
        undo_depth: calls (prefill chunks and decode steps) the undo log keeps; `/undo` of a turn
            with an evicting policy needs the turn's calls in it.
        fmt: how messages become tokens (default: raw text, `RawFormat`).
        blocks: where attached documents' KV is kept (default: in memory, `BLOCK_STORE_BYTES`).
        recompute: the fraction of each spliced document's tokens recomputed in context.
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        kv_cache: KVCacheConfig,
        undo_depth: int = 1024,
        fmt: Format | None = None,
        blocks: BlockStore | None = None,
        recompute: float = 0.0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.undo_depth = undo_depth
        blocks = BlockStore(BLOCK_STORE_BYTES) if blocks is None else blocks
        self.conversation = Conversation(model, fmt or RawFormat(tokenizer), kv_cache, undo_depth, blocks, recompute)
        self.attached: list[tuple[int, ...]] = []  # documents of the next user message
        self.loaded_turns = 0  # turns restored from a file: their undo history is not in the log
        self.interrupted = False

    @property
    def kv_cache(self) -> KVCacheConfig:
        return self.conversation.kv_cache

    @property
    def next_pos(self) -> int:
        return self.conversation.next_pos

    @property
    def history(self) -> list[int]:
        return self.conversation.history

    @property
    def turns(self) -> list[int]:
        """Tokens of each turn (the user's segment and the reply)."""
        return self.conversation.turn_sizes()

    def reset(self) -> None:
        """Empty caches, history and turns (and documents attached for the next message)."""
        self.conversation.reset()
        self.loaded_turns = 0
        self.attached = []

    def attach(self, path: Path) -> str:
        """Attach the text of `path` as a document (a KV block) to the next user message."""
        text = read_text_file("document file", path)  # a directory, a FIFO or a binary file: said so
        self.attached.append(encode_document(self.tokenizer, text, f"document {str(path)!r}"))
        return (
            f"attached {path} ({len(self.attached[-1])} tokens) to the next message ({len(self.attached)} document(s))"
        )

    # -- a turn ---------------------------------------------------------------------------------

    def turn(
        self, text: str, max_new_tokens: int, sampling: Sampling, out: TextIO, stop_at_newline: bool = True
    ) -> list[int]:
        """Append the user's `text` to the session (in the conversation's format) and stream the reply to `out`;
        the reply's tokens are picked by `sampling` (give it a `generator` to go on drawing across turns).

        Returns:
            The reply's token ids (all of them are in the caches when this returns).
        """
        conv = self.conversation
        messages, replies = [*conv.messages, ("user", text)], [*conv.replies, None]
        documents = {**conv.documents, **({len(conv.messages): tuple(self.attached)} if self.attached else {})}
        pending = conv.prepare(messages, replies, documents)
        conv.check_room(pending, max_new_tokens)
        hidden = conv.feed(pending, messages, replies, documents)
        self.attached = []
        reply: list[int] = []
        stream = TextStream(self.tokenizer)
        tokens = conv.reply(hidden, max_new_tokens, sampling)
        while not self.interrupted:
            token = next(tokens, None)
            if token is None:
                break
            reply.append(token)
            _write(out, stream.add(token))
            if stop_at_newline and "\n" in self.tokenizer.decode(torch.tensor([token])):
                break
        tokens.close()
        _write(out, stream.finish())
        if stream.sent_text and not stream.sent_text.endswith("\n"):
            _write(out, "\n")  # the reply's line ends
        shown = reply[:-1] if reply and reply[-1] in conv.format.stop_ids else reply
        conv.end_reply(self.tokenizer.decode(torch.tensor(shown, dtype=torch.long)) if shown else "")
        return reply

    # -- commands -------------------------------------------------------------------------------

    def undo(self) -> str:
        turns = self.turns
        if not turns:
            return "nothing to undo"
        n = turns[-1]
        try:
            truncate(self.model, n)
        except ValueError as err:
            raise ValueError(self._undo_error(n)) from err
        self.conversation.drop_last_turn()
        self.loaded_turns = min(self.loaded_turns, len(turns) - 1)
        return f"rolled back the last turn ({n} tokens)"

    def _undo_error(self, n: int) -> str:
        """Why the last turn cannot be rolled back, in terms of the chat's options."""
        if len(self.turns) <= self.loaded_turns:
            return (
                f"cannot undo this turn ({n} tokens): it was loaded from a file, and a {self.kv_cache.policy} cache "
                "can only roll back turns taken since (a dense cache can roll back any turn)"
            )
        return (
            f"cannot undo this turn ({n} tokens): it took more calls than the undo log keeps "
            f"(--undo_depth {self.undo_depth}); restart with a larger --undo_depth"
        )

    def save(self, path: Path) -> str:
        """Write the session (caches, token history, messages and their segments) to `path`, atomically."""
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"cannot save to {str(path)!r}: it is a directory; give a file name")
        check_not_foreign(path)
        history = self.history
        state = snapshot(self.model, device="cpu", token_ids=[history])
        data = {"turns": self.turns, **self.conversation.layout()}
        state.save(path, extra_metadata={CHAT_METADATA: json.dumps(data)})
        return f"saved {len(history)} tokens to {path} ({state.nbytes() / 2**20:.2f} MiB of state)"

    def load(self, path: Path) -> str:
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"cannot load {str(path)!r}: it is a directory, not a session file")
        state = CacheState.load(path)
        if state.batch_size != 1:
            raise ValueError(f"{path} holds {state.batch_size} rows; a chat session has one")
        history = list(state.token_ids[0]) if state.token_ids else []
        layout = read_layout(path)
        restore(self.model, state)
        self.conversation.kv_cache = state.configs[0]
        try:
            self.conversation.resume(history, layout)
        except (TypeError, ValueError):
            message = f"{path}: its conversation data is invalid; its tokens are kept, /undo starts here"
            warnings.warn(message, stacklevel=2)
            self.conversation.resume(history, None)
        self.loaded_turns = len(self.turns)
        return f"loaded {len(history)} tokens ({self.loaded_turns} turns) from {path} (policy {self.kv_cache.policy})"

    def stats(self) -> str:
        caches = self.model.kv_caches
        held = int((caches[0].positions[0, 0] >= 0).sum())
        cache_bytes = sum(c.nbytes() for c in caches)
        return (
            f"tokens seen: {self.next_pos} | turns: {len(self.turns)} | slots held: {held} of "
            f"{caches[0].cache_length} per layer and head | cache: {self.kv_cache.policy}, "
            f"{cache_bytes / 2**20:.2f} MiB | documents: {self.conversation.blocks.hits} pieces restored, "
            f"{self.conversation.blocks.misses} computed"
        )


def _write(out: TextIO, text: str) -> None:
    if text:
        out.write(text)
        out.flush()


def _chat_metadata(path: Path) -> str | None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return (f.metadata() or {}).get(CHAT_METADATA)


def read_turns(path: Path, history: int) -> list[int]:
    """The turn sizes stored in a session file; `[]` (with a warning) when absent or inconsistent."""
    raw = _chat_metadata(path)
    if raw is None:
        return []  # saved by `snapshot(...).save` or an earlier litkv: no turns to undo
    try:
        turns = json.loads(raw)["turns"]
    except (json.JSONDecodeError, KeyError, TypeError):
        turns = None
    valid = isinstance(turns, list) and all(type(t) is int and t >= 1 for t in turns) and sum(turns) <= history
    if not valid:
        warnings.warn(f"{path}: its turn boundaries are invalid ({raw[:80]!r}); /undo starts from here", stacklevel=2)
        return []
    return turns


def read_layout(path: Path) -> dict[str, object] | None:
    """The conversation layout a session file holds (`Conversation.layout`), or `None` without one."""
    raw = _chat_metadata(path)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and "segments" not in data and "turns" in data:
        return None  # an earlier litkv's file: turn sizes only; its tokens are a prefix
    return data if isinstance(data, dict) else {"invalid": raw[:80]}


def check_not_foreign(path: Path) -> None:
    """ValueError when `path` is a regular file that is not a litkv session (a save never replaces a
    file of the user's: only an earlier session, or a device such as /dev/null, is written over)."""
    if not path.is_file():
        return
    try:
        read_state_header(path)
    except (OSError, ValueError):
        raise ValueError(
            f"cannot save to {str(path)!r}: it exists and is not a litkv session; give a new file name"
        ) from None
