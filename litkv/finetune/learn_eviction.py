"""`litkv finetune --learn_eviction true`: train eviction gates for a checkpoint and write a checkpoint
directory with them (the base's weights and files, plus `eviction_gates.safetensors` and the log).

With `--learn.checkpoint_interval N`, every `N` steps the run also writes `out_dir/step-XXXXXX/` (the
same checkpoint directory, plus Adam's state in `gate_optimizer.safetensors` and the step in
`learn_state.json`), atomically; `--resume out_dir/step-XXXXXX` continues from it bitwise (the data
order and the soft decisions' noise are functions of the seed and the step).

With `--learn.lora true`, LoRA adapters (`--lora.*`) train together with the gates. Every output
directory then holds the merged weights (`model.safetensors`, adapters folded in: a plain checkpoint
that `litkv generate --kv-cache learned` loads), the adapters alone (`lora.safetensors`, what
`--resume` reads back) and the gates, whose fingerprint is that of the merged weights.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from functools import partial
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from litkv.checkpoints.checkpoint import (
    SAFETENSORS_FILE,
    check_finite,
    find_weights_file,
    load_model,
    load_state_dict,
    load_tokenizer,
    save_gates,
    save_state_dict_atomic,
)
from litkv.core.atomic import remove_stale_temp_files, save_dir_atomic, write_atomic, write_text_atomic
from litkv.finetune.checkpoint_dirs import COPIED_FILES, LORA_FILE, checkpoint_name, recall_task_files, yaml_safe
from litkv.finetune.data import DataArgs, load_examples, split_examples
from litkv.finetune.gate_training import GateTrainArgs, GateTrainState, StepLog, train_gates
from litkv.finetune.lora import LoRAArgs, apply_lora, lora_state_dict, merged_state_dict
from litkv.finetune.lstsq import fit_gates_lstsq
from litkv.gates.gate import GATES_FILE, EvictionGates
from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT

__all__ = ["LOG_FILE", "OPTIMIZER_FILE", "STATE_FILE", "learn_eviction", "load_gate_state", "ramp_note"]

#: Per-step record of a gate-training run, in the output checkpoint.
LOG_FILE = "learn_eviction.csv"
#: Adam's state in a resumable checkpoint.
OPTIMIZER_FILE = "gate_optimizer.safetensors"
#: The step and the settings that must not change on resume.
STATE_FILE = "learn_state.json"
_FIXED = ("method", "engine", "batch_size", "seed", "window", "sinks", "init_bias", "lora", "init")


def learn_eviction(
    checkpoint_dir: Path,
    data: DataArgs,
    learn: GateTrainArgs,
    out_dir: Path,
    device: str | None = None,
    kv_cache: KVCacheConfig | None = None,
    resume: Path | None = None,
    lora: LoRAArgs | None = None,
) -> Path:
    """Train gates for `checkpoint_dir` on `data` and write `out_dir/final` atomically.

    Without `learn.lora` the backbone is frozen: the output holds the base's weights unchanged, its
    tokenizer, config and pass-key task files, the gates (`GATES_FILE`), the per-step log (`LOG_FILE`) and
    the settings (`learn_eviction.yaml`). With it, adapters `lora` (default `LoRAArgs()`, initialised from
    `learn.seed`) train too and the output holds the merged weights and `LORA_FILE` (module docstring).
    `kv_cache`: the student's caches (`--learn.engine chunked`). Returns the written directory.
    """
    lora = (LoRAArgs() if lora is None else lora) if learn.lora else None
    if Path(out_dir).is_dir():
        remove_stale_temp_files(out_dir)  # left by a run killed while writing a checkpoint
    model = load_model(checkpoint_dir, device=device)
    initial = model.eviction_gates if learn.init == "checkpoint" else None
    if learn.init == "checkpoint" and initial is None:
        raise ValueError(
            f"--learn.init checkpoint starts from the checkpoint's eviction gates, and {str(checkpoint_dir)!r} has "
            f"none ({GATES_FILE}); fit some first (--learn.method lstsq --learn.target kvzip) or use --learn.init bias"
        )
    model.eviction_gates = None  # the student's gates are the ones trained here
    base_id = model_fingerprint(model)["weights"]
    tokenizer = load_tokenizer(checkpoint_dir)
    examples = load_examples(data, tokenizer, seed=learn.seed, checkpoint_dir=checkpoint_dir)
    _check_lengths(examples, data, learn)
    train, _ = split_examples(examples, data.val_fraction, learn.seed)
    if resume is not None and learn.method == "lstsq":
        raise ValueError(f"--learn.method lstsq runs in one pass and cannot --resume (got {str(resume)!r})")
    state = None if resume is None else load_gate_state(resume, learn, len(train), lora)
    if lora is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(learn.seed)  # the adapters' initialisation
            apply_lora(model, lora)
    settings = yaml_safe({"base": checkpoint_dir, "data": data, "learn": learn, "kv_cache": kv_cache, "lora": lora})
    bar = tqdm(total=learn.steps, initial=0 if state is None else state.step, desc=f"learn eviction ({learn.method})")
    note = ramp_note(learn)
    if note is not None:
        bar.write(note)

    def progress(log: StepLog) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{log.loss:.4g}", fit=f"{log.fit:.4g}", keep=f"{log.keep:.3f}", goal=f"{log.target:.3f}")

    def checkpoint(s: GateTrainState) -> str:
        weights = _weights(model, base_id, s.gates)
        body = partial(_write, checkpoint_dir, weights, s.gates, s.logs, settings, (s, len(train)))
        return str(save_dir_atomic(out_dir / checkpoint_name(s.step, False), body))

    try:
        if learn.method == "lstsq":
            repeat = RepeatPrompt.build(tokenizer, None) if learn.target == "kvzip" else None  # plain text
            gates, logs = fit_gates_lstsq(model, train, learn, progress, repeat)
        else:
            gates, logs = train_gates(model, train, learn, progress, kv_cache, state, checkpoint, initial)
    finally:
        bar.close()
    weights = _weights(model, base_id, gates)
    return save_dir_atomic(out_dir / "final", partial(_write, checkpoint_dir, weights, gates, logs, settings, None))


def ramp_note(learn: GateTrainArgs) -> str | None:
    """The line said before training: the loss rises while the keep goal ramps down (None for `lstsq`, which
    has no ramp)."""
    if learn.method == "lstsq":
        return None
    ramp_steps = max(1, round(learn.ramp * learn.steps))
    return (
        f"note: the keep goal ramps from 1 to {learn.target_keep:g} over the first {ramp_steps} of {learn.steps} "
        "steps, so the loss (fit + compression) rises while it ramps and settles after; compare `fit` at the "
        "same `goal`"
    )


def _weights(
    model: GPT, base_id: str, gates: EvictionGates
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """Set `gates.weights` to the fingerprint of the weights the output holds: the base's (`base_id`,
    returns `None`: the base's file is copied) or, with LoRA adapters, the merged weights (returns them
    and the adapters, on the host)."""
    adapters = lora_state_dict(model)
    if not adapters:
        gates.weights = base_id
        return None
    merged = {k: v.cpu() for k, v in merged_state_dict(model).items()}
    with torch.device("meta"):
        plain = GPT(model.config)
    plain.load_state_dict(merged, strict=True, assign=True)  # as load_model reads the merged file
    gates.weights = model_fingerprint(plain)["weights"]
    return merged, {k: v.cpu().clone() for k, v in adapters.items()}


def _check_lengths(examples: list, data: DataArgs, learn: GateTrainArgs) -> None:
    """ValueError unless every example has the same length, longer than the gates' window and sinks."""
    lengths = sorted({int(ids.shape[0]) for ids, _ in examples})
    if len(lengths) != 1 or lengths[0] <= learn.window + learn.sinks:
        raise ValueError(
            f"gate training needs sequences of one length > --learn.window + --learn.sinks "
            f"({learn.window} + {learn.sinks}), got lengths {lengths[:5]} from {str(data.path)!r} "
            f"(--data.seq_length {data.seq_length}: is the data shorter than one sequence?)"
        )


def _write(
    base_dir: Path,
    weights: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None,
    gates: EvictionGates,
    logs: list[StepLog],
    settings: dict,
    resumable: tuple[GateTrainState, int] | None,
    tmp: Path,
) -> None:
    """Write an output directory into `tmp`; `weights`: `None` (the base's file is copied) or the merged
    weights and the adapters."""
    from safetensors.torch import save_file

    copied = [*COPIED_FILES, *recall_task_files(base_dir)]
    if weights is None:
        copied.insert(0, find_weights_file(base_dir).name)
    else:
        save_state_dict_atomic(tmp / SAFETENSORS_FILE, weights[0])
        save_state_dict_atomic(tmp / LORA_FILE, weights[1])
    for name in copied:
        if (base_dir / name).is_file():
            write_atomic(tmp / name, partial(shutil.copyfile, base_dir / name))
    save_gates(gates, tmp / GATES_FILE)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["step", "loss", "fit", "keep", "target"])
    writer.writerows([log.step, repr(log.loss), repr(log.fit), repr(log.keep), repr(log.target)] for log in logs)
    write_text_atomic(tmp / LOG_FILE, buffer.getvalue())
    write_text_atomic(tmp / "learn_eviction.yaml", yaml.safe_dump(settings, sort_keys=False))
    if resumable is not None:
        state, num_examples = resumable
        tensors = _optimizer_tensors(state.optimizer)
        write_atomic(tmp / OPTIMIZER_FILE, lambda path: save_file(tensors, str(path)))
        fixed = {name: settings["learn"][name] for name in _FIXED}
        record = {"step": state.step, "num_train_examples": num_examples, "learn": fixed, "lora": settings["lora"]}
        write_text_atomic(tmp / STATE_FILE, json.dumps(record, indent=1))


def _optimizer_tensors(optimizer: dict) -> dict[str, torch.Tensor]:
    """Adam's per-parameter state as flat safetensors entries `"{index}.{name}"`."""
    return {
        f"{index}.{name}": value.detach().cpu().contiguous()
        for index, entry in optimizer["state"].items()
        for name, value in entry.items()
    }


def load_gate_state(
    resume_dir: Path, learn: GateTrainArgs, num_examples: int, lora: LoRAArgs | None = None
) -> GateTrainState:
    """The state a checkpoint `out_dir/step-XXXXXX` of a gate-training run holds (ValueError naming the
    directory when it is not one, or when the settings, the LoRA adapters' settings `lora` or the data
    differ)."""
    from safetensors.torch import load_file

    resume_dir = Path(resume_dir)
    names = (GATES_FILE, OPTIMIZER_FILE, STATE_FILE, LOG_FILE) + ((LORA_FILE,) if learn.lora else ())
    missing = [name for name in names if not (resume_dir / name).is_file()]
    if missing:
        raise ValueError(f"--resume {str(resume_dir)!r} is not a gate-training checkpoint: missing {missing}")
    record = json.loads((resume_dir / STATE_FILE).read_text(encoding="utf-8"))
    now = {name: yaml_safe(getattr(learn, name)) for name in _FIXED}
    changed = {k: (record["learn"].get(k), v) for k, v in now.items() if record["learn"].get(k, False) != v}
    if record.get("lora") != yaml_safe(lora):
        changed["lora adapters"] = (record.get("lora"), yaml_safe(lora))
    if changed or record["num_train_examples"] != num_examples:
        raise ValueError(
            f"cannot resume from {str(resume_dir)!r}: settings (saved, now) {changed} and training examples "
            f"{record['num_train_examples']} saved, {num_examples} now must match"
        )
    tensors = load_file(str(resume_dir / OPTIMIZER_FILE))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer = {"state": state}  # train_gates puts it into a fresh Adam's state_dict
    with open(resume_dir / LOG_FILE, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    logs = [
        StepLog(int(r["step"]), float(r["loss"]), float(r["fit"]), float(r["keep"]), float(r["target"])) for r in rows
    ]
    adapters = None
    if learn.lora:
        adapters = load_state_dict(resume_dir / LORA_FILE)
        check_finite(adapters, f"LoRA adapters in {str(resume_dir / LORA_FILE)!r}")
    gates = EvictionGates.load(resume_dir / GATES_FILE)
    return GateTrainState(int(record["step"]), gates, optimizer, logs, adapters)
