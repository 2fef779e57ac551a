"""A fork server for fault-injection tests: real `litkv` processes without paying the imports each time.

Run as `python fork_server.py`; it imports litkv's CLI (torch, lightning, litgpt) once, prints `ready`,
then reads one JSON request per line on stdin:

- `{"run": [argv...], "stdin": FILE, "stdout": FILE, "stderr": FILE}`: fork a child that runs
  `litkv.__main__.main(argv)` with those files as its standard streams; the server prints the pid;
- `{"wait": PID}`: reap the child; prints `{"pid": PID, "code": exit status or -signal}`.

The children are real litkv processes (the CLI entry point, its own signal handling, its own files);
the test kills them with `os.kill(pid, SIGKILL)`. The server never computes with torch before it
forks, so no thread pool is inherited half-initialised.
"""

from __future__ import annotations

import json
import os
import sys


def _child(job: dict) -> None:
    """In the forked child: the given files as stdin/stdout/stderr, then the litkv CLI."""
    from litkv.__main__ import main

    for fd, name, flags in (
        (0, job["stdin"], os.O_RDONLY),
        (1, job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(name, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own stream)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    code = 0
    try:
        main(job["run"])
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:  # noqa: BLE001 (report and exit like an uncaught exception)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def serve() -> None:
    import torch

    torch.set_num_threads(1)
    from litgpt.tokenizer import Tokenizer  # noqa: F401

    import litkv.cli.chat_cmd  # noqa: F401 (imported once, before forking)
    import litkv.cli.finetune_cmd  # noqa: F401

    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if "wait" in job:
            _, status = os.waitpid(job["wait"], 0)
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
            print(json.dumps({"pid": job["wait"], "code": code}), flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            _child(job)
        print(pid, flush=True)


if __name__ == "__main__":
    serve()
