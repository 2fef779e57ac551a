"""The conversation core's planning (litkv/inference/conversation.py) that chat and serve share: `runs`
against a brute-force grouping over every layout of up to 6 segments, `lossless_overflow` and
`check_recompute`. Feeding through it is covered end to end by tests/inference/test_conversation_blocks.py
(chat and serve with documents equal `generate_segments`) and tests/cli/test_chat_template.py."""

from __future__ import annotations

import itertools

import pytest

from litkv.inference.blocks import check_recompute
from litkv.inference.chat_template import TurnSegment
from litkv.inference.conversation import lossless_overflow, runs
from litkv.kvcache.config import KVCacheConfig

KINDS = {  # prompt text, a reply, a document, an empty reply (cut at once)
    "t": TurnSegment((1, 2), False),
    "r": TurnSegment((3,), True),
    "b": TurnSegment((4, 5), False, True),
    "e": TurnSegment((), True),
}


def reference_runs(segments: list[TurnSegment]) -> list[list[TurnSegment]]:
    """A block starts a run that takes every block after it and then one prompt text segment (not a reply)
    if one follows; any other segment is a run alone."""
    out: list[list[TurnSegment]] = []
    for seg in segments:
        last = out[-1] if out else None
        joins_documents = last is not None and last[0].block and all(s.block for s in last)
        if joins_documents and (seg.block or not seg.reply):
            last.append(seg)
        else:
            out.append([seg])
    return out


def test_runs_group_documents_with_the_text_after_them() -> None:
    for n in range(7):
        for layout in itertools.product("trbe", repeat=n):
            segments = [KINDS[k] for k in layout]
            got = runs(segments)
            assert [list(r.segments) for r in got] == reference_runs(segments), layout
            for run in got:
                assert run.ids == tuple(t for s in run.segments for t in s.ids)
                if run.segments[0].block:
                    assert run.documents == [s.ids for s in run.segments if s.block]
                    tail = run.segments[-1]
                    assert run.text == (None if tail.block else tail.ids)


def test_lossless_overflow_only_for_a_bounded_cache() -> None:
    dense = KVCacheConfig(policy="dense", cache_length=64)
    assert lossless_overflow(dense, 40, 24) is None and lossless_overflow(dense, 40, 25) == 64
    assert lossless_overflow(KVCacheConfig(policy="h2o", cache_length=64), 40, 10_000) is None


@pytest.mark.parametrize("bad", [True, -0.1, 1.5, "0.5", None, float("nan")])
def test_check_recompute_names_the_option(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^--recompute must be a fraction in \[0, 1\]"):
        check_recompute(bad, "--recompute")
    assert check_recompute(1) == 1.0 and isinstance(check_recompute(0), float)
