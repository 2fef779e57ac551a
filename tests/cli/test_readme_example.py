"""The README's Python example runs on the real model and prints what `litkv generate` prints for the same
request; `litkv.load` and `load_model` take the model's name. Skipped where the model is not downloaded
(`litkv download smollm2-135m-instruct`)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_model
from litkv.checkpoints.known import cache_dir
from litkv.modeling.fingerprint import model_fingerprint

REPO = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"
# what the README says the example is, on the command line
CLI = ["generate", NAME, "--chat_template", "false", "--temperature", "0", "--kv-cache", "h2o"]
CLI += ["--kv_cache.cache_length", "256", "--max_new_tokens", "2", "--prompt", "The capital of France is"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cache_dir(NAME).is_dir(), reason=f"{NAME} is not downloaded (litkv download {NAME})"),
]


def readme_example() -> str:
    """The README's first Python block that calls `litkv.load`."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), re.S)
    return next(block for block in blocks if "litkv.load(" in block)


def test_readme_python_example_prints_what_the_cli_prints(capsys: pytest.CaptureFixture[str]) -> None:
    code = readme_example()
    command = "litkv " + " ".join(CLI[:-1]) + f' "{CLI[-1]}"'
    assert command in " ".join((REPO / "README.md").read_text(encoding="utf-8").split())  # the README says so
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), namespace)
    main(list(CLI))
    assert printed.getvalue() == capsys.readouterr().out
    assert "Paris" in printed.getvalue()
    by_dir = load_model(cache_dir(NAME))  # the name and the directory load the same weights and gates
    assert model_fingerprint(load_model(NAME)) == model_fingerprint(by_dir) == model_fingerprint(namespace["model"])
    assert namespace["model"].eviction_gates is not None
