"""Chat template rendering under hard limits that hold inside one operation (issue 61, item 2).

The budget meters loops, calls and `* + ** %` and checks a call's result after building it; the probe
found single operations that allocate gigabytes or run for a minute before any check sees them
(`('{0:{1}}'*300).format('', 16000000)` 3 GB, `'%*s'` 2.8 GB, a `~` chain asking for 4 Gi characters,
`translate`, `expandtabs`, `join` 2-4 G, one `batch(1)` 47 s). A render now runs in a worker process
with an address-space limit (`MEMORY_BYTES`) and a wall-clock limit (`max_seconds + GRACE_SECONDS`):
each form is refused in one line naming the file, the caller's memory does not grow, and the next
render (in a fresh worker) is exact.
"""

from __future__ import annotations

import resource
import threading
import time
from pathlib import Path

import pytest

from litkv.inference import template_worker
from litkv.inference.chat_template import ChatTemplate, ChatTemplateError

SMOLLM2 = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_BIG = "'x' * 16000000"
PROBES = {
    "format widths": "{{ ('{0:{1}}' * 300).format('', 16000000) }}",
    "percent star": "{{ ('%*s' * 300) % ((16000000, '') * 300) }}",
    "tilde chain": "{% set s = " + _BIG + " %}{{ " + " ~ ".join(["s"] * 256) + " }}",
    "translate": "{{ ('x' * 1000000).translate({120: 'y' * 4000}) }}",
    "expandtabs": "{{ ('\\t' * 1000000).expandtabs(4000) }}",
    "join": "{{ ('y' * 4000).join('x' * 1000000) }}",
    "batch(1) over a long string": "{{ (" + _BIG + ")|batch(1)|reject|first }}",  # 19 s loaded, 5.5 s idle here
    "batch(1) into a list": "{% for b in (" + _BIG + ")|batch(1)|list %}{% endfor %}",
}
LIMIT_S = 5.0 + template_worker.GRACE_SECONDS  # the budget's max_seconds + the grace


def _maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@pytest.mark.parametrize("name", sorted(PROBES))
def test_each_probe_form_is_refused_within_the_limits(tmp_path: Path, name: str) -> None:
    path = tmp_path / "tokenizer_config.json"
    template = ChatTemplate(PROBES[name], path)
    template.budget.max_steps = 10**12  # the steps would stop `batch` too: the hard limits must hold alone
    rss = _maxrss_kib()
    start = time.monotonic()
    try:  # one batch(1) step over the most items the budget lets through may finish inside the limits on a
        # fast CPU (5.5 s on an idle development machine, 19 s loaded): then only the limits are asserted
        template.render([("user", "hello")], add_generation_prompt=True)
        message = None
    except ChatTemplateError as err:
        message = str(err)
    took = time.monotonic() - start
    if message is not None or not name.startswith("batch(1)"):
        assert message is not None and message.startswith(str(path)) and "refused" in message, message
        assert "\n" not in message, message
    assert took < LIMIT_S + 3, took
    assert _maxrss_kib() - rss < 200_000  # the caller: under 200 MB more (the worker took the blow)
    # the worker was replaced or kept: the next render is exact
    assert ChatTemplate(SMOLLM2, path).render([("user", "hi")], True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_takes_the_whole_memory_limit_is_stopped(tmp_path: Path) -> None:
    """Memory taken by an operation the budget does not meter: a MemoryError in the worker (or its death)."""
    tuple_of_s = "(" + ", ".join(["s"] * 300) + ")"  # 300 strings of 16 M characters: 4.8 G in one `%`
    source = "{% set s = " + _BIG + " %}{{ (('%s' * 300) % " + tuple_of_s + ")|length }}"
    template = ChatTemplate(source, tmp_path / "t.json")
    with pytest.raises(ChatTemplateError, match="more than 1024 MiB of memory"):
        template.render([("user", "hello")], add_generation_prompt=True)


def test_a_stuck_render_is_killed_at_the_wall_clock_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ChatTemplate(SMOLLM2, tmp_path / "t.json").render([("user", "hi")], True)  # the worker started
    monkeypatch.setattr(template_worker, "GRACE_SECONDS", 0.05)
    template = ChatTemplate(PROBES["batch(1) over a long string"], tmp_path / "t.json")
    template.budget.max_seconds = 0.05  # 16 M Python-level steps in one operation outlast 0.1 s on any CPU
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"ran longer than 0.1 s \(stopped\)"):
        template.render([("user", "hello")], add_generation_prompt=True)
    assert time.monotonic() - start < 3


def test_renders_from_threads_each_get_their_answer(tmp_path: Path) -> None:
    template = ChatTemplate(SMOLLM2, tmp_path / "t.json")
    template._cache = None  # every call renders
    got: dict[int, str] = {}

    def one(i: int) -> None:
        got[i] = template.render([("user", f"message {i}")], False)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {i: f"<|im_start|>user\nmessage {i}<|im_end|>\n" for i in range(8)}
