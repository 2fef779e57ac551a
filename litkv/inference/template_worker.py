"""Chat templates rendered in a child process under hard limits: address space and wall-clock time.

The in-process budget (`litkv.inference.template_sandbox`) meters steps and checks sizes, but one Python
operation (`str.format` with 300 wide fields, `'%*s'`, a `~` chain, `translate`, `expandtabs`, `join`, a
filter such as `batch`) allocates or runs before any check sees it. So a render runs in a worker process:

- **Memory**: the worker sets `RLIMIT_AS` to its size at rest plus `MEMORY_BYTES` before it renders
  anything; an allocation over it fails inside the worker (a `MemoryError`, or the worker dies), never in
  the caller.
- **Time**: the caller waits at most the budget's `max_seconds` plus `GRACE_SECONDS` for an answer; a
  worker that has not answered by then is killed.

Either way the render is refused with one line (`TemplateRefused`) and the next render starts a fresh
worker, so `generate`, `chat` and serve's inference worker never block past the limit nor die of a
template. One worker serves a process (renders are serialised by a lock; a forked child starts its own);
it imports only Jinja and the sandbox, starts once (about a tenth of a second), and exits when its
caller closes its input (at exit, or when the caller dies).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from litkv.inference.template_sandbox import Budget

__all__ = ["GRACE_SECONDS", "MEMORY_BYTES", "TemplateFailed", "TemplateRefused", "render_in_worker"]

#: Address space a render may take beyond the worker's size at rest.
MEMORY_BYTES = 1 << 30
#: Seconds the caller waits beyond a budget's `max_seconds` (the worker's start included).
GRACE_SECONDS = 5.0
_READY = b"ready\n"


class TemplateRefused(Exception):
    """A render over a limit (budget, memory or time); the message is one line."""


class TemplateFailed(Exception):
    """A template that raised an error of its own (a bad attribute, `raise_exception`); one line."""


def raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def tojson(value: object, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def compile_template(source: str) -> Any:
    """`source` compiled in the metered sandbox with transformers' globals (`raise_exception`,
    `strftime_now`, the `tojson` filter)."""
    from litkv.inference.template_sandbox import compile_bounded, make_sandbox

    env = make_sandbox()
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    return compile_bounded(env, source)


# -- the worker (child process) ----------------------------------------------------------------------


def _limit_memory(extra: int) -> None:
    """`RLIMIT_AS` = this process's present address space + `extra` bytes (where the platform has it)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (size + extra, size + extra))
    except (ImportError, OSError, ValueError):
        pass  # no /proc or no RLIMIT_AS: the time limit still holds


def _answer(request: dict[str, Any], templates: dict[str, Any]) -> dict[str, str]:
    from jinja2 import TemplateError

    from litkv.inference.template_sandbox import BudgetExceeded, render_bounded

    try:
        source = request["source"]
        if source not in templates:
            templates.clear()  # one template at a time in practice; never an unbounded cache
            templates[source] = compile_template(source)
        budget = Budget(*request["budget"])
        return {"text": render_bounded(templates[source], budget, **request["variables"])}
    except BudgetExceeded as err:
        return {"refused": one_line(err)}
    except MemoryError:
        return {"refused": f"the chat template took more than {MEMORY_BYTES >> 20} MiB of memory"}
    except (RecursionError, OverflowError) as err:
        return {"refused": f"{type(err).__name__} in the chat template"}
    except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError) as err:
        return {"failed": one_line(err)}


def main() -> None:
    """The worker's loop: one JSON request per line on stdin, one JSON answer per line on stdout."""
    _limit_memory(int(sys.argv[1]) if len(sys.argv) > 1 else MEMORY_BYTES)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(_READY)
    stdout.flush()
    templates: dict[str, Any] = {}
    for line in stdin:
        try:
            answer = _answer(json.loads(line), templates)
            out = json.dumps(answer).encode() + b"\n"
        except MemoryError:
            out = json.dumps({"refused": f"the chat template took more than {MEMORY_BYTES >> 20} MiB"}).encode()
            out += b"\n"
        stdout.write(out)
        stdout.flush()


# -- the caller --------------------------------------------------------------------------------------


class _Worker:
    """The process's worker: started on first use, restarted after it was killed or died."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0  # the process that started `proc` (a forked child starts its own)

    def _start(self) -> subprocess.Popen[bytes]:
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        code = "from litkv.inference.template_worker import main; main()"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(MEMORY_BYTES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        if self.pid == 0:
            atexit.register(self.stop)
        self.proc, self.pid = proc, os.getpid()
        return proc

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and self.pid == os.getpid():
            proc.kill()
            proc.wait()

    def _read_line(self, proc: subprocess.Popen[bytes], deadline: float) -> bytes | None:
        """One line from the worker; `None` at the deadline or when it died."""
        fd, chunks = proc.stdout.fileno(), []  # type: ignore[union-attr]
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks)

    def render(self, source: str, variables: dict[str, Any], budget: Budget) -> str:
        request = json.dumps({"source": source, "variables": variables, "budget": _budget_args(budget)})
        limit = budget.max_seconds + GRACE_SECONDS
        with self.lock:
            deadline = time.monotonic() + limit
            proc = self.proc if self.proc is not None and self.pid == os.getpid() else None
            if proc is None or proc.poll() is not None:
                proc = self._start()
                if self._read_line(proc, deadline) != _READY:
                    self.stop()
                    raise TemplateRefused(f"the chat template's worker did not start within {limit:g} s")
            try:
                proc.stdin.write(request.encode() + b"\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                self.stop()
                raise TemplateRefused("the chat template's worker stopped") from None
            line = self._read_line(proc, deadline)
            if line is None:
                timed_out = proc.poll() is None
                self.stop()
                if timed_out:
                    raise TemplateRefused(f"the chat template ran longer than {limit:g} s (stopped)")
                raise TemplateRefused(f"the chat template took more than {MEMORY_BYTES >> 20} MiB of memory (stopped)")
        answer = json.loads(line)
        if "text" in answer:
            return answer["text"]
        if "refused" in answer:
            raise TemplateRefused(answer["refused"])
        raise TemplateFailed(answer.get("failed", "unknown error"))


def _budget_args(budget: Budget) -> list[float | int]:
    return [budget.max_steps, budget.max_chars, budget.max_seconds]


_WORKER = _Worker()  # nothing starts before the first render


def render_in_worker(source: str, variables: dict[str, Any], budget: Budget) -> str:
    """`source` rendered with `variables` (JSON values) in the worker, under `budget` and the worker's
    hard limits (module docstring).

    Raises:
        TemplateRefused: over the budget, `MEMORY_BYTES` or the time limit (one line).
        TemplateFailed: the template's own error (one line).
    """
    return _WORKER.render(source, variables, budget)


if __name__ == "__main__":
    main()
