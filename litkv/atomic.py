"""The one way litkv writes files: atomically, durably, with the umask's mode, and with one clear error.

Every file the package writes (checkpoints, training states, cache states, prefix-store entries, chat
sessions, evaluate and bench results) goes through `write_atomic` (or `save_dir_atomic` for a whole
directory):

1. a temporary file `TMP_PREFIX<name>.<pid>-<random>` is created in the target's directory, with mode
   `0o666 & ~umask` (0644 under umask 022, as a plain `open()` would give);
2. the caller's `write_fn(tmp)` fills it; it is flushed to disk (`fsync`);
3. it is renamed over the target (`os.replace`: readers see the old file or the new one, never a mix)
   and the directory is `fsync`ed, so the rename itself survives a power loss.

On any error the temporary file is removed and the previous file is left as it was. A write that
fails for lack of space or permission (ENOSPC, EDQUOT, EFBIG, EACCES, EPERM, EROFS) raises one
`FileWriteError` naming the path (an `OSError` with the errno, and a `ValueError`, so the CLI prints
it as one line). A process killed mid-write leaves only a temporary name behind: it never ends in a
data suffix, so no reader takes it for data, and `remove_stale_temp_files` (called when a directory
is next opened by a litkv writer) removes those whose writing process is gone.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
import warnings
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "TMP_PREFIX",
    "FileWriteError",
    "is_temp_name",
    "remove_stale_temp_files",
    "save_dir_atomic",
    "temp_files",
    "write_atomic",
    "write_bytes_atomic",
    "write_special_file",
    "write_text_atomic",
]

#: Prefix of every temporary file or directory that litkv writes (then renames into place).
TMP_PREFIX = ".litkv-tmp-"
#: Errors of a write that the user must fix (space, permission, read-only file system).
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS)
_OS_ERROR_IN_TEXT = re.compile(r"os error (\d+)")
_PID_IN_NAME = re.compile(r"\.(\d+)-[0-9a-f]{8}$")
#: Files that earlier litkv versions left as `.NAME.XXXXXX.tmp` when killed mid-write.
_LEGACY_TMP_NAMES = ("model_config.yaml", "model.safetensors", "lit_model.pth", "lora.safetensors",
                     "training_state.pt", "hyperparameters.yaml", "prompt_style.yaml", "tokenizer.json",
                     "tokenizer.model", "tokenizer_config.json", "generation_config.json",
                     "special_tokens_map.json")  # fmt: skip
#: Cache states of earlier litkv versions were written as `.NAME.tmpPID`.
_LEGACY_STATE_TMP = re.compile(r"^\..+\.safetensors\.tmp\d+$")


class FileWriteError(OSError, ValueError):
    """A file could not be written (no space, no permission, read-only); the previous file is intact."""


def is_temp_name(name: str) -> bool:
    """Whether `name` is the temporary name of a (possibly interrupted) litkv write."""
    if name.startswith(TMP_PREFIX) or _LEGACY_STATE_TMP.match(name):
        return True
    return name.endswith(".tmp") and any(name.startswith(f".{known}.") for known in _LEGACY_TMP_NAMES)


def _write_errno(err: BaseException) -> int | None:
    """The errno of a failed write, also when a serialiser hid it in its message (`(os error 28)`)."""
    code = getattr(err, "errno", None)
    if isinstance(code, int):
        return code
    found = _OS_ERROR_IN_TEXT.search(str(err))
    return int(found.group(1)) if found else None


def _clear_error(path: Path, err: BaseException) -> BaseException:
    """`FileWriteError` naming `path` for a space/permission error; `err` itself otherwise."""
    code = _write_errno(err)
    if code not in WRITE_ERRNOS:
        return err
    reason = os.strerror(code)
    return FileWriteError(code, f"cannot write {str(path)!r}: {reason} (the previous file, if any, is unchanged)")


def _temp_sibling(path: Path, make: Callable[[Path], None]) -> Path:
    """Create (with `make`, which must fail if the name exists) a fresh temporary name next to `path`."""
    for _ in range(100):
        tmp = path.parent / f"{TMP_PREFIX}{path.name}.{os.getpid()}-{secrets.token_hex(4)}"
        try:
            make(tmp)
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"cannot create a temporary name next to {str(path)!r}")


def _create_file(tmp: Path) -> None:
    # mode 0o666 & ~umask, as open() would give (mkstemp would give 0o600)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError as err:  # some file systems cannot fsync a directory; the rename is still atomic
        if not directory:
            raise
        del err
    finally:
        os.close(fd)


def _make_parent(path: Path, file: bool = True) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(f"cannot write {str(path)!r}: {str(path.parent)!r} is not a directory") from None
    except OSError as err:
        raise _clear_error(path, err) from err
    if not path.parent.is_dir():
        raise NotADirectoryError(f"cannot write {str(path)!r}: {str(path.parent)!r} is not a directory")
    if file and path.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"cannot write {str(path)!r}: it is a directory")


def write_atomic(path: str | Path, write_fn: Callable[[Path], None]) -> Path:
    """Write `path` atomically: `write_fn(tmp)` writes the content to the temporary file `tmp` (next to
    `path`), which is then fsynced and renamed over `path`; the directory is fsynced too.

    Raises:
        FileWriteError: no space, no permission or a read-only file system (naming `path`).
        NotADirectoryError / IsADirectoryError: the parent is not a directory / `path` is one.
        Anything `write_fn` raises; in every case the temporary file is gone and `path` is unchanged.
    """
    path = Path(path)
    _make_parent(path)
    try:
        tmp = _temp_sibling(path, _create_file)
    except OSError as err:
        raise _clear_error(path, err) from err
    try:
        mode = stat.S_IMODE(tmp.stat().st_mode)  # 0o666 & ~umask
        write_fn(tmp)
        if stat.S_IMODE(tmp.stat().st_mode) != mode:  # e.g. safetensors writes its files with 0o600
            os.chmod(tmp, mode)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        clear = _clear_error(path, err)
        if clear is err:
            raise
        raise clear from err
    _fsync(path.parent, directory=True)
    return path


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """`write_atomic` of `data`."""
    return write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_text_atomic(path: str | Path, text: str) -> Path:
    """`write_atomic` of `text` as UTF-8."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_special_file(path: str | Path, text: str) -> None:
    """Write `text` to a kernel interface file (`/proc/...`) in place: such files are not data and
    cannot be replaced by a rename. Anything else is refused (use `write_atomic`)."""
    path = Path(path)
    if not str(path).startswith(("/proc/", "/sys/")):
        raise ValueError(f"write_special_file writes /proc or /sys files only, got {str(path)!r}")
    with open(path, "w") as f:
        f.write(text)


def save_dir_atomic(path: str | Path, write_fn: Callable[[Path], None]) -> Path:
    """Write directory `path` atomically: `write_fn(tmp_dir)` fills a temporary directory next to it
    (with `write_atomic` for each file), which is then renamed to `path` (an existing `path` is replaced).

    On any error the temporary directory is removed and an existing `path` is kept, so an incomplete
    directory is never found under the name `path`.
    """
    path = Path(path)
    _make_parent(path, file=False)
    tmp = _temp_sibling(path, lambda p: p.mkdir(mode=0o777))
    try:
        write_fn(tmp)
        _fsync(tmp, directory=True)
        _replace_dir(tmp, path)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        clear = _clear_error(path, err)
        if clear is err:
            raise
        raise clear from err
    _fsync(path.parent, directory=True)
    return path


def _replace_dir(tmp: Path, path: Path) -> None:
    """Rename directory `tmp` to `path`; an existing `path` is moved aside first, then deleted."""
    if not path.exists():
        os.rename(tmp, path)
        return
    old = path.parent / f"{TMP_PREFIX}{path.name}.old.{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _writer_alive(name: str) -> bool:
    """Whether the process whose pid is in a temporary name still runs (then its write may go on)."""
    found = _PID_IN_NAME.search(name)
    if found is None:
        return False
    pid = int(found.group(1))
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def temp_files(directory: str | Path, depth: int = 0) -> list[Path]:
    """Temporary names of litkv writes in `directory` (and, with `depth=1`, in its subdirectories)."""
    root = Path(directory)
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [p for p in entries if is_temp_name(p.name)]
    if depth > 0:
        for sub in entries:
            if sub.is_dir() and not sub.is_symlink() and not is_temp_name(sub.name):
                found += [p for p in temp_files(sub, depth - 1) if not p.is_dir()]
    return sorted(found)


def remove_stale_temp_files(
    directory: str | Path, depth: int = 1, quiet: bool = False, kind: str = "checkpoint"
) -> list[Path]:
    """Remove the temporary files/directories of interrupted litkv writes in `directory` (and its
    subdirectories down to `depth`); warn naming them (as writes of `kind`) unless `quiet`; return them.

    A temporary name whose writing process still runs on this machine is kept (its write may finish).
    Only names that litkv's writes produce are touched.
    """
    stale = [p for p in temp_files(directory, depth) if not _writer_alive(p.name)]
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if stale and not quiet:
        warnings.warn(
            f"removed {len(stale)} temporary file(s) of interrupted {kind} writes: " + ", ".join(str(p) for p in stale),
            stacklevel=2,
        )
    return stale
