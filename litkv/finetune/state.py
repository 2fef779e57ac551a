"""Fine-tuning checkpoint directories: writing them (atomically, file by file) and resuming from them.

A directory `out_dir/step-XXXXXX/` or `out_dir/final/` is a plain checkpoint that `litkv generate`
loads: `model.safetensors` (full weights, adapters merged in LoRA mode), `model_config.yaml`, the
tokenizer files, `hyperparameters.yaml` (a valid `--config` for `litkv finetune`) and, for JSON data,
`prompt_style.yaml`. For `--resume` it also holds `lora.safetensors` (LoRA mode) and
`training_state.pt`: optimizer state, step, data-order seed and RNG states, tensors and plain
containers only, so it loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from litkv.checkpoint import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    load_state_dict,
    save_file_atomic,
    save_state_dict_atomic,
)
from litkv.finetune.lora import lora_state_dict, merged_state_dict
from litkv.model import GPT

__all__ = [
    "LORA_FILE",
    "STATE_FILE",
    "HPARAMS_FILE",
    "COPIED_FILES",
    "TrainingState",
    "checkpoint_name",
    "save_checkpoint",
    "load_training_state",
    "restore_model",
    "restore_rng",
]

LORA_FILE = "lora.safetensors"
STATE_FILE = "training_state.pt"
HPARAMS_FILE = "hyperparameters.yaml"
PROMPT_STYLE_FILE = "prompt_style.yaml"
#: Files copied from the base checkpoint directory when present.
COPIED_FILES = (
    CONFIG_FILE,
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
)


@dataclass
class TrainingState:
    """What `--resume` restores besides the weights.

    Attributes:
        mode: ``"lora"`` or ``"full"``.
        step: Optimizer steps taken.
        data_seed: Seed of the data order and train/validation split.
        num_train_examples: Size of the training set (checked on resume: same data).
        optimizer: `optimizer.state_dict()`.
        rng: `{"torch": cpu RNG state, "cuda": RNG state of the current CUDA device}` (uint8 tensors).
    """

    mode: str
    step: int
    data_seed: int
    num_train_examples: int
    optimizer: dict[str, Any]
    rng: dict[str, torch.Tensor]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "step": self.step,
            "data_seed": self.data_seed,
            "num_train_examples": self.num_train_examples,
            "optimizer": self.optimizer,
            "rng": self.rng,
        }


def checkpoint_name(step: int, final: bool) -> str:
    return "final" if final else f"step-{step:06d}"


def capture_rng() -> dict[str, torch.Tensor]:
    """RNG states to restore on resume (anything random in the model or a policy)."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def _copy_atomic(src: Path, dst: Path) -> None:
    save_file_atomic(dst, lambda tmp: shutil.copyfile(src, tmp))


def _yaml_atomic(path: Path, data: dict[str, Any]) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            yaml.safe_dump(data, f, sort_keys=False)

    save_file_atomic(path, write)


def save_checkpoint(
    path: Path,
    model: GPT,
    base_dir: Path,
    hparams: dict[str, Any],
    state: TrainingState,
    prompt_style: str | None = None,
) -> Path:
    """Write a checkpoint directory (see the module docstring). Call on one process only."""
    path.mkdir(parents=True, exist_ok=True)
    lora = state.mode == "lora"
    weights = merged_state_dict(model) if lora else model.state_dict()
    save_state_dict_atomic(path / SAFETENSORS_FILE, weights)
    if lora:
        save_state_dict_atomic(path / LORA_FILE, lora_state_dict(model))
    for name in COPIED_FILES:
        if (base_dir / name).is_file():
            _copy_atomic(base_dir / name, path / name)
    _yaml_atomic(path / HPARAMS_FILE, hparams)
    if prompt_style is not None:
        from litgpt.prompts import PromptStyle

        cls = type(PromptStyle.from_name(prompt_style))
        _yaml_atomic(path / PROMPT_STYLE_FILE, {"class_path": f"{cls.__module__}.{cls.__name__}"})
    save_file_atomic(path / STATE_FILE, lambda tmp: torch.save(state.to_dict(), tmp))
    return path


def load_training_state(resume_dir: Path, mode: str) -> TrainingState:
    """Read `training_state.pt` from a checkpoint directory written by `save_checkpoint`."""
    resume_dir = Path(resume_dir)
    file = resume_dir / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"cannot resume from {str(resume_dir)!r}: it has no {STATE_FILE}")
    raw = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(raw, dict) or set(raw) != set(TrainingState.__dataclass_fields__):
        raise ValueError(
            f"{file} is not a litkv fine-tuning state (keys: {sorted(raw) if isinstance(raw, dict) else raw})"
        )
    state = TrainingState(**raw)
    if state.mode != mode:
        raise ValueError(f"cannot resume: {str(resume_dir)!r} was trained with mode={state.mode!r}, got mode={mode!r}")
    return state


def restore_model(model: GPT, resume_dir: Path, mode: str) -> None:
    """Load the trained weights of `resume_dir` into `model` (adapters only in LoRA mode)."""
    from litkv.finetune.lora import load_lora_state_dict

    resume_dir = Path(resume_dir)
    if mode == "lora":
        if not (resume_dir / LORA_FILE).is_file():
            raise FileNotFoundError(f"cannot resume LoRA training from {str(resume_dir)!r}: it has no {LORA_FILE}")
        load_lora_state_dict(model, load_state_dict(resume_dir / LORA_FILE))
        return
    state_dict = load_state_dict(resume_dir / SAFETENSORS_FILE)
    expected = set(model.state_dict())
    if set(state_dict) != expected:
        raise ValueError(f"weights in {str(resume_dir)!r} do not match the model of the base checkpoint")
    model.load_state_dict(state_dict, strict=True)
