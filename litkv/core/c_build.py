"""Compiling litkv's C sources at run time, once per machine, into the kernel cache.

A source (a `.c` file shipped in the package) is compiled by the machine's C compiler (`$CC`, else `cc`, `gcc` or
`clang`) with `-O3 -march=native` and the caller's `-D` defines into `$LITKV_HOME/kernels/` (default
`~/.cache/litkv`): a shared library named by the caller's stem and the hash of the source (with the headers beside
it, which it may include), the flags, the compiler and this CPU, written under a temporary name and renamed into
place, so that a second process loads it without compiling and an interrupted build leaves nothing half written. A
compiler without `-march=native` builds for its generic target.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from litkv.core.atomic import TMP_PREFIX
from litkv.core.secret import litkv_home

__all__ = ["BUILD_SECONDS", "FLAGS", "NATIVE", "Signature", "build", "find_compiler", "load"]

FLAGS = ("-O3", "-ffp-contract=fast", "-fno-trapping-math", "-std=c11", "-shared", "-fPIC")
NATIVE = "-march=native"  # this CPU's vector instructions; the file's name carries the CPU's identity
BUILD_SECONDS = 120


def find_compiler() -> str | None:
    """The C compiler sources are built with: `$CC`, else the first of `cc`, `gcc`, `clang` on the PATH; None
    where there is none."""
    return os.environ.get("CC") or next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)


def build(source: Path, defines: Sequence[str], stem: str) -> Path:
    """The library of `source` compiled with `defines` (`-DNAME=VALUE` strings) in the kernel cache, compiled
    now unless it is there; RuntimeError (naming the command and the compiler's last words) where it cannot be
    built. `stem` starts the file's name."""
    compiler = find_compiler()
    if not compiler:
        raise RuntimeError("no C compiler (set CC, or install cc, gcc or clang)")
    identity = [compiler, _cpu_identity(), *FLAGS, NATIVE, *defines]
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
    digest = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, *(x.encode() for x in identity)]))
    directory = litkv_home() / "kernels"
    target = directory / f"{stem}_{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".so", dir=directory)
    os.close(handle)
    try:
        for native in ((NATIVE,), ()):
            command = [compiler, *FLAGS, *native, *defines, "-o", temporary, str(source)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_SECONDS, check=False)
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


#: A C function's ctypes argument types and result type (None: void).
Signature = tuple[list[Any], Any]

_lock = threading.Lock()
_loaded: dict[tuple[Path, tuple[str, ...]], ctypes.CDLL | None] = {}
_UNSET = object()


def load(
    source: Path, defines: Sequence[str], stem: str, signatures: Mapping[str, Signature], fallback: str
) -> ctypes.CDLL | None:
    """`source` built with `defines` (`build`) and loaded once per process, its functions given `signatures`; None
    where it cannot be built, with one RuntimeWarning naming the source, why, and `fallback` (what its calls take
    instead). Safe to call from several threads."""
    key = (source, tuple(defines))
    done = _loaded.get(key, _UNSET)  # a library loaded (or refused) before: no lock on the hot path
    if done is not _UNSET:
        return done
    with _lock:
        if key not in _loaded:
            try:
                lib = ctypes.CDLL(str(build(source, defines, stem)))
                for name, (arguments, result) in signatures.items():
                    function = getattr(lib, name)
                    function.argtypes, function.restype = arguments, result
                _loaded[key] = lib
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as error:
                shown = " ".join((source.name, *defines))
                warnings.warn(
                    f"litkv: the CPU kernel {shown} could not be built: {error}; {fallback}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                _loaded[key] = None
        return _loaded[key]


def _cpu_identity() -> str:
    """What the compiled code depends on: the machine, and on Linux the CPU's model and instruction flags."""
    parts = [platform.system(), platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
            seen: dict[str, str] = {}
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in wanted and name.strip() not in seen:
                    seen[name.strip()] = value.strip()
            parts += [f"{k}={v}" for k, v in sorted(seen.items())]
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)
