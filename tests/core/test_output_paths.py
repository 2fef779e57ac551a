"""Output paths that never delete a user's files (issue 47, items 1 and 8).

Every command that writes a directory refuses a non-empty one it did not write (its marker file), the
source or a directory inside or above it, the current and the home directory; a directory it wrote is
replaced only with --overwrite, whole (`save_dir_atomic`). Saves onto a FIFO with no reader are refused
at once; a second SIGTERM or Ctrl-C ends a chat that is busy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_model
from litkv.core.atomic import OUTPUT_MARKER, FileWriteError, check_output_dir, save_dir_atomic, write_text_atomic

REPO = Path(__file__).parents[2]


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def _one_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert exc.value.code == 1 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _user_dir(path: Path) -> Path:
    """A directory of the user's, with a file litkv must never delete."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "thesis.txt").write_text("four years of work")
    return path


# -- the check ---------------------------------------------------------------------------------------


def test_check_output_dir_refuses_what_a_write_would_destroy(tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "models" / "src"
    src.mkdir(parents=True)
    monkeypatch.chdir(_user_dir(tmp_path / "work"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    cases = {
        tmp_path / "work": "is the current directory",
        Path("."): "is the current directory",
        tmp_path: "is above the current directory",
        tmp_path / "home": "is your home directory",
        src: "is the source",
        src / "out": "is inside the source",
        tmp_path / "models": "is above the source",
        _user_dir(tmp_path / "other"): "is not empty (litkv convert did not write it)",
    }
    for out, words in cases.items():
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            check_output_dir(out, "convert", [src], overwrite=True)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        check_output_dir(tmp_path / "afile", "convert")
    assert (tmp_path / "other" / "thesis.txt").read_text() == "four years of work"
    assert check_output_dir(tmp_path / "new", "convert", [src]) == tmp_path / "new"


def test_save_dir_atomic_replaces_only_its_own_output_with_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    save_dir_atomic(out, lambda d: write_text_atomic(d / "a.txt", "1"), "evaluate")
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert marker == {"written_by": "litkv evaluate", "files": {"a.txt": {"size": 1, "sha256": _sha("1")}}}
    with pytest.raises(ValueError, match="give --overwrite true to replace it"):
        save_dir_atomic(out, lambda d: write_text_atomic(d / "a.txt", "2"), "evaluate")
    with pytest.raises(ValueError, match="it was written by litkv evaluate"):
        save_dir_atomic(out, lambda d: write_text_atomic(d / "a.txt", "2"), "convert", overwrite=True)
    save_dir_atomic(out, lambda d: write_text_atomic(d / "b.txt", "2"), "evaluate", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "b.txt"]


# -- convert -----------------------------------------------------------------------------------------


def test_convert_quantize_never_deletes_the_users_files(tiny_ckpt: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """The round's findings: OUT non-empty, OUT the parent of SRC, OUT `.`: all replaced, exit 0."""
    import shutil

    src = tmp_path / "models" / "src"
    shutil.copytree(tiny_ckpt, src)
    before = sorted(p.name for p in src.iterdir())
    user = _user_dir(tmp_path / "mine")
    assert "is not empty (litkv convert did not write it)" in _one_error(
        capsys, ["convert", str(src), str(user), "--quantize", "int4"]
    )
    assert "above the source" in _one_error(capsys, ["convert", str(src), str(src.parent), "--quantize", "int4"])
    assert "is the source" in _one_error(capsys, ["convert", str(src), str(src), "--quantize", "int4"])
    monkeypatch.chdir(user)
    assert "is the current directory" in _one_error(capsys, ["convert", str(src), ".", "--quantize", "int4"])
    assert (user / "thesis.txt").read_text() == "four years of work"
    assert sorted(p.name for p in src.iterdir()) == before

    out = tmp_path / "q"
    main(["convert", str(src), str(out), "--quantize", "int8"])
    assert (out / OUTPUT_MARKER).is_file() and OUTPUT_MARKER not in capsys.readouterr().out
    assert "--overwrite true" in _one_error(capsys, ["convert", str(src), str(out), "--quantize", "int4"])
    main(["convert", str(src), str(out), "--quantize", "int4", "--overwrite", "true"])
    load_model(out)  # the replaced directory is whole


def test_hf_convert_writes_its_directory_whole_or_not_at_all(tmp_path: Path, monkeypatch) -> None:
    """A failure after the weights are written leaves no `out_dir` (it was filled in place before)."""
    transformers = pytest.importorskip("transformers")
    from tiny_checkpoint import train_tiny_tokenizer

    from litkv.checkpoints import convert as convert_module

    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(hf, safe_serialization=True)
    train_tiny_tokenizer(hf)

    def broken(path: Path, text: str) -> None:
        raise OSError(5, "disk gone")

    monkeypatch.setattr(convert_module, "write_text_atomic", broken)
    with pytest.raises(OSError, match="disk gone"):
        convert_module.convert_hf_checkpoint(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".litkv-tmp")] == []


# -- evaluate, finetune ------------------------------------------------------------------------------


def test_evaluate_and_finetune_refuse_a_users_directory_before_the_run(tiny_ckpt: Path, tmp_path: Path, capsys) -> None:
    user = _user_dir(tmp_path / "mine")
    line = _one_error(capsys, ["evaluate", str(tiny_ckpt), "--out_dir", str(user), "--num_windows", "1"])
    assert "evaluate: output directory" in line and "litkv evaluate did not write it" in line
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    line = _one_error(capsys, ["finetune", str(tiny_ckpt), "--data.path", str(text), "--out_dir", str(user)])
    assert "finetune: output directory" in line and "litkv finetune did not write it" in line
    line = _one_error(capsys, ["finetune", str(tiny_ckpt), "--data.path", str(text), "--out_dir", str(tiny_ckpt)])
    assert "is the source" in line
    assert (user / "thesis.txt").read_text() == "four years of work"


# -- chat saves, FIFOs, signals ---------------------------------------------------------------------


def test_save_onto_a_fifo_without_reader_is_refused_at_once(tmp_path: Path) -> None:
    """`open()` of a FIFO with no reader blocks forever; the write is refused in one line instead."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        from litkv.core.atomic import write_text_atomic, FileWriteError
        try:
            write_text_atomic({str(fifo)!r}, "state")
        except FileWriteError as err:
            print("refused:", err)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "refused:" in done.stdout and "it is a FIFO with no reader" in done.stdout, done.stderr[-2000:]


def test_write_through_gives_up_on_a_reader_that_never_reads(tmp_path: Path, monkeypatch) -> None:
    from litkv.core import atomic

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that never reads
    monkeypatch.setattr(atomic, "WRITE_THROUGH_TIMEOUT", 0.2)
    try:
        with pytest.raises(FileWriteError, match="its reader took nothing"):
            atomic.write_bytes_atomic(fifo, b"x" * (4 << 20))  # more than a pipe holds
    finally:
        os.close(reader)


def test_chat_save_never_replaces_a_file_that_is_not_a_session(tmp_path: Path) -> None:
    from litkv.inference.chat_session import check_not_foreign

    mine = tmp_path / "notes.txt"
    mine.write_text("my notes")
    with pytest.raises(ValueError, match="it exists and is not a litkv session; give a new file name"):
        check_not_foreign(mine)
    check_not_foreign(tmp_path / "new.safetensors")  # a new name is fine
    check_not_foreign(Path("/dev/null"))  # a device is written through, never replaced


def test_a_second_signal_ends_a_busy_chat() -> None:
    """A save stuck on a slow device: the first SIGTERM / Ctrl-C asks, the second ends the chat."""
    from litkv.cli.chat_cmd import _Signals, _Terminate

    class Session:
        interrupted = False

    signals = _Signals(Session())  # type: ignore[arg-type]
    signals.busy = True
    signals._on_terminate(signal.SIGTERM, None)
    assert signals.session.interrupted
    with pytest.raises(_Terminate):
        signals._on_terminate(signal.SIGTERM, None)
    signals = _Signals(Session())  # type: ignore[arg-type]
    signals.busy = True
    signals._on_sigint(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        signals._on_sigint(signal.SIGINT, None)
