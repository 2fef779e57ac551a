"""The `litkv` command line: each command, and each bad input as a one-line error without traceback.

Bad inputs run `main()` in-process (fast); a few runs go through a real `python -m litkv` subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_checkpoint import make_tiny_checkpoint

from litkv.__main__ import main, normalize_argv
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.cli.answers import escape_line
from litkv.inference.generate import generate
from litkv.inference.sampling import Sampling
from litkv.kvcache import get_kv_cache_class, known_policies
from litkv.kvcache.config import KVCacheConfig

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox"


def start_cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("LITKV_DEBUG", None)
    cmd = [sys.executable, "-m", "litkv", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _make_hf_llama(hf_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tiny_checkpoint import train_tiny_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=384,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    train_tiny_tokenizer(hf_dir)


GEN_ARGS = ("--kv-cache", "h2o", "--kv_cache.cache_length", "16", "--kv_cache.chunk_size", "8", "--prompt", PROMPT)
EVAL_ARGS = ("--policies", "[h2o]", "--budgets", "[16]", "--window", "48", "--num_windows", "2")


@pytest.fixture(scope="module")
def procs(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """All `python -m litkv` subprocesses of this file, started at once so that their imports overlap."""
    work = tmp_path_factory.mktemp("cli")
    _make_hf_llama(work / "hf")
    text = str(REPO / "litkv" / "modeling" / "model.py")
    commands = {
        "generate": ("generate", str(ckpt), *GEN_ARGS, "--max_new_tokens", "40", "--temperature", "0"),
        "bad_input": ("generate", str(work / "nope"), "--kv-cache", "h2o"),
        "convert": ("convert", str(work / "hf"), str(work / "lit")),
        "evaluate": ("evaluate", str(ckpt), "--text_file", text, *EVAL_ARGS, "--out_dir", str(work / "eval")),
        "finetune": ("finetune", "--help"),
        "bench": ("bench", "--help"),
    }
    started = {name: (start_cli(*args), work) for name, args in commands.items()}
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def main_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    """Run `main(args)` in-process; it must exit with status 1 and print exactly one `error:` line."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    assert exc.value.code == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- argument rewriting ---------------------------------------------------------------------------


def test_normalize_argv() -> None:
    assert normalize_argv(["generate", "--kv-cache", "h2o"]) == ["generate", "--kv_cache.policy", "h2o"]
    assert normalize_argv(["generate", "--kv_cache", "last-recent"]) == ["generate", "--kv_cache.policy", "last-recent"]
    assert normalize_argv(["generate", "--kv-cache=h2o"]) == ["generate", "--kv_cache.policy", "h2o"]
    assert normalize_argv(["generate", "--kv_cache", "kv.yaml"]) == ["generate", "--kv_cache", "kv.yaml"]
    assert normalize_argv(["generate", "--kv-cache.cache-length", "8", "--max-new-tokens=3"]) == [
        "generate",
        "--kv_cache.cache_length",
        "8",
        "--max_new_tokens=3",
    ]
    assert normalize_argv(["generate", "d", "--prompt", "a b", "--seed", "1", "--prompt=--c"]) == [
        "generate",
        "--prompt",
        '["a b", "--c"]',
        "--seed",
        "1",
        "--checkpoint_dir",
        "d",
    ]


# -- generate -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_subprocess_streams_greedy_text(ckpt: Path, procs) -> None:
    proc = finish(procs["generate"][0])
    assert proc.returncode == 0, proc.stderr
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    kv = KVCacheConfig(policy="h2o", cache_length=16, chunk_size=8)
    expected = generate(model, [tok.encode(PROMPT).long()], 40, kv, Sampling(stop_tokens=(tok.eos_id,)))[0]
    assert proc.stdout == tok.decode(expected) + "\n"  # the answer alone: it pipes
    assert proc.stderr.startswith(PROMPT + "\n")  # the prompt echo is on stderr, its own line off a terminal
    summary = proc.stderr.strip().splitlines()[-1]
    n_prompt = tok.encode(PROMPT).numel()
    assert summary.startswith(f"prompt tokens: {n_prompt} | new tokens: {expected.numel()} | prefill: ")
    cache_mib = 2 * 2 * 2 * 16 * 8 * 4 / 2**20  # layers, K+V, KV heads, slots, head size, fp32
    assert "decode: " in summary and summary.endswith(f"cache: h2o, 16 slots, {cache_mib:.2f} MiB")


def test_generate_batch_and_config_file(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "gen.yaml"
    config.write_text(
        "max_new_tokens: 5\ntemperature: 0.0\nkv_cache:\n  policy: last-recent\n  cache_length: 8\n  chunk_size: 4\n"
    )
    main(["generate", str(ckpt), "--config", str(config), "--prompt", PROMPT, "--prompt", "jumps over", "--seed", "3"])
    out = capsys.readouterr()
    assert out.err.count("--- prompt ") == 2 and "jumps over" in out.err
    assert "new tokens: 10 |" in out.err and "cache: last-recent, 8 slots" in out.err
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    kv = KVCacheConfig(policy="last-recent", cache_length=8, chunk_size=4)
    prompts = [tok.encode(PROMPT).long(), tok.encode("jumps over").long()]
    expected = generate(model, prompts, 5, kv, Sampling(stop_tokens=(tok.eos_id,)))
    texts = [tok.decode(ids[:-1] if ids.numel() and ids[-1] == tok.eos_id else ids) for ids in expected]
    assert out.out == "".join(escape_line(text) + "\n" for text in texts)  # the answers alone, one line each


def test_shipped_generate_config_parses(ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    main(["generate", str(ckpt), "--config", str(REPO / "configs" / "generate.yaml"), "--max_new_tokens", "2"])
    assert "cache: h2o, 128 slots" in capsys.readouterr().err


@pytest.mark.parametrize("policy", known_policies())
def test_shipped_generate_config_works_with_every_policy(policy: str, capsys: pytest.CaptureFixture) -> None:
    """Its header says command-line options override it: `--kv-cache NAME` too, for every policy (on the
    shipped model, which has the gates `learned` needs)."""
    config = str(REPO / "configs" / "generate.yaml")
    main(["generate", "--config", config, "--kv-cache", policy, "--max_new_tokens", "2"])
    assert f"cache: {policy}, 128 slots" in capsys.readouterr().err


def test_cache_length_alone_and_num_threads(ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    """A budget below the default chunk size needs no --kv_cache.chunk_size; --num_threads is applied."""
    before = torch.get_num_threads()
    try:
        args = ["--kv-cache", "h2o", "--kv_cache.cache_length", "12", "--num_threads", "1", "--prompt", PROMPT]
        main(["generate", str(ckpt), *args, "--max_new_tokens", "20", "--temperature", "0"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "cache: h2o, 12 slots" in capsys.readouterr().err
    assert "num_threads must be an int >= 1, got 0" in main_error(capsys, "generate", str(ckpt), "--num_threads", "0")


def test_prompt_file(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "p.txt"
    path.write_text("The passkey is")
    main(["generate", str(ckpt), "--prompt_file", str(path), "--max_new_tokens", "3", "--kv_cache", "h2o"])
    out = capsys.readouterr()
    assert out.err.startswith("The passkey is") and "new tokens: 3" in out.err
    assert "The passkey is" not in out.out and out.out.endswith("\n")


# -- bad input ------------------------------------------------------------------------------------


def test_missing_checkpoint_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = main_error(capsys, "generate", str(tmp_path / "nope"))
    assert line == f"error: checkpoint directory {str(tmp_path / 'nope')!r} does not exist"


@pytest.mark.parametrize(
    ("remove", "named"),
    [
        ("model_config.yaml", "has no model_config.yaml"),
        ("model.safetensors", "has no weights: expected model.safetensors or lit_model.pth"),
        ("tokenizer.json", "has no tokenizer: expected tokenizer.json or tokenizer.model"),
    ],
)
def test_incomplete_checkpoint_dir(tmp_path: Path, capsys: pytest.CaptureFixture, remove: str, named: str) -> None:
    make_tiny_checkpoint(tmp_path)
    (tmp_path / remove).unlink()
    assert named in main_error(capsys, "generate", str(tmp_path))


def test_unknown_policy_lists_known_ones(ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    line = main_error(capsys, "generate", str(ckpt), "--kv-cache", "lru")
    # the built-in names, from the stored list (answered before torch is imported); policies other tests
    # registered in this process are not among them
    builtin = [n for n in known_policies() if get_kv_cache_class(n).__module__.startswith("litkv.")]
    assert line == f"error: unknown KV cache policy 'lru'; known policies: {', '.join(builtin)}"
    assert {"dense", "h2o", "last-recent", "qh2o"} <= set(known_policies())


def test_cache_length_must_be_positive(ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    line = main_error(capsys, "generate", str(ckpt), "--kv_cache.cache_length", "0")
    assert line == "error: --kv_cache.cache_length must be >= 1, got 0"


def test_dense_cache_too_small_names_the_flag_and_the_size_that_fits(ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["--kv_cache.cache_length", "8", "--kv_cache.chunk_size", "4", "--max_new_tokens", "20"]
    line = main_error(capsys, "generate", str(ckpt), "--prompt", PROMPT, *args)
    n_prompt = load_tokenizer(ckpt).encode(PROMPT).numel()
    assert "--kv_cache.cache_length 8 is too small for a dense cache" in line
    assert f"need --kv_cache.cache_length {n_prompt + 19}" in line  # the last new token is never stored
    assert "policy that evicts" in line and "--kv-cache h2o" in line
    # the size it names works, one less does not
    main(["generate", str(ckpt), "--prompt", PROMPT, *args[:1], str(n_prompt + 19), *args[2:], "--temperature", "0"])
    assert "cache: dense, " + str(n_prompt + 19) + " slots" in capsys.readouterr().err
    short = [*args[:1], str(n_prompt + 18), *args[2:]]
    assert "is too small" in main_error(capsys, "generate", str(ckpt), "--prompt", PROMPT, *short)


def test_default_dense_cache_is_sized_to_the_prompt(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A prompt longer than the default 1,024 slots runs through a dense cache grown to prompt + new tokens,
    and gives the tokens of a dense cache sized so by hand."""
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 160)
    n_prompt = tok.encode(text).numel()
    assert n_prompt > KVCacheConfig().cache_length
    path = tmp_path / "long.txt"
    path.write_text(text)
    main(["generate", str(ckpt), "--prompt_file", str(path), "--max_new_tokens", "4", "--temperature", "0"])
    out = capsys.readouterr()
    assert f"cache: dense, {n_prompt + 3} slots" in out.err
    dense = KVCacheConfig(cache_length=n_prompt + 3)
    expected = generate(model, [tok.encode(text).long()], 4, dense, Sampling(stop_tokens=(tok.eos_id,)))[0]
    assert out.out == tok.decode(expected) + "\n"


def test_pickled_checkpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = make_tiny_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({"model": model.state_dict(), "hparams": KVCacheConfig()}, tmp_path / "lit_model.pth")
    line = main_error(capsys, "generate", str(tmp_path))
    assert line.startswith(f"error: refusing to load {str(tmp_path / 'lit_model.pth')!r}: it contains pickled objects")


def test_missing_prompt_file(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = main_error(capsys, "generate", str(ckpt), "--prompt_file", str(tmp_path / "nope.txt"))
    assert line == f"error: prompt file {str(tmp_path / 'nope.txt')!r} does not exist"


def test_bad_input_in_a_real_process(procs) -> None:
    proc, work = procs["bad_input"][0], procs["bad_input"][1]
    proc = finish(proc)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: checkpoint directory {str(work / 'nope')!r} does not exist"
    assert proc.stdout == ""


# -- other commands -------------------------------------------------------------------------------


def test_convert_subprocess(procs) -> None:
    proc, work = procs["convert"]
    proc = finish(proc)
    assert proc.returncode == 0, proc.stderr
    assert "model.safetensors" in proc.stdout
    assert load_model(work / "lit").config.n_query_groups == 2


def test_evaluate_subprocess(procs) -> None:
    proc, work = procs["evaluate"]
    proc = finish(proc)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["policy", "budget"]
    assert lines[1].split()[:3] == ["dense", "48", "(full)"] and lines[2].split()[:2] == ["h2o", "16"]
    assert "recall task is skipped" in proc.stderr
    data = json.loads((work / "eval" / "evaluate.json").read_text())
    assert [(r["policy"], r["cache_length"]) for r in data["results"]] == [("dense", 48), ("h2o", 16)]
    assert (work / "eval" / "evaluate.png").is_file()


@pytest.mark.parametrize("command", ["finetune", "bench"])
def test_help(command: str, procs) -> None:
    proc = finish(procs[command][0])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: litkv [options] {command}")


def test_ctrl_c_anywhere_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while a command's module is still being imported: one line, status 130."""
    import litkv.__main__ as cli

    def interrupted(selected: str | None) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load_components", interrupted)
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert exc.value.code == 130 and err.strip() == "interrupted" and "Traceback" not in err
