"""A state file is data, never code: a file naming a policy by `"module:Class"` never makes litkv
import that module (its top-level code would run), through the Python API, `litkv chat --session`
and chat's `/load`. The file is crafted with a valid checksum (anyone can recompute it)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import random_gpt, tiny_config

from litkv import CacheState, KVCacheConfig, snapshot
from litkv.state import _digest

REPO = Path(__file__).resolve().parents[1]
EVIL = "litkv_evil_side_effect_mod"


def _plant_module(directory: Path) -> Path:
    """A module on `directory` whose import writes a marker file (the side effect to watch for)."""
    marker = directory / "imported.marker"
    code = f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\nclass Foo: pass\n"
    (directory / f"{EVIL}.py").write_text(code)
    return marker


def _rewrite_policy(path: Path, policy: str) -> None:
    """Name `policy` in every layer's config and recompute the checksum, as an attacker would."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["litkv"])
    for layer in meta["layers"]:
        layer["config"]["policy"] = policy
    meta.pop("digest")
    meta["digest"] = _digest(meta, tensors)
    header["__metadata__"]["litkv"] = json.dumps(meta, sort_keys=True)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


@pytest.fixture()
def crafted(tmp_path: Path) -> tuple[Path, Path]:
    """(a state file naming `EVIL:Foo` with a valid checksum, the marker its import would write)."""
    model = random_gpt(tiny_config("SmolLM2-135M"), seed=3)
    model.set_kv_caches(model.build_kv_caches(KVCacheConfig("h2o", cache_length=16, chunk_size=8), 1))
    with torch.inference_mode():
        model(torch.arange(10)[None], torch.arange(10)[None])
    path = tmp_path / "evil.safetensors"
    snapshot(model).save(path)
    _rewrite_policy(path, f"{EVIL}:Foo")
    return path, _plant_module(tmp_path)


def test_api_load_imports_nothing(crafted: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    path, marker = crafted
    monkeypatch.syspath_prepend(str(marker.parent))
    with pytest.raises(ValueError, match="not imported in this process") as err:
        CacheState.load(path)
    assert "import the module that defines it" in str(err.value) and "\n" not in str(err.value)
    assert EVIL not in sys.modules and not marker.exists()


def test_unregistered_name_is_refused(crafted: tuple[Path, Path]) -> None:
    path, _ = crafted
    _rewrite_policy(path, "no-such-policy")
    with pytest.raises(ValueError, match="not registered in this process"):
        CacheState.load(path)


def test_a_policy_from_an_imported_module_still_loads(crafted: tuple[Path, Path]) -> None:
    """`module:Class` of a module the process has imported is accepted (nothing new runs)."""
    path, _ = crafted
    _rewrite_policy(path, "litkv.kvcache.h2o:H2OKVCache")
    state = CacheState.load(path)
    assert state.configs[0].policy == "litkv.kvcache.h2o:H2OKVCache"


def _chat_process(args: list[str], text: str, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "litkv", "chat", "--num_threads", "1", "--max_new_tokens", "4", *args]
    return subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def test_chat_session_and_load_import_nothing(crafted: tuple[Path, Path]) -> None:
    """`litkv chat --session F` refuses F with one line; `/load F` inside a chat is one error line and
    the chat goes on; in neither case did the module's code run."""
    path, marker = crafted
    done = _chat_process(["--session", str(path)], "hello\n", marker.parent)
    assert done.returncode != 0 and "not imported in this process" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not marker.exists()
    done = _chat_process([], f"/load {path}\n/stats\n", marker.parent)
    assert done.returncode == 0, done.stderr
    assert "not imported in this process" in done.stdout + done.stderr
    assert "tokens seen: 0" in done.stdout and not marker.exists()
