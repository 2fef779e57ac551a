"""Gates files that prove their tensors (issue 61, item 1; the finding of item 7 "a gates file with an
edited tensor is used").

A shipped gates file is trusted by its digest listed in the package's manifest; a file litkv writes for
the user records its digest and an HMAC of it under the user's secret. An edited tensor, a relabelled
weights fingerprint or a foreign file is refused by `EvictionGates.load` and so by `load_model`, even
when the attacker recomputes the unkeyed digest.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_checkpoint import make_tiny_checkpoint

from litkv.checkpoints.checkpoint import GATES_FILE, load_model, save_gates
from litkv.core import secret
from litkv.gates.gate import MANIFEST, EvictionGates, gates_digest, shipped_digests

SHIPPED = [
    MANIFEST.parents[1] / "default" / "eviction_gates.safetensors",
    MANIFEST.parent / "smollm2-135m-instruct.safetensors",
]


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118


def _edited(path: Path, out: Path, recompute: bool, **meta: str) -> Path:
    """`path` with one gate weight changed by 1e-3 (and `meta` fields replaced); with `recompute`, its
    recorded sha256 made to match, as an attacker without the secret can."""
    tensors, header = _read(path)
    tensors["weight"] = tensors["weight"].clone()
    tensors["weight"][0, 0, 0] += 1e-3
    header.update(meta)
    if recompute:
        header["sha256"] = gates_digest(tensors, header)
    save_file(tensors, str(out), metadata=header)
    return out


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_gates_are_listed_in_the_manifest_and_an_edited_copy_is_refused(path: Path, tmp_path: Path) -> None:
    tensors, meta = _read(path)
    assert gates_digest(tensors, meta) in shipped_digests()
    EvictionGates.load(path)  # trusted by its digest
    with pytest.raises(ValueError, match="neither shipped with litkv nor signed by your litkv"):
        EvictionGates.load(_edited(path, tmp_path / "a.safetensors", recompute=False))
    with pytest.raises(ValueError, match="neither shipped with litkv nor signed by your litkv"):
        EvictionGates.load(_edited(path, tmp_path / "b.safetensors", recompute=True))
    relabelled = tmp_path / "c.safetensors"
    save_file(tensors, str(relabelled), metadata={**meta, "weights": "0" * 64})
    with pytest.raises(ValueError, match="these eviction gates are refused"):
        EvictionGates.load(relabelled)


def test_user_gates_are_signed_and_an_edit_with_a_recomputed_digest_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LITKV_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(secret, "_cached", {})
    ckpt = tmp_path / "ckpt"
    make_tiny_checkpoint(ckpt, gates_seed=1)  # gates written by save_gates, for these weights
    gates = load_model(ckpt).eviction_gates
    _, meta = _read(ckpt / GATES_FILE)
    assert len(meta["sha256"]) == 64 and len(meta["mac"]) == 64
    assert gates is not None  # signed: used

    edited = _edited(ckpt / GATES_FILE, tmp_path / "e.safetensors", recompute=False)
    with pytest.raises(ValueError, match="do not give its recorded sha256"):
        EvictionGates.load(edited)
    shutil.copy(_edited(ckpt / GATES_FILE, tmp_path / "f.safetensors", recompute=True), ckpt / GATES_FILE)
    with pytest.raises(ValueError, match="its 'mac' was not made by your litkv"):
        load_model(ckpt)
    # another user's file (signed with their secret): refused the same way
    save_gates(gates, ckpt / GATES_FILE)
    monkeypatch.setenv("LITKV_HOME", str(tmp_path / "other-user"))
    monkeypatch.setattr(secret, "_cached", {})
    with pytest.raises(ValueError, match="its 'mac' was not made by your litkv"):
        load_model(ckpt)
