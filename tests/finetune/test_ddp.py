"""`litkv finetune --devices 2`: data parallel over 2 CPU processes (gloo) through Fabric's DDP strategy.

A script written into a temporary directory calls `finetune(..., devices=2)` (full, then LoRA), which launches a
second process; each process dumps its parameters after one step. Both processes must hold identical
parameters, equal to one single-process step (plain autograd through `forward_chunked` + AdamW) on the
combined batch of both processes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_finetune import SEQ, make_checkpoint, windows, write_text

import litkv
from litkv.checkpoints.checkpoint import load_model
from litkv.finetune.lora import LoRAArgs, apply_lora, mark_only_lora_as_trainable
from litkv.kvcache.config import KVCacheConfig
from tests.early import output_of, run_script

LR = 0.01
KV = dict(policy="h2o", cache_length=8, chunk_size=4)
TARGETS = ["attn.qkv", "mlp"]

SCRIPT = """
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import litkv.cli.finetune_cmd as cli
from litkv.kvcache.config import KVCacheConfig
from litkv.finetune.data import DataArgs
from litkv.finetune.loop import TrainArgs
from litkv.finetune.lora import LoRAArgs

run = cli.run


def run_and_dump(fabric, args):
    model = run(fabric, args)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(args.out_dir / f"rank{fabric.global_rank}.safetensors"))
    return model


cli.run = run_and_dump
ckpt, text, out = (Path(a) for a in sys.argv[1:4])
for mode in ("full", "lora"):
    cli.finetune(
        ckpt,
        mode=mode,
        data=DataArgs(path=text, seq_length=SEQ, val_fraction=0.0),
        kv_cache=KVCacheConfig(**KV),
        train=TrainArgs(max_steps=1, micro_batch_size=1, global_batch_size=4, lr=LR, warmup_steps=0, max_norm=None),
        lora=LoRAArgs(r=4, alpha=8.0, targets=TARGETS),
        out_dir=out / mode,
        precision="32-true",
        devices=2,
    )
"""


def _text_with_four_windows(ckpt: Path, path: Path) -> Path:
    for n_words in range(50, 120):
        write_text(path, n_words)
        if windows(ckpt, path)[0].shape[0] == 4:
            return path
    raise AssertionError("could not build a text of exactly 4 training sequences")


def _reference_step(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """One AdamW step on the mean cross-entropy of the whole batch, with plain autograd."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    logits = litkv.forward_chunked(model, inputs, KVCacheConfig(**KV))
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(ref)
    for key, value in ref.items():
        assert (got[key] - value).abs().max() <= 1e-5 + 1e-4 * value.abs().max(), key


def _start_two_processes(work: Path) -> subprocess.Popen:
    """The two-process run of `SCRIPT` in `work` (checkpoint `base`, text `t.txt`, results under `out`, its
    output in `stdout.txt` and `stderr.txt`)."""
    ckpt = make_checkpoint(work / "base")
    text = _text_with_four_windows(ckpt, work / "t.txt")
    script = work / "ddp_script.py"
    header = f"SEQ, LR, KV, TARGETS = {SEQ}, {LR}, {KV!r}, {TARGETS!r}\n"
    script.write_text(header + SCRIPT)
    return run_script(work, script, [ckpt, text, work / "out"])


# the two processes (a quarter of a minute of two cores) start with the test session, beside the other tests
# (tests/early.py)
EARLY_START = {"test_two_processes_match_one_step_on_the_combined_batch": _start_two_processes}


@pytest.mark.slow
def test_two_processes_match_one_step_on_the_combined_batch(early_process: tuple[subprocess.Popen, Path]) -> None:
    proc, work = early_process
    stdout = output_of(proc, work, timeout=300)
    assert "2 process(es)" in stdout
    ckpt, text = work / "base", work / "t.txt"
    inputs, targets = windows(ckpt, text)

    full = [load_file(str(work / "out" / "full" / f"rank{r}.safetensors")) for r in (0, 1)]
    assert all(torch.equal(full[0][k], full[1][k]) for k in full[0])
    model = load_model(ckpt).train()
    _assert_close(full[0], _reference_step(model, inputs, targets))
    _assert_close(load_file(str(work / "out" / "full" / "final" / "model.safetensors")), model.state_dict())

    lora = [load_file(str(work / "out" / "lora" / f"rank{r}.safetensors")) for r in (0, 1)]
    assert all(torch.equal(lora[0][k], lora[1][k]) for k in lora[0])
    model = load_model(ckpt).train()
    apply_lora(model, LoRAArgs(r=4, alpha=8.0, targets=TARGETS))
    mark_only_lora_as_trainable(model)
    with torch.no_grad():  # the adapters' A start random and get no gradient while B = 0: take them as trained
        for name, param in model.named_parameters():
            if name.endswith("lora_A"):
                param.copy_(lora[0][name])
    ref = _reference_step(model, inputs, targets)
    assert any(v.abs().max() > 0 for k, v in ref.items() if k.endswith("lora_B"))
    _assert_close(lora[0], ref)
