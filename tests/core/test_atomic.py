"""`litkv.core.atomic`: the one write path. Modes from the umask, no partial file on any failure, one clear
error for space/permission/read-only failures, stale temporary files, and a scan of the package proving
that no other module writes a file by itself."""

from __future__ import annotations

import ast
import errno
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import litkv
from litkv.core.atomic import (
    TMP_PREFIX,
    FileWriteError,
    is_temp_name,
    remove_stale_temp_files,
    save_dir_atomic,
    temp_files,
    write_atomic,
    write_bytes_atomic,
    write_text_atomic,
)
from litkv.states.state import CacheState, snapshot

PACKAGE = Path(litkv.__file__).parent


# -- the source scan -------------------------------------------------------------------------------

ATOMIC_CALLS = {"write_atomic", "save_dir_atomic", "write_bytes_atomic", "write_text_atomic"}
WRITING_ATTRS = {"write_text", "write_bytes", "savefig", "save_pretrained", "to_csv", "to_parquet"}
WRITING_NAMES = {"save_file", "copyfile", "copy2", "copytree", "move"}


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        base = func.value.id if isinstance(func.value, ast.Name) else ""
        return f"{base}.{func.attr}" if base else f".{func.attr}"
    return func.id if isinstance(func, ast.Name) else ""


def _open_mode(node: ast.Call) -> str:
    mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "r"


def _is_write(node: ast.Call) -> bool:
    """Whether a call writes a file (by the names litkv and its libraries use for that)."""
    name = _call_name(node)
    short = name.rsplit(".", 1)[-1]
    if name in ("open", "io.open", "builtins.open") or name.endswith(".open") and name != "os.open":
        return name != "safe_open" and any(c in _open_mode(node) for c in "wax+")
    if name == "os.open":
        return any("O_WRONLY" in ast.unparse(a) or "O_RDWR" in ast.unparse(a) for a in node.args[1:])
    if name in ("yaml.dump", "yaml.safe_dump", "json.dump"):  # to a stream (yaml.dump(data) returns text)
        return len(node.args) > 1 or any(k.arg == "stream" for k in node.keywords)
    return name == "torch.save" or short in WRITING_ATTRS or short in WRITING_NAMES


def _callbacks(tree: ast.AST) -> tuple[set[int], set[str]]:
    """Lambdas (by id) and function names given to an atomic-write call (directly or through `partial`)."""
    lambdas, names = set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or _call_name(node).rsplit(".", 1)[-1] not in ATOMIC_CALLS:
            continue
        for arg in node.args[1:]:
            if isinstance(arg, ast.Lambda):
                lambdas.add(id(arg))
            elif isinstance(arg, ast.Name):
                names.add(arg.id)
            elif isinstance(arg, ast.Call) and _call_name(arg).endswith("partial") and arg.args:
                lambdas.add(id(arg))  # partial(f, ...) given to the atomic call: f writes the temporary file
    return lambdas, names


def unsafe_writes(source: str, filename: str) -> list[str]:
    """`file:line: call` for each call that writes a file outside a callback given to `litkv.core.atomic`."""
    tree = ast.parse(source, filename)
    lambdas, names = _callbacks(tree)
    found: list[str] = []

    def visit(node: ast.AST, allowed: bool) -> None:
        if isinstance(node, ast.Lambda) and id(node) in lambdas:
            allowed = True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            allowed = True
        if isinstance(node, ast.Call) and id(node) in lambdas:
            allowed = True
        if isinstance(node, ast.Call) and _is_write(node) and not allowed:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:80]}")
        for child in ast.iter_child_nodes(node):
            visit(child, allowed)

    visit(tree, False)
    return found


def _package_sources() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "atomic.py":
            yield path


def test_no_module_writes_a_file_outside_the_atomic_module() -> None:
    found = [w for p in _package_sources() for w in unsafe_writes(p.read_text(), str(p.relative_to(PACKAGE)))]
    assert found == [], "files written without litkv.core.atomic:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "with open(p, 'w') as f: f.write('x')",
        "open(p, mode='ab')",
        "Path(p).write_text('x')",
        "p.write_bytes(b'')",
        "torch.save(obj, p)",
        "save_file(tensors, str(p))",
        "fig.savefig(p)",
        "shutil.copyfile(a, b)",
        "yaml.dump(data, f)",
        "os.open(p, os.O_WRONLY | os.O_CREAT)",
        "def write(tmp):\n    tmp.write_text('x')\nwrite(p)",  # a helper that is not given to write_atomic
        "write_atomic(p, lambda tmp: tmp.write_text('x'))\nq.write_text('y')",
    ],
)
def test_the_scan_finds_writes(source: str) -> None:
    assert unsafe_writes(source, "m.py"), source


@pytest.mark.parametrize(
    "source",
    [
        "write_atomic(p, lambda tmp: tmp.write_text('x'))",
        "def fill(tmp):\n    torch.save(x, tmp)\nwrite_atomic(p, fill)",
        "write_atomic(p, partial(shutil.copyfile, src))",
        "save_dir_atomic(d, lambda tmp: save_file(t, str(tmp / 'a')))",
        "with open(p) as f: f.read()",
        "with safe_open(p, framework='pt') as f: pass",
    ],
)
def test_the_scan_accepts_atomic_writes_and_reads(source: str) -> None:
    assert unsafe_writes(source, "m.py") == [], source


# -- modes, contents, failures ---------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _with_umask(umask: int, fn):  # noqa: ANN001, ANN202
    old = os.umask(umask)
    try:
        return fn()
    finally:
        os.umask(old)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_get_the_umask_mode(tmp_path: Path, umask: int) -> None:
    """Every kind of file litkv writes: 0o666 & ~umask (0644 under 022), as a plain open() gives."""
    from tiny_checkpoint import checkpoint_config

    model = litkv.GPT(checkpoint_config()).eval()
    model.set_kv_caches(model.build_kv_caches(litkv.KVCacheConfig(cache_length=8), 1))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None])
    state = snapshot(model)

    def write() -> None:
        state.save(tmp_path / "s.safetensors")
        write_text_atomic(tmp_path / "t.json", "{}")
        write_bytes_atomic(tmp_path / "b.bin", b"x")

    _with_umask(umask, write)
    for name in ("s.safetensors", "t.json", "b.bin"):
        assert _mode(tmp_path / name) == 0o666 & ~umask, name
    assert CacheState.load(tmp_path / "s.safetensors").batch_size == 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT])
def test_space_and_permission_errors_name_the_path_and_keep_the_old_file(tmp_path: Path, code: int) -> None:
    target = tmp_path / "result.json"
    write_text_atomic(target, "old")

    def half_written(tmp: Path) -> None:
        tmp.write_text("new, but only half of it")
        raise OSError(code, os.strerror(code))

    with pytest.raises(FileWriteError) as info:
        write_atomic(target, half_written)
    assert info.value.errno == code and str(target) in str(info.value) and os.strerror(code) in str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="POSIX file size limits")
def test_a_real_failed_write_through_safetensors_keeps_the_old_file(tmp_path: Path) -> None:
    """A real write failure in the middle of a cache state (the file size limit stands in for a full
    disk: the kernel refuses the write with EFBIG): one FileWriteError naming the path, the previous
    session file intact and loadable, no temporary file left."""
    import resource

    from tiny_checkpoint import checkpoint_config

    model = litkv.GPT(checkpoint_config()).eval()
    model.set_kv_caches(model.build_kv_caches(litkv.KVCacheConfig(cache_length=64), 1))
    with torch.no_grad():
        model(torch.arange(2)[None], torch.arange(2)[None])
        small = snapshot(model)
        model(torch.arange(60)[None], torch.arange(2, 62)[None])
        large = snapshot(model)
    target = tmp_path / "session.safetensors"
    small.save(target)
    limit = target.stat().st_size + 1000
    assert large.nbytes() > limit
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        with pytest.raises(FileWriteError, match="cannot write .*session.safetensors") as info:
            large.save(target)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert info.value.errno == errno.EFBIG
    assert [p.name for p in tmp_path.iterdir()] == ["session.safetensors"]
    assert CacheState.load(target).layers[0].num_filled == 2


def test_a_serialiser_error_that_hides_the_errno_is_recognised(tmp_path: Path) -> None:
    """safetensors reports a full disk as `SafetensorError: ... (os error 28)`, not as an OSError."""

    class SerialiserError(Exception):
        pass

    def fail(tmp: Path) -> None:
        raise SerialiserError("Error while serializing: IoError(No space left on device (os error 28))")

    with pytest.raises(FileWriteError, match="No space left"):
        write_atomic(tmp_path / "x.safetensors", fail)
    assert list(tmp_path.iterdir()) == []


def test_other_errors_pass_through_and_leave_nothing(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError):
        write_atomic(tmp_path / "x", lambda tmp: 1 / 0)
    with pytest.raises(KeyboardInterrupt):
        save_dir_atomic(tmp_path / "d", lambda tmp: (_ for _ in ()).throw(KeyboardInterrupt))
    assert list(tmp_path.iterdir()) == []


def test_bad_targets_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        write_text_atomic(tmp_path / "file" / "x.json", "{}")
    with pytest.raises(IsADirectoryError, match="it is a directory"):
        write_text_atomic(tmp_path / "dir", "{}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_a_clear_error(tmp_path: Path) -> None:  # pragma: no cover (CI runs as root)
    (tmp_path / "ro").mkdir()
    write_text_atomic(tmp_path / "ro" / "a", "old")
    os.chmod(tmp_path / "ro", 0o555)
    try:
        with pytest.raises(FileWriteError, match="Permission denied"):
            write_text_atomic(tmp_path / "ro" / "a", "new")
    finally:
        os.chmod(tmp_path / "ro", 0o755)
    assert (tmp_path / "ro" / "a").read_text() == "old"


# -- temporary names -------------------------------------------------------------------------------


def test_temp_names_of_dead_writers_are_removed_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"{TMP_PREFIX}a.safetensors.{dead_pid}-0123abcd"
    legacy = tmp_path / ".s.safetensors.tmp123"  # CacheState.save of earlier versions
    live = tmp_path / f"{TMP_PREFIX}b.safetensors.{os.getppid()}-89abcdef"
    data = tmp_path / "c.safetensors"
    for path in (stale, legacy, live, data):
        path.write_bytes(b"\0" * 10)
    assert all(is_temp_name(p.name) for p in (stale, legacy, live)) and not is_temp_name(data.name)
    assert temp_files(tmp_path) == sorted([stale, legacy, live])
    with pytest.warns(UserWarning, match="removed 2 temporary"):
        assert remove_stale_temp_files(tmp_path, kind="test") == sorted([stale, legacy])
    assert live.exists() and data.exists() and not stale.exists() and not legacy.exists()


def test_a_killed_writer_leaves_only_a_temp_name_that_no_reader_takes(tmp_path: Path) -> None:
    """A real process SIGKILLed in the middle of writing: the target is absent or complete."""
    code = (
        "import sys, time; from litkv.core.atomic import write_atomic\n"
        "def slow(tmp):\n"
        "    tmp.write_bytes(b'partial'); print('writing', flush=True); time.sleep(60)\n"
        "write_atomic(sys.argv[1], slow)\n"
    )
    target = tmp_path / "out.json"
    proc = subprocess.Popen([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
    proc.kill()
    proc.wait()
    assert not target.exists()
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and is_temp_name(left[0].name)
    with pytest.warns(UserWarning):
        assert remove_stale_temp_files(tmp_path) == left
    assert list(tmp_path.iterdir()) == []
