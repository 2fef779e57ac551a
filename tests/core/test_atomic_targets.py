"""What is at a write's target decides how `litkv.core.atomic` writes it: a symlink is followed (its target
written atomically, the link kept), a character device, FIFO or `/dev/stdout` is written through, a
block device, socket or directory is refused with one line; none of them is ever replaced.

As root (device nodes made with mknod in the test's directory, never the machine's own /dev), as an
ordinary user (`setpriv` to nobody, running `litkv/core/atomic.py` under the system Python: it needs only the
standard library), and through a real `litkv chat` process (`/save` onto each kind of target).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from litkv.core.atomic import FileWriteError, save_dir_atomic, write_text_atomic

REPO = Path(__file__).resolve().parents[2]
ROOT = os.geteuid() == 0
NULL, FULL = os.makedev(1, 3), os.makedev(1, 7)  # Linux's /dev/null and /dev/full


def _node(path: Path, kind: int, device: int) -> Path:
    os.mknod(path, kind | 0o666, device)
    return path


def _same_node(path: Path, kind: int, device: int) -> bool:
    st = os.lstat(path)
    return stat.S_IFMT(st.st_mode) == kind and st.st_rdev == device


def test_a_symlink_is_followed_and_kept(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real.name)
    before = real.stat().st_ino
    assert write_text_atomic(link, "new") == real
    assert link.is_symlink() and os.readlink(link) == real.name
    assert real.read_text() == "new" and real.stat().st_ino != before  # replaced atomically, at the target
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "sub" / "made.json")
    write_text_atomic(dangling, "x")
    assert dangling.is_symlink() and (tmp_path / "sub" / "made.json").read_text() == "x"


@pytest.mark.skipif(not ROOT, reason="mknod needs root")
def test_a_character_device_is_written_through_never_replaced(tmp_path: Path) -> None:
    null, full = _node(tmp_path / "null", stat.S_IFCHR, NULL), _node(tmp_path / "full", stat.S_IFCHR, FULL)
    write_text_atomic(null, "discarded")
    with pytest.raises(FileWriteError, match=r"cannot write .*full.*No space left on device"):
        write_text_atomic(full, "x" * 100)
    link = tmp_path / "link-to-full"
    link.symlink_to(full)
    with pytest.raises(FileWriteError, match="No space left"):
        write_text_atomic(link, "x")
    assert _same_node(null, stat.S_IFCHR, NULL) and _same_node(full, stat.S_IFCHR, FULL) and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "link-to-full", "null"]  # no temporary left


@pytest.mark.skipif(not ROOT, reason="mknod needs root")
def test_a_block_device_and_a_socket_are_refused(tmp_path: Path) -> None:
    block = _node(tmp_path / "blk", stat.S_IFBLK, os.makedev(7, 200))  # a loop device number, never opened
    with pytest.raises(FileWriteError, match=r"it is a block device; litkv never replaces one"):
        write_text_atomic(block, "x")
    assert _same_node(block, stat.S_IFBLK, os.makedev(7, 200))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        with pytest.raises(FileWriteError, match="it is a socket"):
            write_text_atomic(tmp_path / "sock", "x")
        assert stat.S_ISSOCK(os.lstat(tmp_path / "sock").st_mode)


def test_a_fifo_is_written_through(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_text_atomic(fifo, "through the pipe")
    reader.join(10)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_directories_are_refused_and_dir_writes_follow_links(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "keep").write_text("k")
    with pytest.raises(IsADirectoryError, match=r"^\[Errno 21\] cannot write .*dir': it is a directory$"):
        write_text_atomic(tmp_path / "dir", "x")
    (tmp_path / "file").write_text("f")
    with pytest.raises(NotADirectoryError, match="cannot write directory .*file': it is a regular file"):
        save_dir_atomic(tmp_path / "file", lambda tmp: (tmp / "a").write_text("a"))
    assert (tmp_path / "file").read_text() == "f" and (tmp_path / "dir" / "keep").read_text() == "k"
    (tmp_path / "out").symlink_to("dir")
    save_dir_atomic(tmp_path / "out", lambda tmp: (tmp / "a").write_text("a"))
    assert (tmp_path / "out").is_symlink() and sorted(os.listdir(tmp_path / "dir")) == ["a"]


def test_dev_stdout_is_written_through_to_a_pipe_and_a_redirected_file(tmp_path: Path) -> None:
    """`--json_out /dev/stdout`: a link to `/proc/self/fd/1` (made here, so that a broken build can only
    replace this link, never the machine's own /dev/stdout), written through to a pipe or a file."""
    stdout = tmp_path / "stdout"
    stdout.symlink_to("/proc/self/fd/1")
    code = f"print('before', flush=True); import litkv.core.atomic as a; a.write_text_atomic({str(stdout)!r}, 'J')"
    code += "; a.write_text_atomic('/dev/fd/1', 'K')"  # a link inside /proc: never replaceable, written through
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert piped.returncode == 0 and piped.stdout == "before\nJK", piped.stderr
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        done = subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.PIPE, env=env, timeout=60)
    assert done.returncode == 0 and out.read_text() == "before\nJK", done.stderr
    assert os.readlink(stdout) == "/proc/self/fd/1"


NOBODY_SCRIPT = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("atomic", sys.argv[1])
atomic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(atomic)
d = sys.argv[2]
atomic.write_text_atomic(os.path.join(d, "link"), "new")
atomic.write_text_atomic("/dev/null", "x")
for target in ("/dev/full", d):
    try:
        atomic.write_text_atomic(target, "x")
    except (OSError, ValueError) as err:
        print(err)
"""


@pytest.mark.skipif(not ROOT or shutil.which("setpriv") is None, reason="needs root and setpriv to become nobody")
def test_as_an_ordinary_user() -> None:
    """The same rules as nobody, on the machine's own /dev/null and /dev/full (writable by everyone)."""
    with tempfile.TemporaryDirectory() as scratch:  # pytest's own tmp_path is private to root
        os.chmod(scratch, 0o755)
        _as_nobody(Path(scratch) / "w")


def _as_nobody(work: Path) -> None:
    work.mkdir()
    (work / "real").write_text("old")
    (work / "link").symlink_to("real")
    os.chown(work, 65534, 65534)
    os.chown(work / "real", 65534, 65534)
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", NOBODY_SCRIPT]
    done = subprocess.run(
        [*argv, str(REPO / "litkv" / "core" / "atomic.py"), str(work)], capture_output=True, text=True
    )
    if done.returncode != 0 and "Permission denied" in done.stderr and python == sys.executable:
        pytest.skip(f"nobody cannot run {python}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "'/dev/full': No space left on device" in lines[0] and "it is a directory" in lines[1], lines
    assert (work / "link").is_symlink() and (work / "real").read_text() == "new"
    assert _same_node(Path("/dev/null"), stat.S_IFCHR, NULL) and _same_node(Path("/dev/full"), stat.S_IFCHR, FULL)


@pytest.mark.slow
@pytest.mark.skipif(not ROOT, reason="mknod needs root")
def test_chat_save_onto_a_device_a_link_and_a_directory(tmp_path: Path) -> None:
    """A real `litkv chat`: `/save` onto a device node, a symlink and a directory (the round's finding:
    as root `/save /dev/full` turned the device into a regular file)."""
    full = _node(tmp_path / "full", stat.S_IFCHR, FULL)
    real = tmp_path / "real.safetensors"  # absent: a file that is not a session is never replaced (issue 47)
    (tmp_path / "link.safetensors").symlink_to(real.name)
    (tmp_path / "dir").mkdir()
    saves = (full, tmp_path / "link.safetensors", tmp_path / "dir")
    lines = ["And it came to pass", *(f"/save {path}" for path in saves)]
    cmd = [sys.executable, "-m", "litkv", "chat", "--kv_cache", "h2o", "--kv_cache.cache_length", "64"]
    cmd += ["--temperature", "0", "--num_threads", "1", "--max_new_tokens", "4"]
    done = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 2 and "No space left on device" in errors[0] and "it is a directory" in errors[1], errors
    assert _same_node(full, stat.S_IFCHR, FULL)
    assert (tmp_path / "link.safetensors").is_symlink() and real.read_bytes()[8:9] == b"{"  # a safetensors now
    assert sorted(os.listdir(tmp_path / "dir")) == []
