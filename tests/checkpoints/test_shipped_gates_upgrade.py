"""Gates litkv shipped before are replaced by the current ones in a known model's directory, and a user's
own gates never are (`litkv.checkpoints.known.add_shipped_gates`, the manifest's `superseded` entries)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from litkv.checkpoints import known
from litkv.gates.gate import MANIFEST, shipped_digests

NAME = "smollm2-135m-instruct"


@pytest.fixture
def assets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package's gates folder in `tmp_path`: the current file and a manifest naming one older file."""
    folder = tmp_path / "assets" / "gates"
    folder.mkdir(parents=True)
    (folder / f"{NAME}.safetensors").write_bytes(b"current gates")
    old = hashlib.sha256(b"old gates").hexdigest()
    manifest = {"digests": {}, "superseded": {f"gates/{NAME}.safetensors": [{"gates_digest": "x", "file_sha256": old}]}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(known, "shipped_gates_file", lambda name: folder / f"{name}.safetensors")
    return folder


def test_missing_gates_are_added_once(assets: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert known.add_shipped_gates(NAME, ckpt)
    assert not known.add_shipped_gates(NAME, ckpt)
    assert (ckpt / "eviction_gates.safetensors").read_bytes() == b"current gates"


def test_superseded_gates_are_replaced(assets: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "eviction_gates.safetensors").write_bytes(b"old gates")
    assert known.add_shipped_gates(NAME, ckpt)
    assert (ckpt / "eviction_gates.safetensors").read_bytes() == b"current gates"


@pytest.mark.parametrize("content", [b"gates the user trained", b"old gates, edited"])
def test_a_users_gates_are_kept(assets: Path, tmp_path: Path, content: bytes) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "eviction_gates.safetensors").write_bytes(content)
    assert not known.add_shipped_gates(NAME, ckpt)
    assert (ckpt / "eviction_gates.safetensors").read_bytes() == content


def test_the_real_manifest_trusts_what_it_supersedes() -> None:
    """Every superseded entry of the package's manifest names a file litkv shipped for a known model (a
    gates file still trusted by its digest) and is not the current file."""
    manifest = json.loads(MANIFEST.read_text(encoding="utf-8"))
    current = {hashlib.sha256(p.read_bytes()).hexdigest() for p in MANIFEST.parent.glob("*.safetensors")}
    for key, entries in manifest.get("superseded", {}).items():
        assert Path(key).stem in known.MODELS, key
        for entry in entries:
            assert entry["gates_digest"] in shipped_digests()
            assert entry["file_sha256"] not in current
