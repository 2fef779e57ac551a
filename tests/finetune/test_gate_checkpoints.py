"""Gate training's checkpoints: `--resume` continues bitwise (gates alone, and with LoRA adapters), a
loss that turns NaN stops with the last checkpoint intact and named, a `kill -9` mid-run leaves the last
checkpoint whole and resumable, gates trained for other weights are refused by their fingerprint (the
merged weights' fingerprint with LoRA), and data shorter than one sequence is one clear error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_finetune import write_text
from tiny_checkpoint import make_tiny_checkpoint

from litkv.checkpoints.checkpoint import SAFETENSORS_FILE, load_model, load_state_dict
from litkv.core.atomic import TMP_PREFIX
from litkv.finetune.checkpoint_dirs import LORA_FILE
from litkv.finetune.data import DataArgs
from litkv.finetune.gate_training import GateTrainArgs, batch_indices, train_gates
from litkv.finetune.learn_eviction import LOG_FILE, STATE_FILE, learn_eviction, load_gate_state
from litkv.finetune.lora import LoRAArgs, apply_lora
from litkv.gates import GATES_FILE, EvictionGates
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.fingerprint import model_fingerprint

KV = KVCacheConfig(policy="learned", cache_length=24, chunk_size=8)


LORA = LoRAArgs(r=2, alpha=4.0, targets=["attn.qkv", "attn.proj", "mlp"])


def _learn(steps: int, interval: int = 0, lora: bool = False) -> GateTrainArgs:
    return GateTrainArgs(
        steps=steps, batch_size=2, window=4, sinks=1, lr=0.1, checkpoint_interval=interval, lora=lora, lora_lr=0.01
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gates") / "base"
    make_tiny_checkpoint(path)
    return path


def test_resume_continues_bitwise(base: Path, tmp_path: Path) -> None:
    data = DataArgs(path=write_text(tmp_path / "train.txt", 3000), seq_length=40, val_fraction=0.0)
    whole = learn_eviction(base, data, _learn(5, interval=2), tmp_path / "a", kv_cache=KV)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["final", "step-000002", "step-000004"]
    resumed = learn_eviction(base, data, _learn(5), tmp_path / "b", kv_cache=KV, resume=tmp_path / "a" / "step-000002")
    one, two = EvictionGates.load(whole / GATES_FILE), EvictionGates.load(resumed / GATES_FILE)
    assert torch.equal(one.weight, two.weight) and torch.equal(one.bias, two.bias)
    assert (whole / LOG_FILE).read_text() == (resumed / LOG_FILE).read_text()
    fresh = learn_eviction(base, data, _learn(3), tmp_path / "c", kv_cache=KV)  # 3 steps differ from 5
    assert not torch.equal(EvictionGates.load(fresh / GATES_FILE).weight, one.weight)
    with pytest.raises(ValueError, match=r"settings \(saved, now\) \{'seed': \(1234, 5\)\}"):
        other_seed = GateTrainArgs(steps=5, batch_size=2, window=4, sinks=1, lr=0.1, seed=5)
        learn_eviction(base, data, other_seed, tmp_path / "d", kv_cache=KV, resume=tmp_path / "a" / "step-000002")


@pytest.mark.slow
def test_lora_resume_continues_bitwise(base: Path, tmp_path: Path) -> None:
    """Gates and adapters: 5 steps in one go == 2, then 3 resumed (every output file byte for byte); the
    output loads (the gates carry the merged weights' fingerprint) and holds base + (alpha / r) B A."""
    data = DataArgs(path=write_text(tmp_path / "train.txt", 3000), seq_length=40, val_fraction=0.0)
    whole = learn_eviction(base, data, _learn(5, 2, True), tmp_path / "a", kv_cache=KV, lora=LORA)
    step2 = tmp_path / "a" / "step-000002"
    resumed = learn_eviction(base, data, _learn(5, lora=True), tmp_path / "b", kv_cache=KV, resume=step2, lora=LORA)
    _assert_same_output(whole, resumed)
    assert (step2 / LORA_FILE).read_bytes() != (whole / LORA_FILE).read_bytes()
    trained, plain = load_model(whole), load_model(base)
    adapters = load_state_dict(whole / LORA_FILE)
    assert trained.eviction_gates.weights == model_fingerprint(load_model(step2.parent / "final"))["weights"]
    qkv = "transformer.h.1.attn.qkv"
    b, a = adapters[f"{qkv}.lora_B"], adapters[f"{qkv}.lora_A"]
    assert b.abs().max() > 0  # the adapters trained
    want = plain.transformer.h[1].attn.qkv.weight + (LORA.alpha / LORA.r) * b @ a
    assert torch.allclose(trained.transformer.h[1].attn.qkv.weight, want, atol=1e-6)
    trained.eviction_gates = None
    assert model_fingerprint(trained)["weights"] != model_fingerprint(plain)["weights"]
    with pytest.raises(ValueError, match=r"settings \(saved, now\) \{'lora adapters': \(\{'r': 2, .*\{'r': 4, "):
        other = LoRAArgs(r=4, alpha=4.0, targets=LORA.targets)
        learn_eviction(base, data, _learn(5, lora=True), tmp_path / "c", kv_cache=KV, resume=step2, lora=other)
    with pytest.raises(ValueError, match=r"\{'lora': \(True, False\)"):
        learn_eviction(base, data, _learn(5), tmp_path / "d", kv_cache=KV, resume=step2)


@pytest.mark.parametrize("lora", [False, True])
def test_nan_mid_run_names_the_intact_checkpoint(base: Path, lora: bool) -> None:
    model = load_model(base)
    if lora:
        apply_lora(model, LORA)
    bad_token = 7
    with torch.no_grad():
        model.transformer.wte.weight[bad_token] = float("nan")
    bad = next(i for i in range(4) if i not in batch_indices(4, 2, 1234, 0))  # not in the first step's batch
    g = torch.Generator().manual_seed(0)
    examples = []
    for i in range(4):
        ids = torch.randint(10, 100, (33,), generator=g)
        if i == bad:
            ids[20] = bad_token
        examples.append((ids[:-1], ids[1:]))
    first_bad = next(s for s in range(100) if bad in batch_indices(4, 2, 1234, s))
    assert first_bad >= 1
    saved = []

    def checkpoint(state) -> str:
        saved.append(state)
        return f"out/step-{state.step:06d}"

    with pytest.raises(ValueError, match=rf"stopped at step {first_bad}: the loss is nan .* the last checkpoint, "
                       rf"out/step-{first_bad:06d}, is intact: continue with --resume"):  # fmt: skip
        train_gates(model, examples, _learn(first_bad + 3, 1, lora), kv_cache=KV, checkpoint=checkpoint)
    assert [s.step for s in saved] == list(range(1, first_bad + 1))
    last = saved[-1].gates
    assert torch.isfinite(last.weight).all() and torch.isfinite(last.bias).all() and len(saved[-1].logs) == first_bad
    assert (saved[-1].adapters is not None) == lora
    if lora:
        assert all(torch.isfinite(t).all() for t in saved[-1].adapters.values())
        assert any(t.abs().max() > 0 for k, t in saved[-1].adapters.items() if k.endswith("lora_B"))


# the schedule depends on the number of steps: the killed run, the resumed one and the fresh one share it
_KILL_STEPS = 12


def _finetune_cli(base: Path, text: Path, steps: int, out_dir: Path, *extra: str) -> subprocess.Popen:
    """`litkv finetune --learn_eviction true --learn.lora true` on `base` and `text`, a checkpoint every step."""
    argv = [sys.executable, "-m", "litkv", "finetune", str(base), "--learn_eviction", "true",
            "--kv_cache.policy", "learned", "--kv_cache.cache_length", "24", "--kv_cache.chunk_size", "8",
            "--data.path", str(text), "--data.seq_length", "40", "--data.val_fraction", "0",
            "--learn.steps", str(steps), "--learn.batch_size", "2", "--learn.window", "4", "--learn.sinks", "1",
            "--learn.lr", "0.1", "--learn.lora", "true", "--learn.lora_lr", "0.01", "--lora.r", "2",
            "--lora.alpha", "4", "--lora.targets", "[attn.qkv, attn.proj, mlp]",
            "--learn.checkpoint_interval", "1", "--out_dir", str(out_dir), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _start_fresh_run(work: Path) -> subprocess.Popen:
    """The never-killed run of the kill test: `work/base` (the tiny checkpoint), `work/train.txt`, into
    `work/fresh`; the killed and resumed runs use the same base and text."""
    make_tiny_checkpoint(work / "base")
    text = write_text(work / "train.txt", 3000)
    return _finetune_cli(work / "base", text, _KILL_STEPS, work / "fresh")


# the never-killed run starts with the test session, beside the other tests (tests/early.py)
EARLY_START = {"test_kill_mid_run_with_lora_leaves_a_resumable_checkpoint": _start_fresh_run}


@pytest.mark.slow
def test_kill_mid_run_with_lora_leaves_a_resumable_checkpoint(
    early_process: tuple[subprocess.Popen, Path], tmp_path: Path
) -> None:
    """`kill -9` of `litkv finetune --learn_eviction true --learn.lora true` mid-run: every `step-XXXXXX/`
    left is whole; a temporary directory of a dead writer is removed by the next run; `--resume` from the
    last checkpoint gives bitwise what a run that was never killed gives (all runs in one-thread processes;
    the one never killed is `_start_fresh_run`)."""
    fresh, work = early_process
    base, text = work / "base", work / "train.txt"
    out = tmp_path / "out"
    n = _KILL_STEPS
    proc = _finetune_cli(base, text, n, out)
    deadline = time.monotonic() + 120
    while not (out / "step-000002").is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    steps = sorted(p for p in out.iterdir() if p.name.startswith("step-"))
    assert len(steps) >= 2 and not (out / "final").exists()
    for step in steps:
        load_model(step)  # whole: merged weights and gates agree
        count = json.loads((step / STATE_FILE).read_text())["num_train_examples"]
        assert load_gate_state(step, _learn(1, lora=True), count, LORA).adapters is not None
    last = steps[-1]
    dead = out / f"{TMP_PREFIX}step-999999.{proc.pid}-0123abcd"  # as a write cut by the kill leaves it
    shutil.copytree(last, dead)
    left = [p for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]  # and one the kill cut, where it hit a write
    runs = [_finetune_cli(base, text, n, out, "--resume", str(last)), fresh]
    for run in runs:
        assert run.wait(timeout=300) == 0, run.stderr.read().decode()[-2000:]
    assert not any(p.exists() for p in left)
    message = f"removed {len(left)} temporary file(s) of interrupted checkpoint writes"
    assert message in runs[0].stderr.read().decode()
    _assert_same_output(work / "fresh" / "final", out / "final")


def _assert_same_output(one: Path, two: Path) -> None:
    """The weights, adapters and log byte for byte; the gates' tensors and metadata (the order of the metadata
    in a safetensors header is not fixed)."""
    for name in (LORA_FILE, SAFETENSORS_FILE, LOG_FILE):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    a, b = EvictionGates.load(one / GATES_FILE), EvictionGates.load(two / GATES_FILE)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias) and a.weights == b.weights


def test_gates_for_other_weights_are_refused(base: Path, tmp_path: Path) -> None:
    data = DataArgs(path=write_text(tmp_path / "train.txt", 2000), seq_length=40, val_fraction=0.0)
    final = learn_eviction(base, data, _learn(1), tmp_path / "out", kv_cache=KV)
    model = load_model(final)
    assert model.eviction_gates.weights == model_fingerprint(load_model(base))["weights"]
    other = tmp_path / "other"
    make_tiny_checkpoint(other, seed=1)
    shutil.copyfile(final / GATES_FILE, other / GATES_FILE)
    with pytest.raises(ValueError) as err:
        load_model(other)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{str(other / GATES_FILE)!r}: these eviction gates were")
    assert load_model(final, dtype=torch.float64).eviction_gates is not None  # checked as stored, before the cast


@pytest.mark.parametrize("lora", [False, True])
def test_data_shorter_than_one_sequence(base: Path, tmp_path: Path, lora: bool) -> None:
    data = DataArgs(path=write_text(tmp_path / "short.txt", 5), seq_length=40, val_fraction=0.0)
    with pytest.raises(ValueError, match=r"short.txt has \d+ tokens, fewer than data.seq_length \+ 1 = 41: lower"):
        learn_eviction(base, data, _learn(1, lora=lora), tmp_path / "out", kv_cache=KV, lora=LORA)
    assert not (tmp_path / "out").exists()


def test_shipped_gates_pass_the_fingerprint_check() -> None:
    from litkv.checkpoints.checkpoint import default_checkpoint_dir

    model = load_model(default_checkpoint_dir())
    gates = model.eviction_gates
    model.eviction_gates = None
    assert gates is not None and gates.weights == model_fingerprint(model)["weights"]


def test_lora_settings_are_checked(base: Path) -> None:
    with pytest.raises(ValueError, match=r"lora=True .* needs method 'distill', got 'regress'"):
        GateTrainArgs(method="regress", lora=True)
    with pytest.raises(ValueError, match=r"lora_lr must be > 0, got 0"):
        GateTrainArgs(lora=True, lora_lr=0)
    examples = [(torch.arange(10, 42), torch.arange(11, 43))]
    with pytest.raises(ValueError, match=r"--learn.lora true needs a model with LoRA adapters, the model has none"):
        train_gates(load_model(base), examples, _learn(1, lora=True), kv_cache=KV)
    model = load_model(base)
    apply_lora(model, LORA)
    with pytest.raises(ValueError, match=r"--learn.lora false needs a model without LoRA adapters, the model has"):
        train_gates(model, examples, _learn(1), kv_cache=KV)
