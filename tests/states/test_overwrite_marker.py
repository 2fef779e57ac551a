"""`--overwrite true` deletes only what litkv wrote (issue 61, item 3).

The round's findings: files a user added to a convert output were deleted without being named, and a
user's directory holding a copied, hand-written or symlinked `.litkv-output.json` lost everything in it
(`thesis.tex`). The marker now lists every file the command wrote with its size and sha256; the
directory is replaced only when it holds exactly those files, else the command refuses naming them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_checkpoint import make_tiny_checkpoint

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_model
from litkv.core.atomic import OUTPUT_MARKER, check_output_dir, save_dir_atomic, write_text_atomic

THESIS = "four years of work"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("src")
    make_tiny_checkpoint(out)
    return out


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exc.value.code == 1 and len(err) == 1, err
    return err[0]


def _convert(source: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", str(source), str(out), "--quantize", "int8", *extra]


def test_a_file_the_user_added_to_a_convert_output_is_named_and_kept(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    main(_convert(source, out))
    listed = json.loads((out / OUTPUT_MARKER).read_text())["files"]
    assert set(listed) == {p.name for p in out.iterdir()} - {OUTPUT_MARKER}
    (out / "thesis.tex").write_text(THESIS)
    (out / "notes").mkdir()
    (out / "notes" / "todo.txt").write_text("x")
    err = _error(capsys, _convert(source, out, "--overwrite", "true"))
    assert "holds files litkv convert did not write: 'notes/todo.txt', 'thesis.tex'" in err
    assert (out / "thesis.tex").read_text() == THESIS and (out / "notes" / "todo.txt").is_file()
    (out / "thesis.tex").unlink()
    shutil.rmtree(out / "notes")
    main(_convert(source, out, "--overwrite", "true"))  # only litkv's files: replaced
    load_model(out)


def test_an_edited_output_file_is_named_as_not_matching_the_marker(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    main(_convert(source, out))
    config = next(p for p in out.iterdir() if p.suffix in (".yaml", ".json") and p.name != OUTPUT_MARKER)
    config.write_text(config.read_text() + "\n# my edit\n")
    err = _error(capsys, _convert(source, out, "--overwrite", "true"))
    assert f"its marker does not match the files (changed or missing: {config.name!r})" in err
    assert config.read_text().endswith("# my edit\n")


@pytest.mark.parametrize("marker", ["copied", "hand-written", "symlinked"])
def test_a_users_directory_with_a_foreign_marker_keeps_its_files(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], marker: str
) -> None:
    real = tmp_path / "real"
    main(_convert(source, real))
    user = tmp_path / "thesis"
    user.mkdir()
    (user / "thesis.tex").write_text(THESIS)
    expected = {
        "copied": "holds files litkv convert did not write: 'thesis.tex'",
        "hand-written": "its marker lists no files",
        "symlinked": f"its marker {OUTPUT_MARKER} is a symlink",
    }[marker]
    if marker == "copied":
        shutil.copy(real / OUTPUT_MARKER, user / OUTPUT_MARKER)
    elif marker == "hand-written":
        (user / OUTPUT_MARKER).write_text(json.dumps({"written_by": "litkv convert"}))
    else:
        (user / OUTPUT_MARKER).symlink_to(real / OUTPUT_MARKER)
    err = _error(capsys, _convert(source, user, "--overwrite", "true"))
    assert expected in err and str(user) in err
    assert (user / "thesis.tex").read_text() == THESIS
    # a copied marker whose files were copied too matches them: only those are replaced
    if marker == "copied":
        (user / "thesis.tex").unlink()
        for p in real.iterdir():
            shutil.copy(p, user / p.name)
        assert check_output_dir(user, "convert", [source], overwrite=True) == user


def test_a_file_added_while_the_command_runs_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    save_dir_atomic(out, lambda d: write_text_atomic(d / "a.txt", "1"), "evaluate")

    def slow_write(d: Path) -> None:
        write_text_atomic(d / "a.txt", "2")
        (out / "thesis.tex").write_text(THESIS)  # the user, meanwhile

    with pytest.raises(ValueError, match="did not write: 'thesis.tex'"):
        save_dir_atomic(out, slow_write, "evaluate", overwrite=True)
    assert (out / "thesis.tex").read_text() == THESIS and (out / "a.txt").read_text() == "1"
