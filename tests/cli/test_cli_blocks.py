"""`litkv generate --block_file A --block_file B --prompt Q` (in-process `main`), and `prompt_segments`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from litkv.__main__ import main, normalize_argv
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.cli.answers import unescape_line
from litkv.core.tokens import encode_plain
from litkv.inference.blocks import Segment, prompt_segments
from litkv.inference.chat_template import RawFormat
from litkv.inference.generate import generate
from litkv.kvcache.config import KVCacheConfig
from litkv.states.block_store import BlockStore

DOCS = ("The secret word is apple. ", "Nothing to see here, only sand and sea. ")
QUESTION = "The secret word is"


def test_repeated_block_files_become_one_list() -> None:
    argv = ["generate", "--block_file", "a.txt", "--prompt", "q", "--block_file", "b.txt"]
    assert normalize_argv(argv) == ["generate", "--prompt", '["q"]', "--block_file", '["a.txt", "b.txt"]']


def test_prompt_segments_tokenize_each_block_alone(ckpt: Path) -> None:
    tokenizer = load_tokenizer(ckpt)
    segments = prompt_segments(RawFormat(tokenizer), tokenizer, list(DOCS), QUESTION)
    blocks = [s for s in segments if s.block]
    assert [s.ids.tolist() for s in blocks] == [encode_plain(tokenizer, d) for d in DOCS]
    assert segments[-1].ids.tolist() == encode_plain(tokenizer, QUESTION) and not segments[-1].block
    with pytest.raises(ValueError, match="block 1 encodes to no tokens"):
        prompt_segments(RawFormat(tokenizer), tokenizer, ["x", ""], QUESTION)


def test_generate_block_files(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    files = []
    for i, text in enumerate(DOCS):
        files += ["--block_file", str(tmp_path / f"doc{i}.txt")]
        (tmp_path / f"doc{i}.txt").write_text(text, encoding="utf-8")
    args = ["generate", str(ckpt), *files, "--prompt", QUESTION, "--max_new_tokens", "6", "--temperature", "0"]
    args += ["--prompt_cache", str(tmp_path / "cache"), "--chat_template", "false"]
    outputs = []
    for _ in range(2):
        main(args)
        captured = capsys.readouterr()
        outputs.append(captured.out)
        assert captured.err.startswith(QUESTION)  # the prompt echo is on stderr, the answer alone on stdout
    assert outputs[0] == outputs[1]
    assert "0 block tokens restored" not in captured.err  # the second run found the blocks on disk
    model, tokenizer = load_model(ckpt), load_tokenizer(ckpt)
    segments = prompt_segments(RawFormat(tokenizer), tokenizer, list(DOCS), QUESTION)
    with torch.inference_mode():
        tokens = generate(model, [segments], 6, KVCacheConfig(), block_store=BlockStore(0))[0]
    assert outputs[0] == tokenizer.decode(tokens) + "\n"
    assert all(isinstance(s, Segment) for s in segments)


def test_bad_block_file_one_line(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["generate", str(ckpt), "--block_file", str(tmp_path / "missing.txt"), "--prompt", "q"])
    err = capsys.readouterr().err
    assert "block file" in err and "does not exist" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["binary", "directory", "fifo"])
def test_block_file_that_is_not_text_is_said_so(ckpt: Path, tmp_path: Path, capsys, kind: str) -> None:  # noqa: ANN001
    """Issue 50, item 6: a binary file got a bare UTF-8 error, a directory or a FIFO "does not exist"."""
    import os

    path = tmp_path / "block"
    if kind == "binary":
        path.write_bytes(b"text then \xff\xfe binary")
    elif kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    with pytest.raises(SystemExit):
        main(["generate", str(ckpt), "--block_file", str(path), "--prompt", "q"])
    err = capsys.readouterr().err.strip().splitlines()
    expected = {"binary": "is not UTF-8 text (byte 0xff at offset 10)", "directory": "is a directory",
                "fifo": "is not a regular file"}[kind]  # fmt: skip
    assert err[-1] == f"error: block file {str(path)!r} {expected}" + ("; give a text file" if kind == "binary"
                                                                     else "; it must be a file"), err  # fmt: skip


def test_generate_block_files_with_several_prompts_decodes_them_as_a_batch(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "doc.txt").write_text(DOCS[0], encoding="utf-8")
    questions = [QUESTION, "Nothing to"]
    args = ["generate", str(ckpt), "--block_file", str(tmp_path / "doc.txt"), "--max_new_tokens", "5"]
    main([*args, "--prompt", questions[0], "--prompt", questions[1], "--temperature", "0", "--chat_template", "false"])
    captured = capsys.readouterr()
    model, tokenizer = load_model(ckpt), load_tokenizer(ckpt)
    for i, question in enumerate(questions):
        segments = prompt_segments(RawFormat(tokenizer), tokenizer, [DOCS[0]], question)
        with torch.inference_mode():
            alone = generate(model, [segments], 5, KVCacheConfig(), block_store=BlockStore(0))[0]
        assert f"--- prompt {i} ---\n{question}\n" in captured.err
        assert unescape_line(captured.out.splitlines()[i]) == tokenizer.decode(alone)  # one line per answer, in order
    assert "block tokens restored" in captured.err and "0 block tokens restored" not in captured.err
