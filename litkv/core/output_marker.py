"""What a command's output directory holds, as its marker file records it (`OUTPUT_MARKER`).

A litkv command that writes a directory (`convert`, `evaluate`, `finetune`, `download`) leaves the
marker `.litkv-output.json` in it: `{"written_by": "litkv COMMAND", "files": {relative path: {"size":
bytes, "sha256": hex}}}`, every file it wrote (`file_table`). `--overwrite true` replaces the directory
only when `marker_problem` finds nothing: the marker is a regular file (not a symlink) naming the
command and listing files, and the directory holds exactly those files, each of its recorded size and
sha256. A file the user added, a copied or hand-written marker (which lists other files, other hashes or
none) or a symlinked marker is refused, naming what would have been deleted. The writes themselves are
`litkv.core.atomic`'s (`check_output_dir`, `mark_output_dir`, `save_dir_atomic`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

__all__ = ["OUTPUT_MARKER", "file_table", "marker_command", "marker_problem"]

#: The marker file a command's output directory holds (`litkv.core.atomic.check_output_dir`).
OUTPUT_MARKER = ".litkv-output.json"
#: Names a refusal lists at most.
_SHOWN = 8


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_table(directory: str | Path) -> tuple[dict[str, dict[str, object]], list[str]]:
    """Every regular file under `directory` but the marker (relative POSIX path -> `{"size", "sha256"}`),
    and the relative paths of what is neither a regular file nor a directory (symlinks, FIFOs, sockets):
    symlinks are never followed."""
    root = Path(directory)
    table: dict[str, dict[str, object]] = {}
    others: list[str] = []
    for top, dirs, files in os.walk(root, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(top) / name
            rel = path.relative_to(root).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISDIR(mode) or rel == OUTPUT_MARKER:
                continue
            if stat.S_ISREG(mode):
                table[rel] = {"size": path.lstat().st_size, "sha256": _sha256(path)}
            else:
                others.append(rel)
    return table, sorted(others)


def _read_marker(directory: Path) -> tuple[dict | None, str | None]:
    """The marker's JSON object, or `None` and why it is not one litkv wrote (a symlink, not a regular
    file, unreadable, not a JSON object)."""
    marker = directory / OUTPUT_MARKER
    try:
        mode = marker.lstat().st_mode
    except OSError:
        return None, "it has no marker"
    if stat.S_ISLNK(mode):
        return None, f"its marker {OUTPUT_MARKER} is a symlink"
    if not stat.S_ISREG(mode):
        return None, f"its marker {OUTPUT_MARKER} is not a regular file"
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, f"its marker {OUTPUT_MARKER} is not readable JSON"
    if not isinstance(data, dict):
        return None, f"its marker {OUTPUT_MARKER} is not a JSON object"
    return data, None


def marker_command(directory: str | Path) -> str | None:
    """The command named by `directory`'s marker (`None`: no marker, or not one litkv wrote)."""
    data, _ = _read_marker(Path(directory))
    written_by = data.get("written_by") if data is not None else None
    return written_by.removeprefix("litkv ") if isinstance(written_by, str) else None


def _names(paths: list[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:_SHOWN])
    return shown + (f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else "")


def marker_problem(directory: str | Path, command: str) -> str | None:
    """Why replacing `directory` could delete a file litkv did not write for `command` (one phrase naming
    the files), or `None` when its marker lists exactly the files it holds, with their sizes and hashes."""
    directory = Path(directory)
    data, why = _read_marker(directory)
    if data is None:
        return why
    if data.get("written_by") != f"litkv {command}":
        return f"its marker names {str(data.get('written_by'))[:40]!r}, not litkv {command}"
    listed = data.get("files")
    if not isinstance(listed, dict):
        return "its marker lists no files (hand-written, copied, or written by an older litkv)"
    table, others = file_table(directory)
    unlisted = sorted(set(table) - set(listed)) + others
    if unlisted:
        return f"it holds files litkv {command} did not write: {_names(unlisted)}"
    changed = sorted(name for name, record in listed.items() if table.get(name) != record)
    if changed:
        return f"its marker does not match the files (changed or missing: {_names(changed)})"
    return None
