"""The per-user secret that authenticates what litkv writes where others may write too.

A state store's directory (the prefix store, serve's `--state_dir`, `--block_dir`) or a checkpoint's
eviction gates may sit where another user or process can write. A checksum anyone can recompute proves
nothing there, so what litkv reads back from such a place carries an HMAC-SHA256 (`mac`) under a key the
directory does not hold: by default the user's secret, 32 random bytes created once, mode 0600, in
`$LITKV_HOME/secret.key` (`litkv_home()`, default `~/.cache/litkv`); a caller may give its own key
(`check_key`), e.g. one shared by the processes that share a store. The threat model is in
docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
from pathlib import Path

__all__ = ["KEY_BYTES", "SECRET_FILE", "check_key", "litkv_home", "mac", "macs_equal", "user_secret"]

#: Bytes of the secret created for a user (and the fewest a given key may have).
KEY_BYTES = 32
#: The secret's file name under `litkv_home()`.
SECRET_FILE = "secret.key"

_lock = threading.Lock()
_cached: dict[str, bytes] = {}


def litkv_home() -> Path:
    """`$LITKV_HOME`, default `~/.cache/litkv`."""
    return Path(os.environ.get("LITKV_HOME") or Path.home() / ".cache" / "litkv")


def check_key(key: object, what: str = "key") -> bytes:
    """`key` as bytes: a `bytes` value of at least `KEY_BYTES` bytes (ValueError naming `what` otherwise)."""
    if not isinstance(key, (bytes, bytearray)) or len(key) < KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ValueError(f"{what} must be at least {KEY_BYTES} random bytes, got {got}")
    return bytes(key)


def user_secret() -> bytes:
    """The user's secret (`$LITKV_HOME/secret.key`), created with mode 0600 on first use.

    Raises:
        ValueError: one line naming the file, when it is a symlink or not a regular file, is readable or
            writable by others (group or world), belongs to another user, or holds fewer than `KEY_BYTES`
            bytes; or when it cannot be created.
    """
    path = litkv_home() / SECRET_FILE
    with _lock:
        cached = _cached.get(str(path))
        if cached is not None:
            return cached
        if not os.path.lexists(path):
            _create(path)
        key = _read(path)
        _cached[str(path)] = key
        return key


def _create(path: Path) -> None:
    """Write a fresh secret to `path` (mode 0600 from its first byte; a reader sees the whole key or none;
    one another process created first is kept)."""
    from litkv.core.atomic import create_private_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        create_private_file(path, secrets.token_bytes(KEY_BYTES))
    except OSError as err:
        where = f"{str(path)!r} (set LITKV_HOME to a writable place)"
        raise ValueError(f"cannot create litkv's secret {where}: {err}") from None


def _read(path: Path) -> bytes:
    """The secret in `path`, refused unless it is the user's own regular file that only the user can read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        raise ValueError(f"litkv's secret {str(path)!r} cannot be read (a symlink is refused): {err}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"litkv's secret {str(path)!r} is not a regular file")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise ValueError(f"litkv's secret {str(path)!r} belongs to another user (uid {st.st_uid})")
        if st.st_mode & 0o077:
            raise ValueError(
                f"litkv's secret {str(path)!r} has mode {stat.S_IMODE(st.st_mode):o}: others may read or write it; "
                "remove it (a new one is created) or chmod 600 it"
            )
        key = os.read(fd, 4096)
    finally:
        os.close(fd)
    return check_key(key, f"litkv's secret {str(path)!r}")


def mac(key: bytes, purpose: str, digest: str) -> str:
    """HMAC-SHA256 (hex) under `key` of a sha256 `digest` of what is authenticated, for `purpose` (a
    state file's and a gates file's macs are never interchangeable)."""
    return hmac.new(key, f"litkv:{purpose}:{digest}".encode(), hashlib.sha256).hexdigest()


def macs_equal(a: object, b: str) -> bool:
    """Whether the recorded mac `a` is `b` (constant time)."""
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())
