"""The order in which the suite's files run: its longest files first.

Under `--dist loadfile` (pyproject.toml's `addopts`) a pytest-xdist worker takes the next file in collection
order when it is done, so a long file left for the end runs alone while the other workers wait. xdist's own
default order (the files with the most tests first) left few-test, long files (servers, the GPU check's dry run)
for the end; `--no-loadscope-reorder` keeps this order instead. tests/conftest.py applies it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The longest files (by their tests' summed `--durations=0` times on a 2-core CPU), longest first; the other
# files follow in their usual order.
LONGEST_FIRST = (
    "modeling/test_compile.py",
    "kvcache/test_policy_conformance.py",
    "serve/test_serve.py",
    "kvcache/test_batch_invariance.py",
    "cli/test_gpu_check.py",
    "hf/test_hf_real_model.py",
    "checkpoints/test_real_model.py",
    "cli/test_evaluate_parallel.py",
    "cli/test_bench_serve.py",
    "cli/test_chat_cmd.py",
    "states/test_faults.py",
    "checkpoints/test_convert_gates.py",
    "cli/test_cli.py",
    "finetune/test_gate_checkpoints.py",
    "serve/test_serve_limits.py",
    "states/test_properties.py",
    "serve/test_batching.py",
    "cli/test_chat_template.py",
    "inference/test_template_limits.py",
    "inference/test_blocks_real_model.py",
)


def longest_first(items: list[pytest.Item], tests: Path) -> None:
    """Sort `items` in place: the files of `LONGEST_FIRST` (paths relative to `tests`) first, in its order; each
    file's tests stay together and in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_under(item.path, tests), len(rank)))


def _under(path: Path, folder: Path) -> str:
    """`path` relative to `folder` in POSIX form, or "" when it is not under it."""
    return path.relative_to(folder).as_posix() if path.is_relative_to(folder) else ""
