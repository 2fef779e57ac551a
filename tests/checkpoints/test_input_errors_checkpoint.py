"""Hostile inputs around checkpoints and fine-tuning (issue 9): corrupt checkpoint files give one line
`error: ...` naming the file, crafted pickles are never executed, NaN/inf weights are refused, checkpoint
writes are atomic (temporary names, umask, stale leftovers removed, kill -9 leaves nothing half-written
that loads), and the fine-tuning inputs (`--mode`, JSON data, `--resume`) are checked with clear errors.

Corrupt checkpoints are built from the shipped default model (`litkv/assets/default`): every file is a
symlink into the package except the one the test breaks, which is unlinked first and written anew.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from tiny_checkpoint import checkpoint_config, make_tiny_checkpoint

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import (
    TMP_PREFIX,
    check_finite,
    default_checkpoint_dir,
    load_config,
    load_model,
    load_state_dict,
    remove_stale_temp_files,
    save_state_dict_atomic,
)
from litkv.checkpoints.convert import convert_hf_checkpoint
from litkv.cli.finetune_cmd import finetune
from litkv.core.atomic import mark_output_dir, save_dir_atomic, write_atomic
from litkv.finetune.checkpoint_dirs import STATE_FILE, TrainingState, load_training_state
from litkv.finetune.data import DataArgs, read_json_records
from litkv.gradient import chunked_loss_backward
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.model import GPT

TESTS_DIR = Path(__file__).resolve().parents[1]  # tests/, where tiny_checkpoint.py lives
HELDOUT = default_checkpoint_dir() / "heldout.txt"


def main_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    """Run `litkv ARGS` in-process: it must exit 1 after exactly one `error: ...` line, no traceback."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def default_copy(path: Path) -> Path:
    """The default model directory, as symlinks to the package's files (break one with `replace`)."""
    path.mkdir(parents=True, exist_ok=True)
    for src in default_checkpoint_dir().iterdir():
        (path / src.name).symlink_to(src)
    return path


def replace(path: Path, data: bytes | str) -> None:
    """Write `path` anew (never through a symlink into the package)."""
    path.unlink(missing_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def edit_config(**changes: object) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        config = yaml.safe_load((d / "model_config.yaml").read_text())
        config.update(changes)
        replace(d / "model_config.yaml", yaml.safe_dump(config))

    return edit


def edit_weights(fn: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        weights = load_file(str(default_checkpoint_dir() / "model.safetensors"))
        fn(weights)
        (d / "model.safetensors").unlink()
        save_file(weights, str(d / "model.safetensors"))

    return edit


def half_of(name: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        data = (default_checkpoint_dir() / name).read_bytes()
        replace(d / name, data[: len(data) // 2])

    return edit


def as_pth(data: bytes | None) -> Callable[[Path], None]:
    """Remove `model.safetensors`; `lit_model.pth` is `data`, or the real weights cut in half."""

    def edit(d: Path) -> None:
        (d / "model.safetensors").unlink()
        if data is None:
            torch.save(load_file(str(default_checkpoint_dir() / "model.safetensors")), d / "lit_model.pth")
            full = (d / "lit_model.pth").read_bytes()
            replace(d / "lit_model.pth", full[: len(full) // 2])
        else:
            replace(d / "lit_model.pth", data)

    return edit


def set_nan(w: dict[str, torch.Tensor]) -> None:
    w["transformer.h.1.attn.qkv.weight"][3, 5] = float("nan")


def set_inf(w: dict[str, torch.Tensor]) -> None:
    w["lm_head.weight"][0, 0] = float("inf")


def to_int(w: dict[str, torch.Tensor]) -> None:
    for key in w:
        w[key] = w[key].to(torch.int32)


# (case, mutation, file named in the message, what the message must say)
CORRUPT_CASES = [
    ("truncated-safetensors", half_of("model.safetensors"), "model.safetensors", "not a valid safetensors file"),
    ("empty-safetensors", lambda d: replace(d / "model.safetensors", b""), "model.safetensors", "(empty)"),
    ("int-weights", edit_weights(to_int), "model.safetensors", "dtype torch.int32, expected a floating dtype"),
    ("nan-weights", edit_weights(set_nan), "model.safetensors", "transformer.h.1.attn.qkv.weight contains NaN"),
    ("inf-weights", edit_weights(set_inf), "model.safetensors", "lm_head.weight contains inf"),
    ("garbage-pth", as_pth(b"not a pickle at all" * 10), "lit_model.pth", "not a valid PyTorch file"),
    ("empty-pth", as_pth(b""), "lit_model.pth", "not a valid PyTorch file (empty)"),
    ("truncated-pth", as_pth(None), "lit_model.pth", "not a valid PyTorch file (truncated or corrupt)"),
    ("garbage-tokenizer", lambda d: replace(d / "tokenizer.json", "{garbage"), "tokenizer.json", "not valid JSON"),
    ("empty-tokenizer", lambda d: replace(d / "tokenizer.json", ""), "tokenizer.json", "is empty"),
    ("list-tokenizer-config", lambda d: replace(d / "tokenizer_config.json", "[1, 2]"), "tokenizer_config.json",
     "must hold a JSON object, got list"),
    ("int-eos-token", lambda d: replace(d / "tokenizer_config.json", '{"eos_token": 5}'), "tokenizer_config.json",
     "eos_token must be a string, got int 5"),
    ("yaml-syntax", lambda d: replace(d / "model_config.yaml", "n_layer: [4\nn_head: : 2\n"), "model_config.yaml",
     "is not valid YAML"),
    ("yaml-list", lambda d: replace(d / "model_config.yaml", "- 1\n- 2\n"), "model_config.yaml",
     "must hold a mapping of config fields, got list"),
    ("yaml-empty", lambda d: replace(d / "model_config.yaml", ""), "model_config.yaml", "got NoneType"),
    ("negative-n_embd", edit_config(n_embd=-128), "model_config.yaml", "n_embd must be >= 1, got -128"),
    ("negative-n_layer", edit_config(n_layer=-1), "model_config.yaml", "n_layer must be >= 1, got -1"),
    ("zero-n_layer", edit_config(n_layer=0), "model_config.yaml", "n_layer must be >= 1, got 0"),
    ("negative-block_size", edit_config(block_size=-5), "model_config.yaml", "block_size must be >= 1, got -5"),
    ("string-n_head", edit_config(n_head="four"), "model_config.yaml", "n_head must be an int, got str 'four'"),
    ("n_query_groups", edit_config(n_query_groups=3), "model_config.yaml", "n_query_groups (3) must divide n_head (4)"),
    ("mlp_class_name", edit_config(mlp_class_name="Foo"), "model_config.yaml", "unknown mlp_class_name 'Foo'"),
    ("norm_class_name", edit_config(norm_class_name="Bar"), "model_config.yaml", "unknown norm_class_name 'Bar'"),
    ("unknown-field", edit_config(n_heads=4), "model_config.yaml", "not a valid litgpt model config"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "mutate", "file", "message"), CORRUPT_CASES, ids=[c[0] for c in CORRUPT_CASES])
def test_corrupt_checkpoint_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, case: str, mutate: Callable[[Path], None], file: str, message: str
) -> None:
    ckpt = default_copy(tmp_path / case)
    mutate(ckpt)
    line = main_error(capsys, "generate", ckpt, "--max_new_tokens", "1", "--num_threads", "1")
    assert str(ckpt / file) in line, line
    assert message in line, line
    if case == "zero-n_layer":
        assert "missing" not in line and "unexpected" not in line  # not reported as a weight-key mismatch


def test_nan_weights_raise_naming_the_first_bad_tensor(tmp_path: Path) -> None:
    ckpt = default_copy(tmp_path / "c")
    edit_weights(set_nan)(ckpt)
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.attn\.qkv\.weight contains NaN"):
        load_model(ckpt)
    tensors = {"a": torch.zeros(10), "b": torch.zeros(100), "c": torch.full((3,), float("-inf"))}
    tensors["b"][77] = float("inf")
    with pytest.raises(ValueError, match="src: b contains inf"):
        check_finite(tensors, "src", block=16)  # found in a later block of b, before c
    check_finite({"ok": torch.randn(50), "ids": torch.arange(5)}, "src", block=7)


def test_python_yaml_tag_is_never_constructed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "marker"
    ckpt = default_copy(tmp_path / "c")
    replace(ckpt / "model_config.yaml", f"!!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ValueError, match="not valid YAML .*python/object/apply:os.system"):
        load_config(ckpt)
    line = main_error(capsys, "generate", ckpt)
    assert str(ckpt / "model_config.yaml") in line
    assert not marker.exists()


class _Planted:
    """Unpickling this (without weights_only) would create the file `path`."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("container", ["torch.save", "raw-pickle"])
def test_crafted_pickle_in_lit_model_pth_is_not_executed(
    tmp_path: Path, capsys: pytest.CaptureFixture, container: str
) -> None:
    marker = tmp_path / "marker"
    ckpt = default_copy(tmp_path / "c")
    (ckpt / "model.safetensors").unlink()
    payload = {"lm_head.weight": torch.zeros(2), "evil": _Planted(marker)}
    if container == "torch.save":
        torch.save(payload, ckpt / "lit_model.pth")
    else:
        (ckpt / "lit_model.pth").write_bytes(pickle.dumps(payload))
    line = main_error(capsys, "generate", ckpt)
    assert str(ckpt / "lit_model.pth") in line
    assert "refusing to load" in line or "not a valid PyTorch file" in line
    assert not marker.exists()


# -- fine-tuning inputs ----------------------------------------------------------------------------


def fake_step_dir(path: Path, state: object, lora: bool = True) -> Path:
    """A step directory whose weights are fine and whose `training_state.pt` holds `state` (bytes: raw)."""
    path.mkdir(parents=True)
    (path / "model.safetensors").symlink_to(default_checkpoint_dir() / "model.safetensors")
    if lora:
        save_file({"x": torch.zeros(1)}, str(path / "lora.safetensors"))
    if isinstance(state, bytes):
        (path / STATE_FILE).write_bytes(state)
    else:
        torch.save(state, path / STATE_FILE)
    return path


def good_state() -> dict[str, object]:
    rng = {"torch": torch.get_rng_state()}
    return TrainingState("lora", 2, 1337, 10, {"state": {}, "param_groups": []}, rng).to_dict()


def resume_error(capsys: pytest.CaptureFixture, tmp_path: Path, resume: Path) -> str:
    args = ["finetune", "--data.path", HELDOUT, "--resume", resume, "--out_dir", tmp_path / "out"]
    return main_error(capsys, *args)


def test_hostile_training_state_is_not_executed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "marker"
    step = fake_step_dir(tmp_path / "step-000002", {**good_state(), "optimizer": _Planted(marker)})
    line = resume_error(capsys, tmp_path, step)
    assert str(step / STATE_FILE) in line and "refusing to load" in line
    assert not marker.exists()


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (b"", "not a valid PyTorch file (empty)"),
        ("truncated", "not a valid PyTorch file (truncated or corrupt)"),
        ([1, 2, 3], "is not a litkv fine-tuning state"),
        ({**good_state(), "step": "two"}, "step must be int, got str 'two'"),
        ({**good_state(), "optimizer": {"param_groups": 3}}, "optimizer must be an optimizer state_dict"),
        ({**good_state(), "rng": {"torch": torch.zeros(3)}}, "rng['torch'] must be a 1-D uint8 tensor"),
    ],
    ids=["empty", "truncated", "list", "step-type", "optimizer", "rng"],
)
def test_bad_training_state_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, state: object, message: str
) -> None:
    if state == "truncated":
        torch.save(good_state(), tmp_path / "full.pt")
        data = (tmp_path / "full.pt").read_bytes()
        state = data[: len(data) // 2]
    step = fake_step_dir(tmp_path / "step-000002", state)
    line = resume_error(capsys, tmp_path, step)
    assert str(step / STATE_FILE) in line and message in line, line


def test_resume_of_incomplete_directory_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    incomplete = fake_step_dir(tmp_path / f"{TMP_PREFIX}step-000004.1a2b3c4d", good_state())
    line = resume_error(capsys, tmp_path, incomplete)
    assert str(incomplete) in line and "incomplete checkpoint" in line
    no_lora = fake_step_dir(tmp_path / "step-000002", good_state(), lora=False)
    line = resume_error(capsys, tmp_path, no_lora)
    assert str(no_lora) in line and "has no lora.safetensors" in line
    (no_lora / STATE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="has no training_state.pt"):
        load_training_state(no_lora, "full")


def test_unknown_mode_lists_the_choices(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = main_error(capsys, "finetune", "--mode", "half", "--data.path", HELDOUT, "--out_dir", tmp_path)
    assert line == "error: mode must be one of 'lora', 'full', got 'half'"


def test_malformed_json_data_names_file_and_record(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "d.json"
    good = {"instruction": "say hi", "input": "", "output": "hi"}
    cases = [
        ('[{"instruction": "a", "output": "b"},\n', "is not valid JSON: Expecting value at line 2, column 1"),
        ("{}", "must hold a non-empty JSON list"),
        ("[]", "got an empty list"),
        (json.dumps([good, "text"]), "record 1 must be an object, got str"),
        (json.dumps([good, good, {"instruction": "a"}]), "record 2 has no 'output'"),
        (json.dumps([good, {"instruction": "a", "output": 5}]), "record 1: 'output' must be a string, got int 5"),
        (json.dumps([{**good, "input": ["x"]}]), "record 0: 'input' must be a string, got list"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(ValueError) as exc:
            read_json_records(path)
        assert str(path) in str(exc.value) and message in str(exc.value), str(exc.value)
    path.write_text(json.dumps([good, {"instruction": "a", "output": 5}]))
    line = main_error(capsys, "finetune", "--data.path", path, "--out_dir", tmp_path / "out")
    assert line == f"error: {path}: record 1: 'output' must be a string, got int 5"
    assert read_json_records(_write(tmp_path / "ok.json", json.dumps([good]))) == [good]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_chunked_loss_backward_needs_grad_enabled() -> None:
    model = GPT(checkpoint_config())
    idx = torch.randint(0, 300, (1, 9))
    cache = KVCacheConfig(policy="h2o", cache_length=4, chunk_size=2)
    for context in (torch.no_grad, torch.inference_mode):
        with context(), pytest.raises(RuntimeError, match="needs gradients enabled"):
            chunked_loss_backward(model, idx[:, :-1], idx[:, 1:], cache)
    assert all(p.grad is None for p in model.parameters())
    loss = chunked_loss_backward(model, idx[:, :-1], idx[:, 1:], cache)
    assert loss > 0 and model.lm_head.weight.grad is not None


def test_hf_config_json_garbage_is_named(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"hf/config.json is not valid JSON"):
        convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="config.json has no 'num_hidden_layers'"):
        convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")


# -- atomic writes -----------------------------------------------------------------------------------


def _with_umask(mask: int, fn: Callable[[], None]) -> None:
    old = os.umask(mask)
    try:
        fn()
    finally:
        os.umask(old)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_respect_the_umask(tmp_path: Path, umask: int) -> None:
    def write() -> None:
        save_state_dict_atomic(tmp_path / "w.safetensors", {"a": torch.zeros(3)})
        save_state_dict_atomic(tmp_path / "w.pth", {"a": torch.zeros(3)})
        write_atomic(tmp_path / "f.txt", lambda tmp: tmp.write_text("x"))
        save_dir_atomic(tmp_path / "d", lambda tmp: (tmp / "g.txt").write_text("y"))

    _with_umask(umask, write)
    for name in ("w.safetensors", "w.pth", "f.txt", "d/g.txt"):
        assert mode_of(tmp_path / name) == 0o666 & ~umask, name
    assert mode_of(tmp_path / "d") == 0o777 & ~umask


def test_temp_files_are_named_and_removed_on_any_exception(tmp_path: Path) -> None:
    seen: list[Path] = []

    def interrupted(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_bytes(b"x" * 1000)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "model.safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_dir_atomic(tmp_path / "step-000001", lambda tmp: interrupted(tmp / "model.safetensors"))
    assert seen[0].parent == tmp_path and seen[0].name.startswith(f"{TMP_PREFIX}model.safetensors.")
    assert seen[1].parent.parent == tmp_path and seen[1].parent.name.startswith(f"{TMP_PREFIX}step-000001.")
    assert list(tmp_path.iterdir()) == []


def test_save_dir_atomic_replaces_or_keeps_a_complete_directory(tmp_path: Path) -> None:
    target = tmp_path / "step-000001"
    save_dir_atomic(target, lambda tmp: (tmp / "a").write_text("1"))
    assert target.is_dir() and (target / "a").read_text() == "1"

    def failing(tmp: Path) -> None:
        (tmp / "a").write_text("2")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_dir_atomic(target, failing)
    assert sorted(p.name for p in target.iterdir()) == ["a"] and (target / "a").read_text() == "1"
    save_dir_atomic(target, lambda tmp: (tmp / "b").write_text("3"))
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]


def test_remove_stale_temp_files(tmp_path: Path) -> None:
    (tmp_path / "step-000002").mkdir()
    (tmp_path / "step-000002" / "model.safetensors").write_text("kept")
    stale = [
        tmp_path / f"{TMP_PREFIX}step-000004.0123abcd",
        tmp_path / f"{TMP_PREFIX}final.old-89abcdef",
        tmp_path / "step-000002" / f"{TMP_PREFIX}lora.safetensors.deadbeef",
        tmp_path / "step-000002" / ".model.safetensors.x1y2z3.tmp",  # left by earlier litkv versions
    ]
    stale[0].mkdir()
    (stale[0] / "model.safetensors").write_bytes(b"\0" * 100)
    stale[1].mkdir()
    for path in stale[2:]:
        path.write_bytes(b"\0" * 100)
    kept = [tmp_path / ".hidden", tmp_path / "notes.tmp", tmp_path / "step-000002" / ".my.tmp"]
    for path in kept:
        path.write_text("mine")
    with pytest.warns(UserWarning, match="removed 4 temporary file") as record:
        removed = remove_stale_temp_files(tmp_path)
    assert removed == sorted(stale)
    assert all(str(path) in str(record[0].message) for path in stale)
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in kept) and (tmp_path / "step-000002" / "model.safetensors").exists()
    assert remove_stale_temp_files(tmp_path) == [] and remove_stale_temp_files(tmp_path / "nope") == []


def test_finetune_and_resume_remove_stale_temp_files(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    ckpt = tmp_path / "base"
    make_tiny_checkpoint(ckpt)
    out = tmp_path / "out"
    (out / "step-000001").mkdir(parents=True)
    mark_output_dir(out, "finetune")  # an earlier, killed run's directory (its own: --overwrite starts anew)
    first = [out / f"{TMP_PREFIX}step-000003.00000000", out / "step-000001" / f"{TMP_PREFIX}x.11111111"]
    for path in first:
        path.write_bytes(b"\0" * 64)
    args = dict(
        data=DataArgs(path=HELDOUT, seq_length=16, val_fraction=0.0),
        kv_cache=KVCacheConfig(policy="h2o", cache_length=8, chunk_size=4),
        out_dir=out,
        precision="32-true",
    )
    from litkv.finetune.loop import EvalArgs, TrainArgs

    train = TrainArgs(max_steps=2, global_batch_size=1, warmup_steps=0, save_interval=1)
    finetune(ckpt, train=train, eval=EvalArgs(interval=100), overwrite=True, **args)
    assert not any(path.exists() for path in first)
    assert any("removed 2 temporary file" in str(w.message) for w in recwarn)
    assert not [p for p in out.rglob("*") if p.name.startswith(TMP_PREFIX)]
    assert {"step-000001", "step-000002", "final"} <= {p.name for p in out.iterdir()}
    later = out / f"{TMP_PREFIX}final.22222222"
    later.write_bytes(b"\0")
    recwarn.clear()
    finetune(ckpt, train=train, eval=EvalArgs(interval=100), resume=out / "step-000001", **args)
    assert not later.exists() and any(str(later) in str(w.message) for w in recwarn)
    assert torch.load(out / "final" / STATE_FILE, weights_only=True)["step"] == 2


_WRITER = """
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
import safetensors.torch as st
from tiny_checkpoint import checkpoint_config
from litkv.checkpoints.checkpoint import save_state_dict_atomic
from litkv.finetune.checkpoint_dirs import TrainingState, save_checkpoint
from litkv.modeling.model import GPT

def slow_save_file(tensors, filename, metadata=None):  # the real bytes, written slowly
    data = st.save(tensors, metadata)
    with open(filename, "wb") as f:
        for i in range(0, len(data), 1 << 14):
            f.write(data[i : i + (1 << 14)])
            f.flush()
            time.sleep(0.004)

def write_forever(out):
    for step in range(1, 1000):
        save_state_dict_atomic(out / "weights.safetensors", model.state_dict())
        rng = {{"torch": torch.get_rng_state()}}
        state = TrainingState("full", step, 0, 10, {{"state": {{}}, "param_groups": []}}, rng)
        save_checkpoint(out / f"step-{{step:06d}}", model, base, {{}}, state)

st.save_file = slow_save_file
root, base = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = GPT(checkpoint_config())
for i, delay in enumerate(float(d) for d in sys.argv[3].split(",")):
    out = root / f"out{{i}}"
    out.mkdir()
    pid = os.fork()  # imports paid once; each child writes until SIGKILLed after `delay` seconds
    if pid == 0:
        try:
            write_forever(out)
        finally:
            os._exit(0)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    print(out, os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, flush=True)
"""


@pytest.mark.slow
def test_kill_9_during_checkpoint_writes_leaves_nothing_half_written(tmp_path: Path) -> None:
    """SIGKILL checkpoint writers at several points: every checkpoint file present loads completely;
    what was being written is only under temporary names, which the cleanup removes."""
    from litgpt.utils import save_config

    base = tmp_path / "base"
    base.mkdir()
    save_config(checkpoint_config(), base)
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(_WRITER.format(tests=str(TESTS_DIR))))
    delays = "0.03,0.06,0.09,0.12,0.16,0.2,0.23,0.3,0.37,0.45"  # ten kills: enough land inside a write on any load
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), str(tmp_path), str(base), delays]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")[:-1]
    kills = len(delays.split(","))
    assert lines == [f"{tmp_path / f'out{i}'} True" for i in range(kills)], proc.stdout
    torch.manual_seed(0)
    reference = GPT(checkpoint_config()).state_dict()
    interrupted = 0
    for i in range(kills):
        out = tmp_path / f"out{i}"
        entries = sorted(out.iterdir())
        temps = [p for p in entries if p.name.startswith(TMP_PREFIX)]
        interrupted += bool(temps)
        for path in sorted(set(entries) - set(temps)):
            if path.name == "weights.safetensors":
                weights = load_state_dict(path)
            else:
                assert path.name.startswith("step-") and path.is_dir(), path
                weights = load_model(path).state_dict()
                assert load_training_state(path, "full").step == int(path.name[5:])
            assert all(torch.equal(weights[k], reference[k]) for k in reference)
        with pytest.warns(UserWarning, match="interrupted checkpoint writes") if temps else nullcontext():
            assert remove_stale_temp_files(out) == temps
        assert not [p for p in out.rglob("*") if p.name.startswith(TMP_PREFIX)]
    assert interrupted >= 3, interrupted  # the test saw kills inside a write (in an idle run most land there)


def test_model_dir_copies_are_independent(tmp_path: Path) -> None:
    """The symlinked copies never write through into the package (guards the helpers above)."""
    ckpt = default_copy(tmp_path / "c")
    before = (default_checkpoint_dir() / "tokenizer.json").read_bytes()
    replace(ckpt / "tokenizer.json", "")
    assert (default_checkpoint_dir() / "tokenizer.json").read_bytes() == before
    shutil.rmtree(ckpt)
    assert (default_checkpoint_dir() / "tokenizer.json").is_file()
