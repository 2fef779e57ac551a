"""A state file is data, never code: a file naming a policy by `"module:Class"` never makes litkv
import that module (its top-level code would run), through the Python API, `litkv chat --session`
and chat's `/load`. The file is crafted with a valid checksum (anyone can recompute it)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tiny_gpt

from litkv import CacheState, KVCacheConfig, restore, snapshot
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT
from litkv.states.state_file import digest as _digest

REPO = Path(__file__).resolve().parents[2]
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
    model = tiny_gpt(3)
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


def _chat_process(args: list[str], text: str, pythonpath: Path) -> subprocess.Popen[str]:
    """`litkv chat ARGS` started with `text` as its whole standard input (`_finish` waits for it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "litkv", "chat", "--num_threads", "1", "--max_new_tokens", "4", *args]
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        cmd, stdin=read_end, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env
    )
    os.close(read_end)
    os.write(write_end, text.encode())  # a few bytes: less than a pipe's buffer
    os.close(write_end)
    return proc


def _finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_chat_session_and_load_import_nothing(crafted: tuple[Path, Path]) -> None:
    """`litkv chat --session F` refuses F with one line; `/load F` inside a chat is one error line and
    the chat goes on; in neither case did the module's code run. (The two processes run at once: neither
    writes F.)"""
    path, marker = crafted
    refused = _chat_process(["--session", str(path)], "hello\n", marker.parent)
    loaded = _chat_process([], f"/load {path}\n/stats\n", marker.parent)
    done = _finish(refused)
    assert done.returncode != 0 and "not imported in this process" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = _finish(loaded)
    assert done.returncode == 0, done.stderr
    assert "not imported in this process" in done.stdout + done.stderr
    assert "tokens seen: 0" in done.stdout and not marker.exists()


# -- meaning checks: crafted files with a valid checksum ------------------------------------------

Mutation = Callable[[dict[str, torch.Tensor], dict[str, Any]], None]


def _rewrite(path: Path, mutate: Mutation) -> None:
    """Apply `mutate(tensors, meta)` to a state file and recompute its checksum, as an attacker would."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt", device="cpu") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        meta = json.loads((f.metadata() or {})["litkv"])
    meta.pop("digest")
    mutate(tensors, meta)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta["digest"] = _digest(meta, tensors)
    save_file(tensors, str(path), metadata={"litkv": json.dumps(meta, sort_keys=True)})


def _model(storage: str = "float") -> GPT:
    model = tiny_gpt(3)
    model.set_kv_caches(model.build_kv_caches(KVCacheConfig("h2o", cache_length=16, chunk_size=8, storage=storage), 2))
    with torch.inference_mode():
        model(torch.arange(20).view(2, 10), torch.arange(10)[None].expand(2, 10))
    return model


def _saved(tmp_path: Path, storage: str = "float") -> tuple[GPT, Path]:
    model = _model(storage)
    path = tmp_path / f"{storage}.safetensors"
    snapshot(model, token_ids=[list(range(10)), list(range(10, 20))]).save(path)
    return model, path


def _set(name: str, index: tuple[int, ...], value: float) -> Mutation:
    def mutate(tensors: dict[str, torch.Tensor], _: dict[str, Any]) -> None:
        tensors[name][index] = value

    return mutate


def _last_pos_behind(tensors: dict[str, torch.Tensor], _: dict[str, Any]) -> None:
    tensors["last_pos"] = tensors["last_pos"] - 3


def _last_pos_extra_row(tensors: dict[str, torch.Tensor], _: dict[str, Any]) -> None:
    tensors["last_pos"] = torch.cat((tensors["last_pos"], tensors["last_pos"][:1]))


def _duplicate_position(tensors: dict[str, torch.Tensor], _: dict[str, Any]) -> None:
    tensors["layer.0.positions"][1, 0, 4] = tensors["layer.0.positions"][1, 0, 2]


def _narrow_keys(tensors: dict[str, torch.Tensor], _: dict[str, Any]) -> None:
    tensors["layer.1.storage.keys"] = tensors["layer.1.storage.keys"][..., :8]


def _fewer_heads(tensors: dict[str, torch.Tensor], _: dict[str, Any]) -> None:
    tensors["layer.0.slot.attn_sums"] = tensors["layer.0.slot.attn_sums"][:, :1]


def _num_filled(value: int) -> Mutation:
    def mutate(_: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        meta["layers"][0]["num_filled"] = value

    return mutate


def _few_filled(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Untrimmed (all 16 slots, the unwritten ones empty), with num_filled 5 below the 10 held positions."""
    meta["layers"][0]["num_filled"], meta["layers"][0]["length"] = 5, 16
    for name in ("positions", "storage.keys", "storage.values"):
        t = tensors[f"layer.0.{name}"]
        pad = t.new_full((*t.shape[:2], 6, *t.shape[3:]), -1 if name == "positions" else 0)
        tensors[f"layer.0.{name}"] = torch.cat((t, pad), dim=2)


CRAFTED = {
    "last_pos behind": (_last_pos_behind, "layer 0 positions of row 0 go up to 9, past last_pos 6"),
    "position 1e9": (_set("layer.0.positions", (0, 1, 3), 10**9), "layer 0 positions of row 0 go up to 1000000000"),
    "position -5": (_set("layer.1.positions", (1, 0, 0), -5), "layer 1 positions must be >= -1"),
    "NaN key": (_set("layer.0.storage.keys", (1, 1, 2, 3), float("nan")), "layer 0 storage.keys holds non-finite"),
    "NaN value": (_set("layer.1.storage.values", (0, 0, 9, 0), float("nan")), "layer 1 storage.values holds non"),
    "inf policy state": (_set("layer.1.slot.attn_sums", (0, 0, 0), float("inf")), "layer 1 slot.attn_sums holds"),
    "last_pos extra row": (_last_pos_extra_row, r"last_pos must have 2 rows \(the state's\), got shape \(3,\)"),
    "duplicate position": (_duplicate_position, "layer 0 positions repeat a position"),
    "narrow keys": (_narrow_keys, r"layer 1 storage.keys must have head size 16, got shape \(2, 2, 10, 8\)"),
    "fewer heads": (_fewer_heads, r"layer 0 slot.attn_sums must have shape \(2, 2, 16, ...\)"),
    "num_filled too large": (_num_filled(17), r"layer 0 num_filled must be in \[0, 16\], got 17"),
    "num_filled below positions": (_few_filled, "layer 0 num_filled is 5, but a row holds 10 positions"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_state_is_refused_naming_the_field(tmp_path: Path, case: str) -> None:
    _, path = _saved(tmp_path)
    CacheState.load(path)  # valid before the change
    mutate, message = CRAFTED[case]
    _rewrite(path, mutate)
    with pytest.raises(ValueError, match=message) as err:
        CacheState.load(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_quantised_scales_must_be_finite(tmp_path: Path) -> None:
    model, path = _saved(tmp_path, "int4")
    restore(model, CacheState.load(path))
    _rewrite(path, _set("layer.1.storage.scales", (1, 0, 3, 1, 0), float("nan")))
    with pytest.raises(ValueError, match="layer 1 storage.scales holds non-finite"):
        CacheState.load(path)


def test_token_ids_outside_the_vocabulary_are_refused_at_restore(tmp_path: Path) -> None:
    model, path = _saved(tmp_path)

    def mutate(_: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        meta["token_ids"][1][4] = model.config.vocab_size

    _rewrite(path, mutate)
    state = CacheState.load(path)  # the vocabulary is the model's: known at restore
    with pytest.raises(ValueError, match=rf"token_ids of row 1 must be in \[0, {model.config.vocab_size}\), got"):
        restore(model, state)


def test_an_untouched_file_still_restores_bitwise(tmp_path: Path) -> None:
    model, path = _saved(tmp_path)
    before = snapshot(model)
    _rewrite(path, lambda _t, _m: None)
    restore(model, CacheState.load(path))
    after = snapshot(model)
    for a, b in zip(before.layers, after.layers, strict=True):
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


# -- fingerprint: every weight --------------------------------------------------------------------

PARAMS = [
    ("transformer.h.0.attn.qkv.weight", 0),
    ("transformer.h.1.attn.qkv.weight", "middle"),
    ("transformer.h.1.attn.proj.weight", "last"),
    ("transformer.h.0.norm_2.weight", 17),
    ("transformer.wte.weight", "middle"),
    ("lm_head.weight", "last"),
]


def _nudge(model: GPT, name: str, where: int | str) -> None:
    """Multiply one element of parameter `name` by 1 + 1e-3, in place (with a version bump)."""
    p = dict(model.named_parameters())[name]
    i = {"middle": p.numel() // 2, "last": p.numel() - 1}.get(where, where)  # type: ignore[call-overload]
    index = torch.unravel_index(torch.tensor(i), p.shape)  # in row-major order, whatever the layout
    with torch.no_grad():
        p[index] *= 1 + 1e-3


@pytest.mark.parametrize(("name", "where"), PARAMS)
def test_one_weight_changed_by_1e3_is_refused(name: str, where: int | str) -> None:
    state = snapshot(_model())
    other = _model()  # same seed: the same weights
    restore(other, state)
    _nudge(other, name, where)
    with pytest.raises(ValueError, match="other weights"):
        restore(other, state)


def test_in_place_update_after_memoisation_is_refused() -> None:
    model = _model()
    state = snapshot(model)
    fp = model_fingerprint(model)
    assert model_fingerprint(model) == fp  # memoised
    with torch.no_grad():
        model.transformer.h[1].mlp.fc_2.weight[63, 5] *= 1 + 1e-3
    assert model_fingerprint(model) != fp
    with pytest.raises(ValueError, match="other weights"):
        restore(model, state)


def test_inference_mode_weights_are_hashed_every_time() -> None:
    """Inference tensors have no version counter: the fingerprint is recomputed, so a change is seen."""
    with torch.inference_mode():
        model = tiny_gpt(3)
        fp = model_fingerprint(model)
        model.transformer.h[0].norm_1.weight[3] *= 1 + 1e-3
        assert model_fingerprint(model) != fp


# -- clear errors ---------------------------------------------------------------------------------


def test_load_of_a_directory_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory, not a cache state file"):
        CacheState.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CacheState.load(tmp_path / "missing.safetensors")


def test_snapshot_to_an_unknown_device_names_it() -> None:
    with pytest.raises(ValueError, match="snapshot device 'foo' is not a torch device") as err:
        snapshot(_model(), device="foo")
    assert "\n" not in str(err.value)
