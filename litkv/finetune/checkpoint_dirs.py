"""Fine-tuning checkpoint directories: writing them (atomically, as a whole) and resuming from them.

A directory `out_dir/step-XXXXXX/` or `out_dir/final/` is a plain checkpoint that `litkv generate`
loads: `model.safetensors` (full weights, adapters merged in LoRA mode), `model_config.yaml`, the
tokenizer files, `hyperparameters.yaml` (a valid `--config` for `litkv finetune`) and, for JSON data,
`prompt_style.yaml`. For `--resume` it also holds `lora.safetensors` (LoRA mode) and
`training_state.pt`: optimizer state, step, data-order seed and RNG states, tensors and plain
containers only, so it loads with `torch.load(weights_only=True)`.

A directory is written under a temporary name (`litkv.core.atomic.TMP_PREFIX...`) and renamed into place
when complete (`save_dir_atomic`; each file in it through `litkv.core.atomic.write_atomic`), so a run killed
mid-write never leaves an incomplete `step-XXXXXX/`; the next run removes the temporary leftovers
(`remove_stale_temp_files`).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

from litkv.checkpoints.checkpoint import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    check_finite,
    is_temp_name,
    load_state_dict,
    safe_torch_load,
    save_state_dict_atomic,
)
from litkv.core.atomic import save_dir_atomic, write_atomic, write_text_atomic
from litkv.eval.recall import RECALL_FILE, RecallFormat
from litkv.finetune.lora import lora_state_dict, merged_state_dict
from litkv.modeling.model import GPT

__all__ = [
    "LORA_FILE",
    "STATE_FILE",
    "HPARAMS_FILE",
    "COPIED_FILES",
    "TrainingState",
    "checkpoint_name",
    "save_checkpoint",
    "check_resume_dir",
    "load_training_state",
    "restore_model",
    "restore_rng",
    "yaml_safe",
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
    """Restore what `capture_rng` took; ValueError if a state does not fit this machine's generator."""
    try:
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"cannot restore the saved RNG state: {err}") from err


def yaml_safe(value: Any) -> Any:
    """`value` with dataclasses turned into dicts, paths into strings and tuples into lists (recursively),
    so that `yaml.safe_dump` writes it."""
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: yaml_safe(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: yaml_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [yaml_safe(v) for v in value]
    return value


def _write_yaml(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, yaml.safe_dump(data, sort_keys=False))


def save_checkpoint(
    path: Path,
    model: GPT,
    base_dir: Path,
    hparams: dict[str, Any],
    state: TrainingState,
    prompt_style: str | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint directory (see the module docstring) atomically. Call on one process only.

    The files are written into a temporary directory next to `path`, which is renamed to `path` at
    the end (replacing an existing one); on any error it is removed and `path` is left as it was.
    `extra(tmp)` adds more (a sharded run's shards: `litkv.finetune.sharding`).
    """
    lora = state.mode == "lora"
    weights = merged_state_dict(model) if lora else model.state_dict()
    adapters = lora_state_dict(model) if lora else None

    def write(tmp: Path) -> None:
        save_state_dict_atomic(tmp / SAFETENSORS_FILE, weights)
        if adapters is not None:
            save_state_dict_atomic(tmp / LORA_FILE, adapters)
        for name in (*COPIED_FILES, *recall_task_files(base_dir)):
            if (base_dir / name).is_file():
                write_atomic(tmp / name, partial(shutil.copyfile, base_dir / name))
        _write_yaml(tmp / HPARAMS_FILE, hparams)
        if prompt_style is not None:
            from litgpt.prompts import PromptStyle

            cls = type(PromptStyle.from_name(prompt_style))
            _write_yaml(tmp / PROMPT_STYLE_FILE, {"class_path": f"{cls.__module__}.{cls.__name__}"})
        write_atomic(tmp / STATE_FILE, partial(torch.save, state.to_dict()))
        if extra is not None:
            extra(tmp)

    return save_dir_atomic(path, write)


def recall_task_files(base_dir: Path) -> list[str]:
    """The base checkpoint's pass-key task files (`recall_format.json` and the filler file it names,
    e.g. `heldout.txt`), copied into every saved checkpoint so that `litkv evaluate` measures recall on
    it as on the base; none when the base has no task."""
    if not (base_dir / RECALL_FILE).is_file():
        return []
    filler = RecallFormat.load(base_dir / RECALL_FILE).filler_file
    return [RECALL_FILE] + ([filler] if Path(filler).name == filler else [])


def check_resume_dir(resume_dir: Path, mode: str) -> Path:
    """FileNotFoundError/ValueError unless `resume_dir` is a complete checkpoint of a `mode` run."""
    resume_dir = Path(resume_dir)
    if not resume_dir.is_dir():
        raise FileNotFoundError(f"cannot resume from {str(resume_dir)!r}: no such directory")
    if is_temp_name(resume_dir.name):
        raise ValueError(
            f"cannot resume from {str(resume_dir)!r}: it is an incomplete checkpoint (the temporary directory "
            "of an interrupted write); resume from a step-XXXXXX directory instead"
        )
    required = [STATE_FILE, SAFETENSORS_FILE] + ([LORA_FILE] if mode == "lora" else [])
    for name in required:
        if not (resume_dir / name).is_file():
            raise FileNotFoundError(f"cannot resume from {str(resume_dir)!r}: it has no {name}")
    return resume_dir


def _check_state_fields(raw: dict[str, Any], file: Path) -> None:
    """ValueError naming the first field of a loaded training state with the wrong type or value."""
    expected = {"mode": str, "step": int, "data_seed": int, "num_train_examples": int, "optimizer": dict, "rng": dict}
    for name, kind in expected.items():
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{file}: {name} must be {kind.__name__}, got {type(value).__name__} {value!r:.80}")
    if raw["step"] < 0 or raw["num_train_examples"] < 1:
        raise ValueError(f"{file}: invalid step {raw['step']} or num_train_examples {raw['num_train_examples']}")
    optimizer = raw["optimizer"]
    if not isinstance(optimizer.get("state"), dict) or not isinstance(optimizer.get("param_groups"), list):
        raise ValueError(f"{file}: optimizer must be an optimizer state_dict with 'state' and 'param_groups'")
    rng = raw["rng"]
    for key, value in rng.items():
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
            raise ValueError(f"{file}: rng[{key!r}] must be a 1-D uint8 tensor (an RNG state), got {value!r:.80}")
    if "torch" not in rng:
        raise ValueError(f"{file}: rng has no 'torch' state")


def load_training_state(resume_dir: Path, mode: str) -> TrainingState:
    """Read `training_state.pt` from a complete checkpoint directory written by `save_checkpoint`.

    Raises:
        FileNotFoundError: the directory or one of its files is missing.
        ValueError: an incomplete (interrupted) directory, a corrupt or hostile (pickled objects)
            state file, fields of the wrong type, or a state of the other `mode`.
    """
    resume_dir = check_resume_dir(resume_dir, mode)
    file = resume_dir / STATE_FILE
    raw = safe_torch_load(file)
    if not isinstance(raw, dict) or set(raw) != set(TrainingState.__dataclass_fields__):
        keys = sorted(map(str, raw)) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{file} is not a litkv fine-tuning state (keys: {keys})")
    _check_state_fields(raw, file)
    state = TrainingState(**raw)
    if state.mode != mode:
        raise ValueError(f"cannot resume: {str(resume_dir)!r} was trained with mode={state.mode!r}, got mode={mode!r}")
    return state


def restore_model(model: GPT, resume_dir: Path, mode: str) -> None:
    """Load the trained weights of `resume_dir` into `model` (adapters only in LoRA mode)."""
    from litkv.finetune.lora import load_lora_state_dict

    resume_dir = check_resume_dir(resume_dir, mode)
    file = resume_dir / (LORA_FILE if mode == "lora" else SAFETENSORS_FILE)
    state_dict = load_state_dict(file)
    check_finite(state_dict, f"weights in {str(file)!r}")
    if mode == "lora":
        load_lora_state_dict(model, state_dict)
        return
    expected = model.state_dict()
    if set(state_dict) != set(expected):
        raise ValueError(f"weights in {str(resume_dir)!r} do not match the model of the base checkpoint")
    for key, tensor in expected.items():
        if state_dict[key].shape != tensor.shape:
            raise ValueError(
                f"{file}: {key} has shape {tuple(state_dict[key].shape)}, the base model has {tuple(tensor.shape)}"
            )
    model.load_state_dict(state_dict, strict=True)
