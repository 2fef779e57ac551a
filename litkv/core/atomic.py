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

What is at the target decides how it is written (`resolve_target`), so a write never replaces what it
must not: a symlink is followed and its target written atomically (the link stays); a character device
or FIFO (`/dev/null`, a pipe), an open file reached through /proc (`--json_out /dev/stdout`) and a
kernel file under /proc or /sys are written through in place; a block device, a socket and a directory
are refused with one line. `write_atomic` and `save_dir_atomic` share one error tail (`_guarded`).

A command's output directory never deletes what the user had (`check_output_dir`): an existing
non-empty directory is replaced only when it holds this command's marker file (`OUTPUT_MARKER`,
written by `save_dir_atomic(..., command=...)` or `mark_output_dir`), the marker lists exactly the
files the directory holds with their sizes and hashes (`litkv.core.output_marker`), and `overwrite`
is given; a
directory equal to, inside or above a source, the current directory, the home directory, or one
above either is refused whatever the flags.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import select
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from litkv.core.output_marker import OUTPUT_MARKER, file_table, marker_command, marker_problem

__all__ = [
    "OUTPUT_MARKER",
    "TMP_PREFIX",
    "FileWriteError",
    "check_output_dir",
    "create_private_file",
    "is_temp_name",
    "mark_output_dir",
    "remove_stale_temp_files",
    "resolve_target",
    "save_dir_atomic",
    "temp_files",
    "write_atomic",
    "write_bytes_atomic",
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


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(f"cannot write {str(path)!r}: {str(path.parent)!r} is not a directory") from None
    except OSError as err:
        raise _clear_error(path, err) from err
    if not path.parent.is_dir():
        raise NotADirectoryError(f"cannot write {str(path)!r}: {str(path.parent)!r} is not a directory")


def _kind(mode: int) -> str:
    """The name of a file type (for one-line refusals)."""
    kinds = {stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
             stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}  # fmt: skip
    if stat.S_IFMT(mode) in kinds:
        return kinds[stat.S_IFMT(mode)]
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def _links_into_proc(path: Path) -> bool:
    """Whether `path` is, or is a chain of symlinks that reaches, a file under /proc (`/dev/stdout` ->
    `/proc/self/fd/1`: a link to an open file, which must be written through, never renamed over)."""
    for _ in range(40):
        if str(path).startswith("/proc/") or os.path.realpath(path.parent).startswith("/proc/"):  # /dev/fd/1
            return True
        if not path.is_symlink():
            return False
        path = Path(os.path.normpath(path.parent / os.readlink(path)))
    return False


def resolve_target(path: str | Path, directory: bool = False) -> tuple[Path, bool]:
    """Where a write of `path` lands, and whether it is written in place (`True`) or replaced by a rename.

    A symlink is followed (the link stays, its target gets the new content); a character device or FIFO
    (`/dev/null`, a pipe), an open file reached through /proc (`/dev/stdout`) and a kernel file under
    /proc or /sys are written through, in place; a block device or socket is refused, and so is a
    directory for a file (a file for a directory, when `directory`): never replaced.

    Raises:
        IsADirectoryError / NotADirectoryError / FileWriteError (EINVAL): a target that must not be replaced.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a new file (or a dangling link: create its target)
        return (Path(os.path.realpath(path)) if path.is_symlink() else path), False
    except OSError as err:
        raise _clear_error(path, err) from err
    if directory:
        if not stat.S_ISDIR(mode):
            raise NotADirectoryError(errno.ENOTDIR, f"cannot write directory {str(path)!r}: it is {_kind(mode)}")
        return Path(os.path.realpath(path)), False
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, f"cannot write {str(path)!r}: it is a directory")
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or _links_into_proc(path) or str(path).startswith("/sys/"):
        return path, True
    if not stat.S_ISREG(mode):
        raise FileWriteError(errno.EINVAL, f"cannot write {str(path)!r}: it is {_kind(mode)}; litkv never replaces one")
    return (Path(os.path.realpath(path)) if path.is_symlink() else path), False


def _guarded(path: Path, body: Callable[[], None], cleanup: Callable[[], None]) -> None:
    """Run `body`; on any error run `cleanup` and raise the error (as `FileWriteError` naming `path` for
    a space/permission error). The one error tail of every write."""
    try:
        body()
    except BaseException as err:
        cleanup()
        clear = _clear_error(path, err)
        if clear is err:
            raise
        raise clear from err


def write_atomic(path: str | Path, write_fn: Callable[[Path], None]) -> Path:
    """Write `path` atomically: `write_fn(tmp)` writes the content to the temporary file `tmp` (next to
    `path`), which is then fsynced and renamed over `path`; the directory is fsynced too.

    A symlink `path` is written at its target (atomically there; the link is kept). A character device,
    FIFO or /proc, /sys file is written through in place (`write_fn` fills a private temporary file
    first); a block device, socket or directory is refused (`resolve_target`). Returns the path written.

    Raises:
        FileWriteError: no space, no permission or a read-only file system (naming `path`).
        NotADirectoryError / IsADirectoryError: the parent is not a directory / `path` is one.
        Anything `write_fn` raises; in every case the temporary file is gone and `path` is unchanged.
    """
    path, in_place = resolve_target(path)
    if in_place:
        _guarded(path, lambda: _write_through(path, write_fn), lambda: None)
        return path
    _make_parent(path)
    try:
        tmp = _temp_sibling(path, _create_file)
    except OSError as err:
        raise _clear_error(path, err) from err

    def body() -> None:
        mode = stat.S_IMODE(tmp.stat().st_mode)  # 0o666 & ~umask
        write_fn(tmp)
        if stat.S_IMODE(tmp.stat().st_mode) != mode:  # e.g. safetensors writes its files with 0o600
            os.chmod(tmp, mode)
        _fsync(tmp)
        os.replace(tmp, path)

    _guarded(path, body, lambda: tmp.unlink(missing_ok=True))
    _fsync(path.parent, directory=True)
    return path


def _write_through(path: Path, write_fn: Callable[[Path], None]) -> None:
    """`write_fn` into a private temporary file, then its bytes into the device/FIFO/kernel file `path`
    (opened without creating or truncating anything: the node itself is never replaced).

    Nothing here waits forever: the node is opened with `O_NONBLOCK` (a FIFO with no reader is refused
    after `FIFO_READER_GRACE` seconds, where a plain `open()` blocks for ever), and a reader that takes
    nothing for `WRITE_THROUGH_TIMEOUT` seconds ends the write with `FileWriteError`."""
    with tempfile.TemporaryDirectory(prefix=TMP_PREFIX) as scratch:
        tmp = Path(scratch) / path.name
        write_fn(tmp)
        append = os.O_APPEND if stat.S_ISREG(os.stat(path).st_mode) else 0  # a redirected stdout: after its text
        fd = _open_nonblocking(path, append)
        try:
            with open(tmp, "rb") as src:
                while block := src.read(1 << 20):
                    _write_all(fd, memoryview(block), path)
        finally:
            os.close(fd)


#: Seconds a device or FIFO may take nothing before a write through it gives up.
WRITE_THROUGH_TIMEOUT = 10.0
#: Seconds a FIFO may stay without a reader (one being started) before a write to it is refused.
FIFO_READER_GRACE = 1.0


def _open_nonblocking(path: Path, append: int) -> int:
    """`os.open` for writing with `O_NONBLOCK` (never blocks); a FIFO with no reader is polled for
    `FIFO_READER_GRACE` seconds (a reader being started), then refused with one line."""
    end = time.monotonic() + FIFO_READER_GRACE
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK | append)
        except OSError as err:
            if err.errno != errno.ENXIO:
                raise
        if time.monotonic() >= end:
            raise FileWriteError(
                errno.ENXIO, f"cannot write {str(path)!r}: it is a FIFO with no reader; litkv never waits on one"
            )
        time.sleep(0.02)


def _write_all(fd: int, view: memoryview, path: Path) -> None:
    """Write `view` to the non-blocking `fd`, waiting at most `WRITE_THROUGH_TIMEOUT` s for room each time."""
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            _, ready, _ = select.select([], [fd], [], WRITE_THROUGH_TIMEOUT)
            if not ready:
                raise FileWriteError(
                    errno.EAGAIN,
                    f"cannot write {str(path)!r}: its reader took nothing for {WRITE_THROUGH_TIMEOUT:g} s",
                ) from None


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """`write_atomic` of `data`."""
    return write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_text_atomic(path: str | Path, text: str) -> Path:
    """`write_atomic` of `text` as UTF-8."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def create_private_file(path: str | Path, data: bytes) -> bool:
    """Create `path` holding `data`, mode 0600 from its first byte, atomically and only if nothing is
    there: the bytes go to a private temporary file (fsynced) that is then hard-linked to `path`, so a
    reader sees the whole file or none and a file another process created first is kept. Returns True
    when this call created it, False when `path` already existed."""
    path = Path(path)
    _make_parent(path)

    def make(tmp: Path) -> None:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))

    tmp = _temp_sibling(path, make)
    try:
        fd = os.open(tmp, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            _write_all(fd, memoryview(data), tmp)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        _fsync(path.parent, directory=True)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def save_dir_atomic(
    path: str | Path,
    write_fn: Callable[[Path], None],
    command: str | None = None,
    sources: Sequence[str | Path] = (),
    overwrite: bool = False,
) -> Path:
    """Write directory `path` atomically: `write_fn(tmp_dir)` fills a temporary directory next to it
    (with `write_atomic` for each file), which is then renamed to `path` (a symlink to a directory is
    followed; anything else at `path` is refused).

    `command`: the litkv command whose output `path` is (`"convert"`): `path` must pass
    `check_output_dir(path, command, sources, overwrite)` before anything is written, and the new
    directory gets the command's marker file. Without `command` (a directory inside an output directory
    already checked, as a fine-tuning run's `step-N/`), an existing directory `path` is replaced.

    On any error the temporary directory is removed and an existing `path` is kept, so an incomplete
    directory is never found under the name `path`.
    """
    if command is not None:
        check_output_dir(path, command, sources, overwrite, replace=True)
    path, _ = resolve_target(path, directory=True)
    _make_parent(path)
    tmp = _temp_sibling(path, lambda p: p.mkdir(mode=0o777))

    def body() -> None:
        write_fn(tmp)
        if command is not None:
            mark_output_dir(tmp, command)
            if path.exists():  # checked again: the user may have added a file while the command ran
                check_output_dir(path, command, sources, overwrite, replace=True)
        _fsync(tmp, directory=True)
        _replace_dir(tmp, path)

    _guarded(path, body, lambda: shutil.rmtree(tmp, ignore_errors=True))
    _fsync(path.parent, directory=True)
    return path


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_output_dir(
    path: str | Path,
    command: str,
    sources: Sequence[str | Path] = (),
    overwrite: bool = False,
    reuse: bool = False,
    replace: bool = False,
) -> Path:
    """Refuse an output directory `path` of `litkv command` whose writing could delete the user's files.

    Refused whatever the flags: `path` equal to, inside or above a source in `sources` (a file or
    directory the command reads), the current or home directory or one above them, and a path that
    exists but is not a directory. An existing non-empty directory is accepted only when it holds
    `command`'s marker file (`OUTPUT_MARKER`: litkv wrote it for this command before) and `overwrite`
    (or `reuse`: the command adds to it, as `finetune --resume`) is given; with `replace` (the command
    deletes it and writes it again, `save_dir_atomic`), the marker must also be a regular file listing
    exactly the files the directory holds, with their sizes and hashes
    (`litkv.core.output_marker.marker_problem`). Returns `path`.

    Raises:
        ValueError: one line naming `path` and what it would have destroyed.
    """
    given = Path(path)
    where = f"{command}: output directory {str(given)!r}"
    out = Path(os.path.realpath(given))
    for special, name in ((Path.cwd(), "the current directory"), (Path.home(), "your home directory")):
        if _is_within(Path(os.path.realpath(special)), out):
            what = name if out == Path(os.path.realpath(special)) else f"above {name}"
            raise ValueError(f"{where} is {what}; give a new directory for the output")
    for source in sources:
        src = Path(os.path.realpath(source))
        if _is_within(out, src) or _is_within(src, out):
            relation = "the source" if out == src else "inside" if _is_within(out, src) else "above"
            relation += "" if out == src else " the source"
            raise ValueError(f"{where} is {relation} {str(source)!r}; give a directory outside it")
    if not given.exists():
        return given
    if not given.is_dir():
        raise ValueError(f"{where} exists and is not a directory")
    if not any(given.iterdir()):
        return given
    marked = marker_command(given)
    if marked != command:
        by = f"it was written by litkv {marked}" if marked else f"litkv {command} did not write it"
        by += f"; its marker {OUTPUT_MARKER} is a symlink" if (given / OUTPUT_MARKER).is_symlink() else ""
        raise ValueError(f"{where} exists and is not empty ({by}); give a new or empty directory")
    if not (overwrite or reuse):
        raise ValueError(f"{where} holds an earlier litkv {command} output; give --overwrite true to replace it")
    problem = marker_problem(given, command) if replace else None
    if problem:
        raise ValueError(f"{where} is not replaced: {problem}; move them away or give a new directory")
    return given


def mark_output_dir(directory: str | Path, command: str, only: str | None = None) -> None:
    """Write `command`'s marker file into `directory` (created if needed): litkv wrote it, for `command`,
    with every file it holds now (relative path, size, sha256: `litkv.core.output_marker.file_table`).
    With `only` (a subdirectory the command itself filled during its run, as evaluate's `answers`), the
    marker's earlier list is kept and only the files under `only/` are (re)listed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files, _ = file_table(directory)
    if only is not None:
        earlier = json.loads((directory / OUTPUT_MARKER).read_text(encoding="utf-8")).get("files", {})
        files = {**earlier, **{name: rec for name, rec in files.items() if name.startswith(f"{only}/")}}
    text = json.dumps({"written_by": f"litkv {command}", "files": files}, indent=1, sort_keys=True)
    write_text_atomic(directory / OUTPUT_MARKER, text + "\n")


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
