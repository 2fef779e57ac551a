"""`litkv finetune --learn_eviction true`: train eviction gates for a checkpoint and write a checkpoint
directory with them (the base's weights and files, plus `eviction_gates.safetensors` and the log)."""

from __future__ import annotations

import csv
import io
import shutil
from functools import partial
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from litkv.atomic import save_dir_atomic, write_atomic, write_text_atomic
from litkv.checkpoint import find_weights_file, load_model, load_tokenizer, save_gates
from litkv.finetune.data import DataArgs, load_examples, split_examples
from litkv.finetune.gates import GateTrainArgs, StepLog, train_gates
from litkv.finetune.state import COPIED_FILES, recall_task_files, yaml_safe
from litkv.learned.gate import GATES_FILE, EvictionGates

__all__ = ["LOG_FILE", "learn_eviction"]

#: Per-step record of a gate-training run, in the output checkpoint.
LOG_FILE = "learn_eviction.csv"


def learn_eviction(
    checkpoint_dir: Path, data: DataArgs, learn: GateTrainArgs, out_dir: Path, device: str | None = None
) -> Path:
    """Train gates for `checkpoint_dir` on `data` and write `out_dir/final` atomically.

    The backbone is frozen: the output holds the base's weights unchanged, its tokenizer, config and
    pass-key task files, the gates (`GATES_FILE`), the per-step log (`LOG_FILE`) and the settings
    (`learn_eviction.yaml`). Returns the written directory.
    """
    model = load_model(checkpoint_dir, device=device)
    tokenizer = load_tokenizer(checkpoint_dir)
    examples = load_examples(data, tokenizer, seed=learn.seed, checkpoint_dir=checkpoint_dir)
    train, _ = split_examples(examples, data.val_fraction, learn.seed)
    bar = tqdm(total=learn.steps, desc=f"learn eviction ({learn.method})", unit="step")

    def progress(log: StepLog) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{log.loss:.4g}", fit=f"{log.fit:.4g}", keep=f"{log.keep:.3f}", goal=f"{log.target:.3f}")

    try:
        gates, logs = train_gates(model, train, learn, progress)
    finally:
        bar.close()
    settings = yaml_safe({"base": checkpoint_dir, "data": data, "learn": learn})
    return save_dir_atomic(out_dir / "final", partial(_write, checkpoint_dir, gates, logs, settings))


def _write(base_dir: Path, gates: EvictionGates, logs: list[StepLog], settings: dict, tmp: Path) -> None:
    weights = find_weights_file(base_dir)
    for name in (weights.name, *COPIED_FILES, *recall_task_files(base_dir)):
        if (base_dir / name).is_file():
            write_atomic(tmp / name, partial(shutil.copyfile, base_dir / name))
    save_gates(gates, tmp / GATES_FILE)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["step", "loss", "fit", "keep", "target"])
    writer.writerows([log.step, log.loss, log.fit, log.keep, log.target] for log in logs)
    write_text_atomic(tmp / LOG_FILE, buffer.getvalue())
    write_text_atomic(tmp / "learn_eviction.yaml", yaml.safe_dump(settings, sort_keys=False))
