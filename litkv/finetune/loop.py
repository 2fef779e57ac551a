"""The training loop: steps with gradients through the cache, data parallel gradient averaging,
validation, learning-rate schedule, progress bar and periodic checkpoints.

The model is never wrapped in DDP: the gradient engine calls `.backward()` itself (several times per
micro-batch), which DDP's reducer would not see. Instead, after the micro-batches of a step, the
gradients of the trainable parameters are averaged over the processes (`all_reduce_gradients`), so
every process applies the same update and keeps identical parameters. Under `--strategy fsdp`
(`litkv.finetune.sharding`) the sharded model's own backward hooks reduce-scatter instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from tqdm.auto import tqdm

from litkv.core.validation import require_int
from litkv.finetune.data import IGNORE_INDEX, DataOrder, Example, collate
from litkv.finetune.sharding import reshard
from litkv.gradient import chunked_loss_backward
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.modeling.model import GPT

__all__ = [
    "TrainArgs",
    "EvalArgs",
    "TrainingRun",
    "autocast",
    "lr_at",
    "all_reduce_gradients",
    "chunked_loss_sum",
    "validate",
    "fit",
]


@dataclass
class TrainArgs:
    """Optimisation hyperparameters.

    Args:
        max_steps: Number of optimizer steps.
        micro_batch_size: Sequences per forward/backward on each device.
        global_batch_size: Sequences per optimizer step, over all devices (gradient accumulation makes
            up the difference). A multiple of ``micro_batch_size * devices``.
        lr: Peak learning rate (AdamW).
        min_lr: Learning rate at the end of the cosine decay.
        warmup_steps: Linear warm-up steps before the cosine decay.
        weight_decay: AdamW weight decay.
        beta1: AdamW beta1.
        beta2: AdamW beta2.
        max_norm: Clip the gradient norm to this value (``None``: no clipping).
        save_interval: Write ``step-XXXXXX/`` every this many steps (``None``: only ``final/``).
        log_interval: Update the progress bar's loss and tokens/s every this many steps.
    """

    max_steps: int = 100
    micro_batch_size: int = 1
    global_batch_size: int = 8
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup_steps: int = 10
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    max_norm: float | None = 1.0
    save_interval: int | None = None
    log_interval: int = 1

    def __post_init__(self) -> None:
        for name in ("max_steps", "micro_batch_size", "global_batch_size", "log_interval"):
            _check_int(f"train.{name}", getattr(self, name), 1)
        _check_int("train.warmup_steps", self.warmup_steps, 0)
        if self.save_interval is not None:
            _check_int("train.save_interval", self.save_interval, 1)
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size ({self.micro_batch_size})"
            )
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need train.lr > 0 and 0 <= train.min_lr <= train.lr, got {self.lr} and {self.min_lr}")
        if self.weight_decay < 0 or not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(
                f"need weight_decay >= 0 and betas in [0, 1), got {self.weight_decay}, {self.beta1}, {self.beta2}"
            )
        if self.max_norm is not None and not self.max_norm > 0:
            raise ValueError(f"train.max_norm must be > 0 or None, got {self.max_norm}")


@dataclass
class EvalArgs:
    """Validation.

    Args:
        interval: Compute the validation loss every this many steps (and after the last step).
        max_iters: Validation micro-batches per device per evaluation.
    """

    interval: int = 50
    max_iters: int = 20

    def __post_init__(self) -> None:
        _check_int("eval.interval", self.interval, 1)
        _check_int("eval.max_iters", self.max_iters, 1)


def _check_int(name: str, value: object, minimum: int) -> None:
    require_int(name, value, minimum)


@dataclass
class TrainingRun:
    """Everything `fit` needs. `step` is the number of optimizer steps already taken.

    `save(step)` writes a checkpoint for `step` (called on every process; rank 0 writes the files);
    `log(message)` prints a line next to the progress bar (rank 0).
    """

    fabric: Fabric
    model: GPT
    optimizer: torch.optim.Optimizer
    train_set: list[Example]
    val_set: list[Example]
    order: DataOrder
    kv_cache: KVCacheConfig
    train: TrainArgs
    eval: EvalArgs
    save: Callable[[int, bool], None]
    log: Callable[[str], None]
    step: int = 0
    sharded: bool = False  # FSDP: the backward reduce-scatters the gradients itself


def autocast(fabric: Fabric) -> AbstractContextManager[object]:
    """bfloat16 autocast on the run's device under ``bf16-mixed`` (float32 parameters); else nothing (the
    ``*-true`` precisions hold their dtype in the parameters)."""
    if getattr(fabric.strategy.precision, "precision", None) == "bf16-mixed":
        return torch.autocast(fabric.device.type, dtype=torch.bfloat16)
    return nullcontext()


def lr_at(step: int, train: TrainArgs) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine to `min_lr`."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps))
    return train.min_lr + (train.lr - train.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def all_reduce_gradients(fabric: Fabric, params: list[torch.nn.Parameter], bucket_numel: int = 1 << 24) -> None:
    """Average the gradients of `params` over all processes (in place), in flat buckets.

    A parameter without a gradient counts as a zero gradient, so every process joins the same
    collectives.
    """
    if fabric.world_size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        same_kind = buckets and buckets[-1][0].dtype == p.grad.dtype and buckets[-1][0].device == p.grad.device
        if not same_kind or size + p.grad.numel() > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(p.grad)
        size += p.grad.numel()
    for grads in buckets:
        flat = fabric.all_reduce(torch.cat([g.reshape(-1) for g in grads]), reduce_op="mean")
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def chunked_loss_sum(
    model: GPT, input_ids: torch.Tensor, targets: torch.Tensor, kv_cache: KVCacheConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and number of scored tokens of the chunked computation, without grad.

    Logits are computed one chunk at a time, so memory does not grow with `T`.

    Args:
        input_ids: `(B, T)`; targets: `(B, T)` with -100 where no loss is taken.

    Returns:
        Two float32 scalars: the loss sum and the token count.
    """
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    total = torch.zeros((), dtype=torch.float32, device=input_ids.device)
    with model.kv_caches_attached(kv_cache, b):
        for s, e in ChunkPlan.of(kv_cache).bounds(t):  # unpadded rows from 0: their chunks coincide
            logits = model(input_ids[:, s:e], positions[:, s:e]).float()
            chunk_targets = targets[:, s:e].reshape(-1)
            total += F.cross_entropy(logits.flatten(0, 1), chunk_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, (targets != IGNORE_INDEX).sum().float()


def validate(run: TrainingRun) -> float:
    """Mean validation loss per token over `eval.max_iters` micro-batches per process (all processes)."""
    fabric, mbs = run.fabric, run.train.micro_batch_size
    mine = run.val_set[fabric.global_rank :: fabric.world_size][: run.eval.max_iters * mbs]
    sums = torch.zeros(2, device=fabric.device)
    run.model.eval()
    try:
        for i in range(0, len(mine), mbs):
            input_ids, targets = (x.to(fabric.device) for x in collate(mine[i : i + mbs]))
            with autocast(fabric):
                loss_sum, count = chunked_loss_sum(run.model, input_ids, targets, run.kv_cache)
            sums += torch.stack((loss_sum, count))
    finally:
        run.model.train()
        if run.sharded:  # a forward without backward leaves the root unit's weights gathered
            reshard(run.model)
    sums = fabric.all_reduce(sums, reduce_op="sum")
    return float(sums[0] / sums[1].clamp(min=1.0))


def _train_step(run: TrainingRun, params: list[torch.nn.Parameter]) -> tuple[float, int]:
    """One optimizer step (all its micro-batches). Returns the mean loss over processes and the tokens."""
    fabric, train = run.fabric, run.train
    lr = lr_at(run.step, train)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    batches = run.order.rank_micro_batches(run.step, fabric.global_rank, fabric.world_size, train.micro_batch_size)
    loss_total, tokens = 0.0, 0
    for indices in batches:
        examples = [run.train_set[i] for i in indices]
        input_ids, targets = (x.to(fabric.device) for x in collate(examples))
        scale = 1.0 / len(batches)
        with autocast(fabric):
            loss_total += chunked_loss_backward(run.model, input_ids, targets, run.kv_cache, loss_scale=scale)
        tokens += sum(ids.numel() for ids, _ in examples)
    if not run.sharded:
        all_reduce_gradients(fabric, params)
    if train.max_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, train.max_norm)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    stats = torch.tensor([loss_total / len(batches), float(tokens)], device=fabric.device)
    stats = fabric.all_reduce(stats, reduce_op="sum")
    return float(stats[0]) / fabric.world_size, int(stats[1])


def fit(run: TrainingRun) -> None:
    """Train from `run.step` to `train.max_steps`, validating and saving on schedule, then save final."""
    fabric, train = run.fabric, run.train
    per_step = train.micro_batch_size * fabric.world_size
    if train.global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size ({train.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size * devices ({train.micro_batch_size} * {fabric.world_size})"
        )
    params = [p for p in run.model.parameters() if p.requires_grad]
    run.model.train()
    bar = tqdm(total=train.max_steps, initial=run.step, desc="finetune", unit="step", disable=not fabric.is_global_zero)
    window_tokens, window_seconds = 0, 0.0  # training steps only, not validation or saving
    while run.step < train.max_steps:
        start = time.perf_counter()
        loss, tokens = _train_step(run, params)
        if not math.isfinite(loss):  # the same all-reduced value on every process: all stop together
            raise ValueError(
                f"training stopped at step {run.step + 1}: the loss is {loss}; nothing more was saved "
                "(try a smaller --train.lr or --train.max_norm)"
            )
        window_seconds += time.perf_counter() - start
        run.step += 1
        window_tokens += tokens
        bar.update(1)
        if run.step % train.log_interval == 0 or run.step == train.max_steps:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{window_tokens / max(window_seconds, 1e-9):.0f}")
            fabric.log_dict({"train_loss": loss, "lr": lr_at(run.step - 1, train)}, step=run.step)
            window_tokens, window_seconds = 0, 0.0
        if run.val_set and (run.step % run.eval.interval == 0 or run.step == train.max_steps):
            val_loss = validate(run)
            run.log(f"step {run.step}: val loss {val_loss:.4f}, val ppl {math.exp(min(val_loss, 50.0)):.2f}")
            fabric.log_dict({"val_loss": val_loss}, step=run.step)
        if train.save_interval is not None and run.step % train.save_interval == 0:
            run.save(run.step, False)
    bar.close()
    run.save(run.step, True)
