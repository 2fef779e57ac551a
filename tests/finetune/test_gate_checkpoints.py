"""Gate training's checkpoints: `--resume` continues bitwise, a loss that turns NaN stops with the last
checkpoint intact and named, gates trained for other weights are refused by their fingerprint, and data
shorter than one sequence is one clear error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_finetune import write_text
from tiny_checkpoint import make_tiny_checkpoint

from litkv.checkpoint import load_model
from litkv.config import KVCacheConfig
from litkv.finetune.data import DataArgs
from litkv.finetune.gates import GateTrainArgs, batch_indices, train_gates
from litkv.finetune.learn_eviction import LOG_FILE, learn_eviction
from litkv.fingerprint import model_fingerprint
from litkv.learned import GATES_FILE, EvictionGates

KV = KVCacheConfig(policy="learned", cache_length=24, chunk_size=8)


def _learn(steps: int, interval: int = 0) -> GateTrainArgs:
    return GateTrainArgs(steps=steps, batch_size=2, window=4, sinks=1, lr=0.1, checkpoint_interval=interval)


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


def test_nan_mid_run_names_the_intact_checkpoint(base: Path) -> None:
    model = load_model(base)
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
        train_gates(model, examples, _learn(first_bad + 3, interval=1), kv_cache=KV, checkpoint=checkpoint)
    assert [s.step for s in saved] == list(range(1, first_bad + 1))
    last = saved[-1].gates
    assert torch.isfinite(last.weight).all() and torch.isfinite(last.bias).all() and len(saved[-1].logs) == first_bad


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


def test_data_shorter_than_one_sequence(base: Path, tmp_path: Path) -> None:
    data = DataArgs(path=write_text(tmp_path / "short.txt", 5), seq_length=40, val_fraction=0.0)
    with pytest.raises(ValueError, match=r"short.txt has \d+ tokens, fewer than data.seq_length \+ 1 = 41: lower"):
        learn_eviction(base, data, _learn(1), tmp_path / "out", kv_cache=KV)
    assert not (tmp_path / "out").exists()


def test_shipped_gates_pass_the_fingerprint_check() -> None:
    from litkv.checkpoint import default_checkpoint_dir

    model = load_model(default_checkpoint_dir())
    gates = model.eviction_gates
    model.eviction_gates = None
    assert gates is not None and gates.weights == model_fingerprint(model)["weights"]
