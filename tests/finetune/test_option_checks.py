"""Options and files that cannot work are refused at start with one line naming the right thing
(issue 32, items 6 and 8): gate training's window against the sequence length, `--resume` with
`--learn_eviction`, a NaN loss, gates files of integers or a directory, `--data.path` / `--text_file`
that is a directory, `--task_samples 0`, a negative float option value, a checkpoint directory after
the options. One real `litkv finetune` process; the rest through the same CLI entry point in process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_finetune import write_text
from tiny_checkpoint import make_tiny_checkpoint

from litkv.__main__ import main, normalize_argv
from litkv.checkpoints.checkpoint import load_model
from litkv.finetune.gate_training import GateTrainArgs, train_gates
from litkv.gates import GATES_FILE, EvictionGates

REPO = Path(__file__).resolve().parents[2]
LEARN = ["--learn_eviction", "true", "--kv_cache.policy", "learned", "--learn.steps", "2", "--learn.batch_size", "1"]


def one_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The single `error: ...` line of `litkv ARGV` (which must exit with status 1)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert exc.value.code == 1 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.slow
def test_finetune_window_longer_than_the_sequence_is_an_error(ckpt: Path, tmp_path: Path) -> None:
    """The round's finding: NaN loss on every step, exit 0 and untrained gates saved as final/."""
    text = write_text(tmp_path / "train.txt", 2000)
    argv = [sys.executable, "-m", "litkv", "finetune", str(ckpt), "--data.path", str(text), "--data.seq_length",
            "48", *LEARN, "--learn.window", "64", "--out_dir", str(tmp_path / "out")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    err = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert done.returncode == 1 and err == [
        "error: --learn.window + --learn.sinks (64 + 4) must be < --data.seq_length (48): no token would be "
        "outside the window for the gates to learn on"
    ], done.stderr
    assert not (tmp_path / "out" / "final").exists()


def test_resume_from_a_plain_checkpoint_with_learn_eviction_is_an_error(ckpt: Path, tmp_path: Path, capsys) -> None:
    text = write_text(tmp_path / "train.txt", 500)
    line = one_error(capsys, ["finetune", str(ckpt), "--data.path", str(text), *LEARN, "--resume", str(ckpt),
                              "--out_dir", str(tmp_path / "out")])  # fmt: skip
    assert f"--resume {str(ckpt)!r} is not a gate-training checkpoint: missing ['eviction_gates" in line


@pytest.mark.parametrize("precision", ["16-true", "bf16-true", "32-true"])
def test_precision_with_learn_eviction_is_refused_not_ignored(ckpt: Path, tmp_path: Path, capsys, precision) -> None:  # noqa: ANN001
    """Issue 47, item 9: `--precision` with `--learn_eviction` was ignored without a word (gates bit-identical)."""
    text = write_text(tmp_path / "train.txt", 500)
    line = one_error(capsys, ["finetune", str(ckpt), "--data.path", str(text), *LEARN, "--precision", precision,
                              "--out_dir", str(tmp_path / "out")])  # fmt: skip
    assert line == (
        f"error: --precision {precision} does not apply to --learn_eviction true (the gates train in float32 on "
        "the checkpoint's weights as stored); drop --precision"
    )
    assert not (tmp_path / "out").exists()


def test_a_nan_loss_stops_gate_training(ckpt: Path) -> None:
    """Examples no longer than the window (nothing to evict: the loss is a mean over nothing)."""
    model = load_model(ckpt)
    examples = [(torch.arange(1, 9), torch.arange(2, 10))]
    with pytest.raises(ValueError, match=r"gate training stopped at step 0: the loss is nan .*; nothing was saved"):
        train_gates(model, examples, GateTrainArgs(steps=3, batch_size=1, window=16, engine="whole"))
    with pytest.raises(ValueError, match=r"sequence length 8 must be > the gates' window \+ sinks \(16 \+ 4\)"):
        train_gates(model, examples, GateTrainArgs(steps=3, batch_size=1, window=16))


def test_gates_of_integers_and_a_gates_directory_are_refused(ckpt: Path, tmp_path: Path) -> None:
    meta = {"format": "litkv-eviction-gates", "window": "4", "sinks": "1"}
    for dtype in (torch.int64, torch.bool):
        path = tmp_path / f"{dtype}.safetensors"
        save_file({"weight": torch.ones(2, 2, 16, dtype=dtype), "bias": torch.zeros(2, 2)}, str(path), metadata=meta)
        with pytest.raises(ValueError, match=f"must be floating-point tensors, got weight {dtype}"):
            EvictionGates.load(path)
    bad = tmp_path / "ckpt"
    make_tiny_checkpoint(bad)
    (bad / GATES_FILE).mkdir()
    with pytest.raises(ValueError, match="eviction_gates.safetensors' must be an eviction-gates safetensors file"):
        load_model(bad)


def test_file_options_name_the_option_and_the_kind(ckpt: Path, tmp_path: Path, capsys) -> None:
    line = one_error(capsys, ["finetune", str(ckpt), "--data.path", str(tmp_path), "--out_dir", str(tmp_path / "o")])
    assert line == f"error: --data.path {str(tmp_path)!r} is a directory; it must be a file"
    for tasks in ([], ["--tasks", "vt"]):
        line = one_error(capsys, ["evaluate", str(ckpt), *tasks, "--text_file", str(tmp_path)])
        assert line == f"error: --text_file {str(tmp_path)!r} is a directory; it must be a file"
        missing = tmp_path / "missing.txt"
        line = one_error(capsys, ["evaluate", str(ckpt), *tasks, "--text_file", str(missing)])
        assert line == f"error: --text_file {str(missing)!r} does not exist"
    line = one_error(capsys, ["evaluate", str(ckpt), "--tasks", "vt", "--task_samples", "0"])
    assert line == "error: --task_samples must be an int >= 1, got 0"


def test_negative_numbers_and_a_trailing_checkpoint_directory_are_understood() -> None:
    assert normalize_argv(["generate", "--kv_cache.threshold", "-1e30", "--x", "-inf"]) == [
        "generate",
        "--kv_cache.options.threshold=-1e30",
        "--x=-inf",
    ]
    assert normalize_argv(["generate", "--prompt", "hi", "--compile", "DIR"])[-2:] == ["--checkpoint_dir", "DIR"]
    assert normalize_argv(["generate", "--compile", "true", "DIR"])[-2:] == ["--checkpoint_dir", "DIR"]
    assert normalize_argv(["generate", "--max_new_tokens", "2", "--temperature=0", "DIR"])[-2:] == [
        "--checkpoint_dir",
        "DIR",
    ]
    assert "--checkpoint_dir" not in normalize_argv(["generate", "--max_new_tokens", "2"])


def test_generate_with_a_negative_threshold_and_the_checkpoint_last(tmp_path: Path, capsys) -> None:
    """`--kv_cache.threshold -1e30` used to blame `--kv_cache.options`; a checkpoint directory after the
    options gave "Unrecognized arguments"."""
    ckpt = tmp_path / "gated"
    make_tiny_checkpoint(ckpt, gates_seed=0)
    main(["generate", "--kv_cache", "learned", "--kv_cache.threshold", "-1e30", "--prompt", "the fox",
          "--max_new_tokens", "2", "--num_threads", "1", str(ckpt)])  # fmt: skip
    captured = capsys.readouterr()
    assert "cache: learned" in captured.err + captured.out, captured


def test_a_nan_loss_stops_finetuning(tmp_path: Path) -> None:
    """A learning rate of 1e38 makes the second step's loss NaN: the run stops there, no final/."""
    from test_finetune import CACHE, SEQ, cli, make_checkpoint

    base = make_checkpoint(tmp_path / "base")
    text = write_text(tmp_path / "t.txt", 120)
    with pytest.raises(ValueError, match=r"^training stopped at step 2: the loss is nan; nothing more was saved"):
        cli(base, "--data.path", text, "--data.seq_length", SEQ, *CACHE, "--train.max_steps", "4",
            "--train.global_batch_size", "2", "--train.lr", "1e38", "--out_dir", tmp_path / "out")  # fmt: skip
    assert not (tmp_path / "out" / "final").exists()
