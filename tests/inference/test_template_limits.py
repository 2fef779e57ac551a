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
    # no step, little memory, time in proportion: ten times the 16 M characters that ran 19 s on a loaded
    # 2-core machine (and under the limit on an idle one), so that any CPU outlasts the wall-clock limit
    "batch(1) over a long string": "{{ ('x' * 160000000)|batch(1)|reject|first }}",
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
    with pytest.raises(ChatTemplateError) as err:
        template.render([("user", "hello")], add_generation_prompt=True)
    took = time.monotonic() - start
    message = str(err.value)
    assert message.startswith(str(path)) and "refused" in message and "\n" not in message, message
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
    monkeypatch.setattr(template_worker, "GRACE_SECONDS", 1.0)
    template = ChatTemplate(PROBES["batch(1) over a long string"], tmp_path / "t.json")
    template.budget.max_seconds = 1.0
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"ran longer than 2 s \(stopped\)"):
        template.render([("user", "hello")], add_generation_prompt=True)
    assert time.monotonic() - start < 4


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
