"""`--precision` is one option with one meaning in generate, chat, serve, evaluate and finetune: the
inference commands take `litkv.checkpoints.runtime.PRECISIONS` (and refuse anything else in one line, before any
work), finetune takes the same `*-true` strings plus ``bf16-mixed``; ``bf16-mixed`` fine-tuning takes
the step that autograd through the cache under bfloat16 autocast takes, on float32 weights."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from safetensors.torch import load_file

import litkv
from litkv.checkpoints.checkpoint import load_model
from litkv.checkpoints.runtime import PRECISIONS
from litkv.cli.chat_cmd import chat
from litkv.cli.evaluate_cmd import evaluate
from litkv.cli.finetune_cmd import TRAINING_PRECISIONS, finetune
from litkv.cli.generate_cmd import generate
from litkv.cli.serve_cmd import serve
from litkv.finetune.data import DataArgs
from litkv.finetune.loop import TrainArgs, autocast
from litkv.kvcache.config import KVCacheConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "finetune"))
from test_finetune import SEQ, make_checkpoint, windows, write_text  # noqa: E402

INFERENCE = {"generate": generate, "chat": chat, "serve": serve, "evaluate": evaluate}
REFUSED = r"precision must be one of \['32-true', 'bf16-true', '16-true', '64-true'\], got 'bf16-mixed'"


def test_every_command_takes_precision_with_one_default() -> None:
    for command in (*INFERENCE.values(), finetune):
        parameter = inspect.signature(command).parameters["precision"]
        assert parameter.default is None and "str" in str(parameter.annotation), command.__name__
    assert set(TRAINING_PRECISIONS) == {"32-true", "bf16-true", "16-true", "bf16-mixed"}
    assert set(TRAINING_PRECISIONS) - {"bf16-mixed"} <= set(PRECISIONS)


@pytest.mark.parametrize("name", sorted(INFERENCE))
def test_inference_commands_refuse_an_unknown_precision_in_one_line(name: str, tiny_ckpt: Path) -> None:
    kwargs: dict[str, object] = {"checkpoint_dir": tiny_ckpt, "precision": "bf16-mixed", "device": "cpu"}
    if name == "generate":
        kwargs["prompt"] = "hello"
    with pytest.raises(ValueError, match=REFUSED):
        INFERENCE[name](**kwargs)  # type: ignore[operator]


def test_generate_runs_in_bf16(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    generate(checkpoint_dir=tiny_ckpt, prompt="hello", max_new_tokens=3, precision="bf16-true", device="cpu")
    assert capsys.readouterr().out.strip()


def test_bf16_mixed_finetune_step_equals_autograd_under_autocast(tmp_path: Path) -> None:
    """One full fine-tuning step in ``bf16-mixed`` writes float32 weights that equal autograd through
    `forward_chunked` under bfloat16 autocast + AdamW (all but at most 1% of the weights, within 1e-5 + 1e-4
    of their tensor's largest value)."""
    ckpt = make_checkpoint(tmp_path / "base")
    text = write_text(tmp_path / "t.txt", 70)
    inputs, targets = windows(ckpt, text)
    kv = KVCacheConfig(policy="h2o", cache_length=8, chunk_size=4)
    finetune(
        ckpt, mode="full", data=DataArgs(path=text, seq_length=SEQ, val_fraction=0.0), kv_cache=kv,
        train=TrainArgs(max_steps=1, micro_batch_size=inputs.shape[0], global_batch_size=inputs.shape[0], lr=0.01,
                        warmup_steps=0, max_norm=None),
        out_dir=tmp_path / "out", precision="bf16-mixed",
    )  # fmt: skip
    trained = load_file(str(tmp_path / "out" / "final" / "model.safetensors"))
    mixed, true32 = _reference_step(ckpt, inputs, targets, kv, True), _reference_step(ckpt, inputs, targets, kv, False)
    assert all(t.dtype == torch.float32 for t in trained.values())
    assert _off(trained, mixed) <= 0.01
    assert _off(trained, true32) > 0  # (not the float32 step)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true"])
def test_the_loop_autocasts_under_bf16_mixed_only(precision: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
    with autocast(fabric):
        assert torch.is_autocast_enabled("cpu") == (precision == "bf16-mixed")
        if precision == "bf16-mixed":
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def _reference_step(ckpt: Path, inputs: torch.Tensor, targets: torch.Tensor, kv: KVCacheConfig, mixed: bool) -> dict:
    model = load_model(ckpt).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        logits = litkv.forward_chunked(model, inputs, kv).float()
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _off(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Share of weights off by more than 1e-5 + 1e-4 of their tensor's largest value (AdamW's first step is
    +-lr per weight: a gradient near zero whose sign rounding flips moves its weight by 2 lr)."""
    off = sum(int(((got[k] - r).abs() > 1e-5 + 1e-4 * r.abs().max()).sum()) for k, r in ref.items())
    return off / sum(r.numel() for r in ref.values())
