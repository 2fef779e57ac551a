"""Argument errors answered before torch is imported (`litkv.cli.preflight`): a typo in a policy name, an
option name, a number, an input file or a model name gets its one-line error from a process that has not
imported torch (nor jsonargparse, nor the command); what the command accepts is not refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from litkv.__main__ import normalize_argv
from litkv.cli import preflight
from litkv.cli.preflight import check, command_options, known_policy_names

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "jsonargparse", "litgpt", "litkv.cli.generate_cmd")


def run_main(argv: list[str], cwd: Path) -> tuple[int, str, list[str]]:
    """`litkv ARGV` in a fresh interpreter: (exit status, stderr, which of `HEAVY` it had imported at the end)."""
    code = (
        "import json, sys\nfrom litkv.__main__ import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
        f"print(json.dumps([code, sorted(m for m in {HEAVY!r} if m in sys.modules)]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    status, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    return status, proc.stderr, heavy


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["generate", "--kv-cache", "h20"], "unknown KV cache policy 'h20'; known policies: dense,"),
        (["chat", "--kv_cache.policy", "snapk"], "snapkv, tova; did you mean snapkv?"),
        (["generate", "--max_new_tokenz", "5"], "has no option --max_new_tokenz; did you mean --max_new_tokens?"),
        (["generate", "--to", "5"], "--to is ambiguous; it could be --top_k, --top_p"),
        (["generate", "--max-new-tokens", "-5"], "--max_new_tokens must be an int >= 0, got -5"),
        (["generate", "--temperature", "warm"], "--temperature takes a number, got 'warm'"),
        (["generate", "--top_p", "0"], "--top_p must be a float in (0, 1] or null, got 0"),
        (["serve", "--max_batch", "0"], "--max_batch must be an int >= 1, got 0"),
        (["generate", "--kv_cache.cache_length", "1.5"], "--kv_cache.cache_length takes an int, got '1.5'"),
        (["generate", "--prompt_file", "missing.txt"], "prompt file 'missing.txt' does not exist"),
        (["generate", "--prompt", "hi", "--block_file", "a.txt"], "block file 'a.txt' does not exist"),
        (["generate", "smollm2-135m", "--prompt", "hi"], "did you mean smollm2-135m-instruct?"),
        (["evaluate", "--polices", "h2o"], "did you mean --policies"),
        (["generate", "no/such/dir"], "checkpoint directory 'no/such/dir' does not exist"),
        (["generate", "--output", "json"], "--output must be one of text, jsonl, got 'json'; did you mean jsonl?"),
    ],
)
def test_a_typo_is_answered_before_torch_is_imported(argv: list[str], said: str, tmp_path: Path) -> None:
    status, err, heavy = run_main(argv, tmp_path)
    assert status == 1 and heavy == [], (err, heavy)
    assert err.startswith("error: ") and said in err and err.count("\n") == 1, err


def test_the_unknown_model_names_the_known_ones(tmp_path: Path) -> None:
    status, err, _ = run_main(["generate", "smollm2-135m"], tmp_path)
    assert "'smollm2-135m' is neither an existing directory nor a known model name" in err
    assert "known models: smollm2-135m-instruct" in err and "litkv download NAME" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--max_new_tokens", "0", "--top_k", "null", "--top_p", "1", "--temperature", "0"],
        ["generate", "--max_new", "5"],  # an abbreviation argparse accepts
        ["generate", "--kv-cache", "h2o", "--kv_cache.sinks", "4", "--kv_cache.cache_length", "64"],
        ["generate", "--kv_cache.policy", "my_package.policies:MyCache"],
        ["generate", "--kv_cache", "{policy: h2o}"],
        ["evaluate", "--policy_options.keydiff.recent", "4", "--policies", "[h2o]"],
        ["generate", "--prompt", "a", "--prompt", "--looks-like-an-option"],
        ["generate", "--compile", "--prompt", "hi", "--seed", "-3"],
        ["convert", "src", "out", "--overwrite", "true"],
        ["download", "smollm2-135m-instruct"],
    ],
)
def test_what_the_command_takes_is_not_refused(argv: list[str]) -> None:
    check(normalize_argv(argv))


def test_an_existing_file_and_directory_pass(tmp_path: Path) -> None:
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello", encoding="utf-8")
    check(normalize_argv(["generate", str(tmp_path), "--prompt_file", str(prompt), "--block_file", str(prompt)]))
    with pytest.raises(ValueError, match="is a directory; it must be a file"):
        check(normalize_argv(["generate", "--prompt_file", str(tmp_path)]))


def test_options_and_types_are_read_from_the_stored_help() -> None:
    options = command_options("generate")
    assert options["--max_new_tokens"] == "int" and options["--top_k"] == "int | None"
    assert options["--kv_cache.policy"] == "str" and options["--prompt"] == "Optional[list[str]]"
    assert "--kv_cache.options" in options and command_options("no-such-command") == {}


def test_number_ranges_are_the_commands_own() -> None:
    """Every bound of `NUMBER_RANGES` refuses what the command's own check refuses, and takes what it takes."""
    from litkv.cli.generate_cmd import fit_cache  # noqa: F401  (the command's module imports)
    from litkv.inference.sampling import check_sampling
    from litkv.modeling.config import KVCacheConfig

    sampling = {"max_new_tokens": 1, "temperature": 0.5, "top_k": 5, "top_p": 0.9}
    for name, edge, bad in [
        ("max_new_tokens", 0, -1),
        ("temperature", 0.0, -0.1),
        ("top_k", 1, 0),
        ("top_p", 1.0, 0.0),
    ]:
        check_sampling(**{**sampling, name: edge})
        with pytest.raises(ValueError):
            check_sampling(**{**sampling, name: bad})
        check(["generate", f"--{name}", str(edge)])
        with pytest.raises(ValueError, match=f"--{name} must be"):
            check(["generate", f"--{name}", str(bad)])
    for name in ("cache_length", "chunk_size", "quant_group_size"):
        with pytest.raises(ValueError):
            KVCacheConfig(**{name: 0})
        with pytest.raises(ValueError, match=f"--kv_cache.{name} must be >= 1, got 0"):
            check(["generate", f"--kv_cache.{name}", "0"])


def test_stored_policy_names_are_the_registered_ones() -> None:
    """`litkv/assets/help/policies.txt` is what `scripts/update_help.py` writes from the registry."""
    from litkv.kvcache import get_kv_cache_class, known_policies

    # the built-ins: policies other tests registered in this process are not stored
    builtin = [n for n in known_policies() if get_kv_cache_class(n).__module__.startswith("litkv.")]
    assert list(known_policy_names()) == builtin
    assert preflight.POLICIES_FILE.parent == preflight.HELP_DIR
