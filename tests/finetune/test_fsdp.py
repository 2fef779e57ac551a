"""`litkv finetune --strategy fsdp --devices 2`: weights, gradients and AdamW state sharded over 2 CPU
processes (gloo) with Fabric's `ModelParallelStrategy` (FSDP2), gradients through an evicting cache.

One script launches the 2 processes: 3 steps (a checkpoint at step 2), then a resume from step 2. Checked
against the same run on one process without sharding (in this process):

- the loss curve (the logged `train_loss` of every step) is the single-process curve within 1e-5;
- `final/model.safetensors` (gathered from the shards) is the single-process final within 1e-5 + 1e-4 of
  each tensor's largest value, and `litkv generate` loads `final/`;
- the resumed run ends with the uninterrupted run's weights (bitwise: same shards, same steps);
- each process's shard of the weights and the AdamW state (`sharded/rank-R.safetensors`) holds about half
  of what one process holds unsharded (at most 0.55).

Bad input (one line each, no processes): fsdp with one device, with LoRA, resuming with another count.
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_finetune import SEQ, make_checkpoint, write_text

from litkv.cli.finetune_cmd import finetune
from litkv.cli.generate_cmd import generate
from litkv.finetune.data import DataArgs
from litkv.finetune.loop import TrainArgs
from litkv.finetune.sharding import SHARDING_FILE, check_sharded_resume, check_strategy
from litkv.kvcache.config import KVCacheConfig
from tests.early import output_of, run_script

STEPS = 3
KV = dict(policy="h2o", cache_length=8, chunk_size=4)
TRAIN = dict(max_steps=STEPS, micro_batch_size=1, global_batch_size=4, lr=0.01, warmup_steps=0, save_interval=2)

SCRIPT = """
import sys
from pathlib import Path

from litkv.kvcache.config import KVCacheConfig
from litkv.cli.finetune_cmd import finetune
from litkv.finetune.data import DataArgs
from litkv.finetune.loop import TrainArgs

ckpt, text, out = (Path(a) for a in sys.argv[1:4])
common = dict(mode="full", data=DataArgs(path=text, seq_length=SEQ, val_fraction=0.0), kv_cache=KVCacheConfig(**KV),
              train=TrainArgs(**TRAIN), precision="32-true", devices=2, strategy="fsdp")
finetune(ckpt, out_dir=out / "fsdp", **common)
finetune(ckpt, out_dir=out / "resumed", resume=out / "fsdp" / "step-000002", **common)
"""


def _losses(out_dir: Path) -> list[float]:
    with open(out_dir / "logs" / "finetune" / "version_0" / "metrics.csv") as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.dim() > 0)


def _start_two_processes(work: Path) -> subprocess.Popen:
    """The two-process run of `SCRIPT` in `work` (checkpoint `base`, text `t.txt`, results under `out`, its
    output in `stdout.txt` and `stderr.txt`)."""
    ckpt = make_checkpoint(work / "base")
    text = write_text(work / "t.txt", 120)
    script = work / "fsdp_script.py"
    script.write_text(f"SEQ, KV, TRAIN = {SEQ}, {KV!r}, {TRAIN!r}\n" + SCRIPT)
    return run_script(work, script, [ckpt, text, work / "out"])


# the two processes (half a minute of two cores) start with the test session, beside the other tests (tests/early.py)
EARLY_START = {"test_two_sharded_processes_train_as_one": _start_two_processes}


@pytest.mark.slow
def test_two_sharded_processes_train_as_one(
    early_process: tuple[subprocess.Popen, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proc, work = early_process
    stdout = output_of(proc, work, timeout=400)
    assert "2 process(es)" in stdout
    ckpt, text = work / "base", work / "t.txt"

    single = tmp_path / "single"
    finetune(
        ckpt, mode="full", data=DataArgs(path=text, seq_length=SEQ, val_fraction=0.0), kv_cache=KVCacheConfig(**KV),
        train=TrainArgs(**TRAIN), out_dir=single, precision="32-true", devices=1,
    )  # fmt: skip
    fsdp = work / "out" / "fsdp"
    ref_losses, losses = _losses(single), _losses(fsdp)
    assert len(ref_losses) == len(losses) == STEPS
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert ref_losses[-1] < ref_losses[0]  # it trains

    ref = load_file(str(single / "final" / "model.safetensors"))
    got = load_file(str(fsdp / "final" / "model.safetensors"))
    base = load_file(str(ckpt / "model.safetensors"))
    assert set(got) == set(ref)
    for key, value in ref.items():
        assert (got[key] - value).abs().max() <= 1e-5 + 1e-4 * value.abs().max(), key
        assert not torch.equal(got[key], base[key]), key
    resumed = load_file(str(work / "out" / "resumed" / "final" / "model.safetensors"))
    assert all(torch.equal(resumed[k], got[k]) for k in got)
    assert _losses(work / "out" / "resumed") == _losses(fsdp)[2:]

    assert json.loads((fsdp / "final" / SHARDING_FILE).read_text())["devices"] == 2
    unsharded = 3 * _nbytes(ref)  # weights, AdamW's exp_avg and exp_avg_sq
    for rank in (0, 1):
        shard = load_file(str(fsdp / "final" / "sharded" / f"rank-{rank}.safetensors"))
        assert any(k.endswith(".exp_avg_sq") for k in shard)
        assert 0.45 * unsharded <= _nbytes(shard) <= 0.55 * unsharded, rank

    capsys.readouterr()
    generate(checkpoint_dir=fsdp / "final", prompt="the", max_new_tokens=3, device="cpu")
    assert capsys.readouterr().out.strip()


def test_strategy_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs --devices >= 2 \(times --num_nodes\), got 1 process \(drop"):
        check_strategy("fsdp", 1, "full", False)
    with pytest.raises(ValueError, match="LoRA's adapters are small, use --strategy ddp"):
        check_strategy("fsdp", 2, "lora", False)
    with pytest.raises(ValueError, match="drop --strategy fsdp"):
        check_strategy("fsdp", 2, "full", True)
    with pytest.raises(ValueError, match="strategy must be one of 'auto', 'ddp', 'fsdp', got 'zero3'"):
        check_strategy("zero3", 2, "full", False)
    check_strategy("ddp", 1, "lora", False)
    text = write_text(tmp_path / "t.txt", 100)
    ckpt = make_checkpoint(tmp_path / "base")
    with pytest.raises(ValueError, match="needs --devices >= 2"):
        finetune(ckpt, data=DataArgs(path=text, seq_length=SEQ), mode="full", strategy="fsdp")

    sharded = tmp_path / "step-000002"
    (sharded / "sharded").mkdir(parents=True)
    (sharded / SHARDING_FILE).write_text(json.dumps({"strategy": "fsdp", "devices": 2}))
    assert check_sharded_resume(sharded, "fsdp", 2)
    with pytest.raises(
        ValueError,
        match=r"written by --strategy fsdp over 2 processes, this run is --strategy fsdp over 4; resume with",
    ):
        check_sharded_resume(sharded, "fsdp", 4)
    with pytest.raises(ValueError, match="this run is --strategy ddp over 2"):
        check_sharded_resume(sharded, "ddp", 2)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert not check_sharded_resume(plain, "ddp", 2)
    with pytest.raises(ValueError, match="not written by a sharded run"):
        check_sharded_resume(plain, "fsdp", 2)
