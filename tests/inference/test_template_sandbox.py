"""Chat templates render under a budget (issue 50, item 1): a template is data from a downloaded
checkpoint; one that loops or grows without end is refused in one line naming its file, in bounded time
and memory, and a conversation rendered twice is rendered once.

Before the fix the first case reached a MemoryError at 5.8 GB.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

import litkv.inference.chat_template as chat_template
from litkv.inference.chat_template import ChatTemplate, ChatTemplateError

SMOLLM2 = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GROWING = {
    "nested loops writing": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "nested loops silent": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "loops over messages": "{% for a in messages %}{% for b in range(99999) %}{% for c in range(99999) %}"
    "{{ a.content }}{% endfor %}{% endfor %}{% endfor %}",
    "doubling a namespace": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "doubling by +": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "string repeat": "{{ 'a' * 10000000000 }}",
    "list repeat": "{{ ([1] * 100000000)|length }}",
    "center filter": "{{ 'x'|center(1000000000) }}",
    "indent filter": "{{ 'x\\ny'|indent(1000000000) }}",
    "percent width": "{{ '%0999999999d' % 1 }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "ljust method": "{{ 'x'.ljust(1000000000) }}",
    "replace growth": "{{ ('x' * 9000000).replace('x', 'yy') }}",
    "power": "{{ (2 ** 100000000) % 7 }}",
    "macro doubling": "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}"
    "{% endmacro %}{{ f('ab', 60) }}",
    "macro recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


@pytest.mark.parametrize("name", sorted(GROWING))
def test_a_growing_template_is_refused_in_one_line_naming_its_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / "tokenizer_config.json"
    template = ChatTemplate(GROWING[name], path)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError) as err:
        template.render([("user", "hello")], add_generation_prompt=True)
    assert time.perf_counter() - start < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 1_500_000  # under 1.5 GB more
    message = str(err.value)
    assert message.startswith(str(path)) and "\n" not in message, message


def test_budget_leaves_real_templates_alone(tmp_path: Path) -> None:
    """A long legitimate conversation (200 turns, 2 MB of text) renders exactly as jinja renders it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [("user" if i % 2 == 0 else "assistant", f"message {i} " + "word " * 2000) for i in range(200)]
    ours = ChatTemplate(SMOLLM2, tmp_path / "t.json").render(messages, True)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain = env.from_string(SMOLLM2).render(messages=[{"role": r, "content": c} for r, c in messages],
                                            add_generation_prompt=True)  # fmt: skip
    assert ours == plain and len(ours) > 2_000_000


def test_a_conversation_rendered_again_is_rendered_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = chat_template.render_in_worker

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(chat_template, "render_in_worker", counting)
    template = ChatTemplate(SMOLLM2, tmp_path / "t.json")
    conversation = [("user", "hi"), ("assistant", "hello"), ("user", "and?")]
    first = template.render(conversation, True)
    assert template.render(list(conversation), True) == first and len(calls) == 1
    assert template.render(conversation, False) != first and len(calls) == 2
    clock = ChatTemplate("{{ strftime_now('%S.%f') }}" + SMOLLM2, tmp_path / "t.json")
    clock.render(conversation, True)
    clock.render(conversation, True)
    assert len(calls) == 4  # a template that reads the clock is rendered every time
