"""`litkv finetune --strategy fsdp --devices 2` saves after validation passes and resumes only from its own
shards (issue 47 item 3). Two CPU processes (gloo), launched by Fabric from one script:

- a 3-step run validating after every step writes `step-000002/` (a save right after a validation pass: it
  ended each rank with a KeyError in `save_shards` before) and `final/`;
- a resume from `step-000002` with no step left writes shards equal, tensor for tensor, to the ones it
  loaded (weights and AdamW state: `exp_avg`, `exp_avg_sq`, `step`); a resume that trains step 3 ends with
  the uninterrupted run's weights and shards, bitwise;
- resumes from a copy of `step-000002` whose shard files were swapped, lost (rank 1's), mixed with another
  step's or another save's (of the same step), or whose `model.safetensors` is another step's, are refused
  on both processes with the same one line naming the file.
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file
from test_finetune import SEQ, make_checkpoint, write_text

from tests.early import output_of, run_script

SCRIPT = """
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from litkv.cli.finetune_cmd import finetune
from litkv.finetune.data import DataArgs
from litkv.finetune.loop import EvalArgs, TrainArgs
from litkv.kvcache.config import KVCacheConfig

ckpt, text, out = (Path(a) for a in sys.argv[1:4])
common = dict(mode="full", data=DataArgs(path=text, seq_length=SEQ, val_fraction=0.25), kv_cache=KVCacheConfig(**KV),
              eval=EvalArgs(interval=1, max_iters=1), precision="32-true", devices=2, strategy="fsdp")
def train(max_steps):
    return TrainArgs(max_steps=max_steps, micro_batch_size=1, global_batch_size=2, lr=0.01, warmup_steps=0,
                     save_interval=2)
finetune(ckpt, out_dir=out / "run", train=train(3), **common)
step2, final = out / "run" / "step-000002", out / "run" / "final"
finetune(ckpt, out_dir=out / "reloaded", resume=step2, train=train(2), **common)
finetune(ckpt, out_dir=out / "resumed", resume=step2, train=train(3), **common)

rank = torch.distributed.get_rank()
def shard(d, r):
    return d / "sharded" / f"rank-{r}.safetensors"
if rank == 0:
    for case in ("swapped", "missing", "other_step", "other_save", "other_weights"):
        shutil.copytree(final if case == "other_save" else step2, out / case)
    os.rename(shard(out / "swapped", 0), out / "tmp")
    os.rename(shard(out / "swapped", 1), shard(out / "swapped", 0))
    os.rename(out / "tmp", shard(out / "swapped", 1))
    os.remove(shard(out / "missing", 1))
    shutil.copyfile(shard(final, 1), shard(out / "other_step", 1))
    shutil.copyfile(shard(out / "resumed" / "final", 1), shard(out / "other_save", 1))
    shutil.copyfile(final / "model.safetensors", out / "other_weights" / "model.safetensors")
torch.distributed.barrier()
refusals = {}
for case in ("swapped", "missing", "other_step", "other_save", "other_weights"):
    steps = 3 if case == "other_save" else 2
    try:
        finetune(ckpt, out_dir=out / f"out-{case}", resume=out / case, train=train(steps + 1), **common)
    except ValueError as err:
        refusals[case] = str(err)
(out / f"refusals-{rank}.json").write_text(json.dumps(refusals))
"""


def _val_steps(out_dir: Path) -> list[int]:
    with open(out_dir / "logs" / "finetune" / "version_0" / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("val_loss")]


def _shards(checkpoint: Path) -> list[dict]:
    return [load_file(str(checkpoint / "sharded" / f"rank-{r}.safetensors")) for r in (0, 1)]


def _assert_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].equal(value), key


def _start_two_processes(work: Path) -> subprocess.Popen:
    """The two-process run of `SCRIPT` in `work` (results under `out`, its output in `stdout.txt`, `stderr.txt`)."""
    ckpt = make_checkpoint(work / "base")
    text = write_text(work / "t.txt", 120)
    kv = dict(policy="h2o", cache_length=8, chunk_size=4)
    script = work / "fsdp_script.py"
    script.write_text(f"SEQ, KV = {SEQ}, {kv!r}\n" + SCRIPT)
    return run_script(work, script, [ckpt, text, work / "out"])


# the run (about 10 s of CPU, 2 processes, 8 Fabric launches; 45-65 s on the loaded 2 shared cores) starts with the
# test session, beside the other tests (tests/early.py)
EARLY_START = {"test_fsdp_saves_after_validation_and_resumes_only_its_own_shards": _start_two_processes}


@pytest.mark.slow
def test_fsdp_saves_after_validation_and_resumes_only_its_own_shards(
    early_process: tuple[subprocess.Popen, Path],
) -> None:
    proc, work = early_process
    output_of(proc, work, timeout=400)
    out = work / "out"

    run = out / "run"
    assert _val_steps(run) == [1, 2, 3]  # each save below came right after a validation pass
    for name, step in (("step-000002", 2), ("final", 3)):
        sharding = json.loads((run / name / "sharding.json").read_text())
        assert sharding["step"] == step and sharding["devices"] == 2
        for r in (0, 1):
            with safe_open(str(run / name / "sharded" / f"rank-{r}.safetensors"), framework="pt") as f:
                assert f.metadata() == {
                    "rank": str(r), "world_size": "2", "step": str(step), "save_id": sharding["save_id"]
                }  # fmt: skip

    # What a resume loads is what was saved: written back untouched when no step is left.
    for got, want in zip(_shards(out / "reloaded" / "final"), _shards(run / "step-000002"), strict=True):
        assert any(k.endswith(".exp_avg_sq") for k in want) and any(k.endswith(".step") for k in want)
        _assert_equal(got, want)
    # ... and step 3 from there is the uninterrupted run's step 3.
    for got, want in zip(_shards(out / "resumed" / "final"), _shards(run / "final"), strict=True):
        _assert_equal(got, want)
    _assert_equal(
        load_file(str(out / "resumed" / "final" / "model.safetensors")),
        load_file(str(run / "final" / "model.safetensors")),
    )

    refusals = [json.loads((out / f"refusals-{r}.json").read_text()) for r in (0, 1)]
    assert refusals[0] == refusals[1]  # both processes stop with the same line
    got = refusals[0]
    assert set(got) == {"swapped", "missing", "other_step", "other_save", "other_weights"}
    assert all("\n" not in message for message in got.values())

    def file(case: str, rank: int) -> str:
        return repr(str(out / case / "sharded" / f"rank-{rank}.safetensors"))

    assert got["swapped"].startswith(f"cannot resume from {file('swapped', 0)}: it holds rank 1's shard")
    assert "this is rank 0 of 2 resuming step 2" in got["swapped"]
    assert got["missing"] == f"cannot resume from {file('missing', 1)}: it does not exist " + (
        "(a sharded checkpoint needs the file of each of its processes)"
    )
    assert got["other_step"].startswith(f"cannot resume from {file('other_step', 1)}: it holds rank 1's shard")
    assert "at step 3" in got["other_step"] and "resuming step 2" in got["other_step"]
    assert got["other_save"].startswith(f"cannot resume from {file('other_save', 1)}: it holds rank 1's shard")
    assert "of 2 processes at step 3 (save" in got["other_save"] and "resuming step 3" in got["other_save"]
    assert got["other_weights"].startswith(f"cannot resume from {file('other_weights', 0)}: its ")
    assert got["other_weights"].endswith("is not rank 0's slice of model.safetensors beside it")
