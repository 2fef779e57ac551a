"""Training the eviction gates (the backbone stays frozen).

Two methods, same gates, same data:

- `distill` (DMS-style, the default): the student is the model with soft delayed eviction
  (`litkv.gates.soft`), the teacher the same model without eviction. Loss per step:
  `KL(teacher || student)` over next-token distributions (tokens with a training target weigh
  `1 + answer_weight`) plus `compression_weight * relu(mean keep - target)`, the target going from 1
  to `target_keep` over the first `ramp` of the steps while the temperature anneals.
- `regress` (Locret/KVzap-style baseline): no gradient through the attention; each gate logit is
  regressed on the log of the largest attention weight its token receives from the dense model's
  queries beyond the window.

With `lora=True` (distill only), LoRA adapters of the backbone (`litkv.finetune.lora`, applied to the
model before `train_gates`) train together with the gates (DMS retrofits the model). The teacher is
the same model with its adapters switched off (`adapters_off`): the base weights, no second copy.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from litkv.core.validation import require_int
from litkv.finetune.lora import LoRALinear, load_lora_state_dict, lora_state_dict, mark_only_lora_as_trainable
from litkv.gates.gate import EvictionGates, unrotate_keys
from litkv.gates.soft import SoftEviction, soft_eviction
from litkv.gradient.distill import chunked_distill_backward
from litkv.kvcache.config import KVCacheConfig

__all__ = [
    "ENGINES",
    "METHODS",
    "GateTrainArgs",
    "GateTrainState",
    "StepLog",
    "adapters_off",
    "batch_indices",
    "start_from",
    "step_noise",
    "token_weights",
    "train_gates",
]

METHODS = ("distill", "regress", "lstsq")
#: What `regress`/`lstsq` fit the gate logits to: log far attention mass, or log KVzip+ scores (KVzap).
TARGETS = ("attention", "kvzip")
ENGINES = ("chunked", "whole")
#: Where `distill` starts (`GateTrainArgs.init`).
INITS = ("bias", "checkpoint")
IGNORE_INDEX = -100


@dataclass
class GateTrainArgs:
    """Settings of a gate-training run.

    Args:
        method: `distill` (through the soft cache), `regress` (on dense attention mass, by Adam) or `lstsq`
            (`regress`'s objective solved in closed form, `litkv.finetune.lstsq`).
        steps: optimizer steps.
        batch_size: sequences per step.
        lr: Adam learning rate of the gates (cosine to a tenth).
        target_keep: the fraction of tokens (outside window and sinks) the gates should keep at the end.
        ramp: fraction of the steps over which the target goes from 1 to `target_keep`.
        window: recent tokens never evicted (training) and the policy's default `recent`.
        sinks: first positions never evicted.
        temperature_start: of the logistic decision at step 0 (annealed geometrically) ...
        temperature_end: ... to this at the end of the ramp.
        compression_weight: weight of the compression term.
        answer_weight: extra weight of the KL at tokens that have a target in the data (recall answers).
        init_bias: the gates' initial bias (keep probability sigmoid(init_bias)).
        seed: seeds the data order and the noise.
        engine: `chunked` (distill through the chunked gradient engine and the `--kv_cache` caches: memory
            flat in the sequence length but for the host tapes, `litkv.gradient.distill`) or `whole`
            (each sequence attended at once, a `(B, H, T, T)` bias per layer). `regress` always runs whole.
        checkpoint_interval: write a resumable checkpoint every this many steps (0: none).
        lora: also train the LoRA adapters the model carries (`distill` only; the teacher is the model with
            its adapters off).
        lora_lr: Adam learning rate of the adapters (the same cosine schedule as `lr`).
        target: what `lstsq` fits the logits to: `attention` (log of the largest far attention weight) or
            `kvzip` (log KVzip+ score of a context-reconstruction pass, KVzap's target;
            `litkv.finetune.kvzip_target`).
        init: where `distill` starts: `bias` (zero weights and `init_bias`) or `checkpoint` (the checkpoint's
            own gates, every bias shifted by one constant so that a `target_keep` share of the first batch's
            evictable logits is above 0, `start_from`; the output keeps their `target`: gates of one scale
            stay on one, trained under one threshold). With `lora`, the retrofit DMS describes, from a fit.
    """

    method: str = "distill"
    steps: int = 400
    batch_size: int = 4
    lr: float = 0.05
    target_keep: float = 0.06
    ramp: float = 0.6
    window: int = 32
    sinks: int = 4
    temperature_start: float = 1.0
    temperature_end: float = 0.25
    compression_weight: float = 10.0
    answer_weight: float = 10.0
    init_bias: float = 2.0
    seed: int = 1234
    engine: str = "chunked"
    checkpoint_interval: int = 0
    lora: bool = False
    lora_lr: float = 1e-3
    target: str = "attention"
    init: str = "bias"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {self.method!r}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {list(TARGETS)}, got {self.target!r}")
        if self.target == "kvzip" and self.method != "lstsq":
            raise ValueError(
                f"target 'kvzip' (log KVzip+ scores) is fitted by method 'lstsq' only, got method {self.method!r}"
            )
        if self.init not in INITS:
            raise ValueError(f"init must be one of {list(INITS)}, got {self.init!r}")
        if self.init == "checkpoint" and self.method != "distill":
            raise ValueError(
                f"init 'checkpoint' continues the checkpoint's gates by method 'distill', got {self.method!r}"
            )
        if not isinstance(self.lora, bool):
            raise ValueError(f"lora must be true or false, got {self.lora!r}")
        if self.lora and self.method != "distill":
            raise ValueError(
                f"lora=True trains the adapters through the distillation loss: it needs method 'distill', "
                f"got {self.method!r} (regress has no gradient through the attention)"
            )
        for name in ("steps", "batch_size"):
            require_int(name, getattr(self, name), 1)
        for name in ("window", "sinks", "checkpoint_interval"):
            require_int(name, getattr(self, name), 0)
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if not 0 < self.target_keep <= 1:
            raise ValueError(f"target_keep must be in (0, 1], got {self.target_keep!r}")
        if not 0 <= self.ramp <= 1:
            raise ValueError(f"ramp must be in [0, 1], got {self.ramp!r}")
        for name in ("lr", "lora_lr", "temperature_start", "temperature_end"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("compression_weight", "answer_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def schedule(self, step: int) -> tuple[float, float, float]:
        """`(target keep, temperature, learning rate)` at `step`."""
        ramp_steps = max(1, round(self.ramp * self.steps))
        frac = min(1.0, step / ramp_steps)
        target = 1.0 + (self.target_keep - 1.0) * frac
        temperature = self.temperature_start * (self.temperature_end / self.temperature_start) ** frac
        lr = self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / self.steps)))
        return target, temperature, lr


@dataclass
class StepLog:
    """One step's record: `loss` (the optimised total), `kl` (distill) or `mse` (regress) in `fit`,
    `keep` the mean soft keep fraction (distill), `target` the compression target."""

    step: int
    loss: float
    fit: float
    keep: float
    target: float


@dataclass
class GateTrainState:
    """Where a gate-training run stands after `step` steps (what a checkpoint holds and `--resume` reads).

    Attributes:
        step: steps done.
        gates: the gates after them.
        optimizer: Adam's `state_dict()` after them (only its `"state"` is read back; parameters 0 and 1
            are the gates' weight and bias, then the adapters in the model's order).
        logs: one `StepLog` per step done.
        adapters: with `lora`, the LoRA adapters after them (`lora_state_dict`), else `None`.
    """

    step: int
    gates: EvictionGates
    optimizer: dict
    logs: list[StepLog]
    adapters: dict[str, torch.Tensor] | None = None


def batch_indices(num_examples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The examples of step `step`: the run's stream of examples is one permutation per epoch (seeded by
    `seed` and the epoch), cut into batches; a function of the step alone, so a resumed run continues it."""
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(k, num_examples)
        out.append(random.Random(seed * 1_000_003 + epoch).sample(range(num_examples), num_examples)[i])
    return out


def step_noise(shape: tuple[int, ...], seed: int, step: int) -> torch.Tensor:
    """`shape` uniform samples in [0, 1) for step `step` (the soft decisions' noise table), from the seed
    and the step alone."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed * 1_000_003 + step), dtype=torch.float64)


def train_gates(
    model: nn.Module,
    examples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    args: GateTrainArgs,
    progress: Callable[[StepLog], None] | None = None,
    kv_cache: KVCacheConfig | None = None,
    resume: GateTrainState | None = None,
    checkpoint: Callable[[GateTrainState], str] | None = None,
    initial: EvictionGates | None = None,
) -> tuple[EvictionGates, list[StepLog]]:
    """Train gates for `model` (a `litkv.GPT`, frozen) on `examples` `(ids (T,), targets (T,))`.

    With `args.lora`, the model's LoRA adapters (`apply_lora` first) train too, in place; the rest stays
    frozen.

    Args:
        kv_cache: the student's caches for `engine="chunked"` (default: `learned` with room for every
            token, chunks of `min(256, T)`: the whole-sequence loss, chunk by chunk).
        resume: continue a run from this state (bitwise: data order and noise are functions of the step;
            its adapters are loaded into the model).
        checkpoint: called every `args.checkpoint_interval` steps with the state; returns where it went.
        initial: the gates `args.init == "checkpoint"` starts from (shifted by `start_from` on step 0's batch).

    Returns:
        The trained gates (on the model's device) and one `StepLog` per step.
    """
    if not examples:
        raise ValueError("train_gates needs at least one example")
    c = model.config
    device = next(model.parameters()).device
    if resume is None and args.init == "checkpoint":
        if initial is None:
            raise ValueError("init 'checkpoint' needs the gates to start from (the checkpoint has none)")
        first = torch.stack([examples[i][0] for i in batch_indices(len(examples), args.batch_size, args.seed, 0)])
        gates = start_from(model, initial, first.to(device), args)
    elif resume is None:
        gates = EvictionGates.create(c.n_layer, c.n_query_groups, c.head_size, args.window, args.sinks, args.init_bias)
    else:
        gates = resume.gates
    gates = gates.to(device)
    for tensor in gates.parameters():
        tensor.requires_grad_(True)
    adapters = _trainable_adapters(model, args.lora, resume)
    groups = [{"params": gates.parameters(), "lr": args.lr}]
    if adapters:
        groups.append({"params": adapters, "lr": args.lora_lr})
    optimizer = torch.optim.Adam(groups, lr=args.lr)
    if resume is not None:
        fresh = optimizer.state_dict()
        optimizer.load_state_dict({"state": resume.optimizer["state"], "param_groups": fresh["param_groups"]})
    logs = [] if resume is None else list(resume.logs)
    saved = "nothing was saved (set --learn.checkpoint_interval to keep checkpoints)"
    try:
        for step in range(0 if resume is None else resume.step, args.steps):
            batch = batch_indices(len(examples), args.batch_size, args.seed, step)
            ids = torch.stack([examples[i][0] for i in batch]).to(device)
            targets = torch.stack([examples[i][1] for i in batch]).to(device)
            target, temperature, lr = args.schedule(step)
            for group, base_lr in zip(optimizer.param_groups, (args.lr, args.lora_lr), strict=False):
                group["lr"] = lr * base_lr / args.lr
            optimizer.zero_grad(set_to_none=True)
            loss, fit, keep = _step_loss(model, gates, ids, targets, args, step, kv_cache)
            if not math.isfinite(loss):
                raise ValueError(
                    f"gate training stopped at step {step}: the loss is {loss} (fit {fit}, keep {keep}); {saved} "
                    "(try a smaller --learn.lr, or check --learn.window against --data.seq_length)"
                )
            optimizer.step()
            log = StepLog(step, loss, fit, keep, target)
            logs.append(log)
            if progress is not None:
                progress(log)
            interval = args.checkpoint_interval
            if checkpoint is not None and interval and (step + 1) % interval == 0 and step + 1 < args.steps:
                state = GateTrainState(step + 1, _detached(gates), optimizer.state_dict(), list(logs))
                state.adapters = _adapter_copy(model) if adapters else None
                where = checkpoint(state)
                saved = f"the last checkpoint, {where}, is intact: continue with --resume {where}"
    finally:
        for tensor in [*gates.parameters(), *adapters]:
            tensor.requires_grad_(False)
    return gates, logs


def _trainable_adapters(model: nn.Module, lora: bool, resume: GateTrainState | None) -> list[torch.Tensor]:
    """Freeze `model`; with `lora`, unfreeze its LoRA adapters (loaded from `resume` when given) and return
    them in the model's order (ValueError when the model has none, or has adapters while `lora` is off)."""
    has = any(isinstance(m, LoRALinear) for m in model.modules())
    if has != lora:
        raise ValueError(
            f"--learn.lora {str(lora).lower()} needs a model {'with' if lora else 'without'} LoRA adapters, "
            f"the model {'has' if has else 'has none'}"
        )
    model.requires_grad_(False)
    if not lora:
        return []
    if resume is not None:
        if resume.adapters is None:
            raise ValueError("cannot resume LoRA training from a state without adapters")
        load_lora_state_dict(model, resume.adapters)
    mark_only_lora_as_trainable(model)
    return [p for p in model.parameters() if p.requires_grad]


def _adapter_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in lora_state_dict(model).items()}


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every `LoRALinear` of `model` computes its base layer alone (the adapter's term is
    multiplied by 0): the model is the dense teacher, the base weights without a second copy."""
    modules = [m for m in model.modules() if isinstance(m, LoRALinear)]
    scalings = [m.scaling for m in modules]
    for m in modules:
        m.scaling = 0.0
    try:
        yield model
    finally:
        for m, scaling in zip(modules, scalings, strict=True):
            m.scaling = scaling


def _teacher(model: nn.Module, lora: bool) -> Callable[[], AbstractContextManager]:
    return (lambda: adapters_off(model)) if lora else nullcontext


def _detached(gates: EvictionGates) -> EvictionGates:
    w, b = gates.weight.detach().clone(), gates.bias.detach().clone()
    return EvictionGates(w, b, gates.window, gates.sinks, gates.weights, gates.target)


@torch.no_grad()
def start_from(model: nn.Module, gates: EvictionGates, ids: torch.Tensor, args: GateTrainArgs) -> EvictionGates:
    """`gates` (fitted ones, e.g. the checkpoint's) as the start of a `distill` run: the same weights, every
    bias lowered by one constant `c`, the `1 - target_keep` quantile of their logits over the evictable
    tokens of `ids` `(B, T)` (every layer and KV head pooled), so that a `target_keep` share of them is
    above 0, the soft decision's threshold. One shift for all: the heads' relative scale is kept. The
    window and sinks are the run's (`args`); the target is the gates'."""
    mask = evictable(ids.shape[1], args.window, args.sinks, ids.device)
    logits = [gates.logits(layer, keys)[:, :, mask] for layer, (keys, _) in enumerate(attention_mass(model, ids, 1))]
    pooled = torch.cat([x.reshape(-1) for x in logits]).double()
    k = min(max(1, round((1.0 - args.target_keep) * pooled.numel())), pooled.numel())
    c = float(pooled.kthvalue(k).values)
    weight, bias = gates.weight.detach().clone().float(), (gates.bias.detach().clone() - c).float()
    return EvictionGates(weight, bias, args.window, args.sinks, None, gates.target)


def _step_loss(
    model: nn.Module,
    gates: EvictionGates,
    ids: torch.Tensor,
    targets: torch.Tensor,
    args: GateTrainArgs,
    step: int,
    kv_cache: KVCacheConfig | None,
) -> tuple[float, float, float]:
    """One step's loss, its fit part and the mean keep, its gradient accumulated into the gates' `.grad`
    (nothing when the loss is not finite)."""
    c = model.config
    target, temperature, _ = args.schedule(step)
    if args.method == "regress":
        loss, fit, keep = _regress_loss(model, gates, ids, args)
    else:
        b, t = ids.shape
        noise = step_noise((c.n_layer, b, c.n_query_groups, t), args.seed, step)
        soft = SoftEviction(gates, c.rope_n_elem, temperature=temperature, noise_table=noise)
        weight = token_weights(targets, args.answer_weight)
        if args.engine == "chunked":
            if kv_cache is None:
                kv_cache = KVCacheConfig(policy="learned", cache_length=t, chunk_size=min(256, t))
            step_result = chunked_distill_backward(
                model, soft, ids, weight, kv_cache, args.compression_weight, target, _teacher(model, args.lora)
            )
            return step_result.loss, step_result.kl, step_result.keep
        loss, fit, keep = _distill_loss(
            model, soft, ids, weight, args.compression_weight, target, _teacher(model, args.lora)
        )
    if torch.isfinite(loss):
        loss.backward()
    return float(loss.detach()), fit, keep


def evictable(length: int, window: int, sinks: int, device: torch.device) -> torch.Tensor:
    """`(T,)` bool: the tokens of a `length`-token sequence that some later query sees outside the window
    (and that are not sinks): the ones a decision applies to."""
    idx = torch.arange(length, device=device)
    return (idx < length - window) & (idx >= sinks)


def _distill_loss(
    model: nn.Module,
    soft: SoftEviction,
    ids: torch.Tensor,
    weight: torch.Tensor,
    compression_weight: float,
    target: float,
    teacher: Callable[[], AbstractContextManager] = nullcontext,
) -> tuple[torch.Tensor, float, float]:
    """KL(teacher || student) (token weights `weight` `(B, T)`) + the compression term, over the whole
    sequence at once; its KL part and the mean keep fraction. The teacher is the model inside `teacher()`."""
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    with torch.no_grad(), teacher():
        teacher_logp = F.log_softmax(model(ids).to(dtype), dim=-1)
    with soft_eviction(model, soft):
        student = F.log_softmax(model(ids).to(dtype), dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - student)).sum(dim=-1)  # (B, T)
    kl = (kl * weight).sum() / weight.sum()
    gates = soft.gates
    mask = evictable(ids.shape[1], gates.window, gates.sinks, ids.device)
    keep = torch.stack([k[:, :, mask] for k in soft.keep.values()]).mean()
    loss = kl + compression_weight * F.relu(keep - target)
    return loss, float(kl.detach()), float(keep.detach())


def token_weights(targets: torch.Tensor, answer_weight: float) -> torch.Tensor:
    """`(B, T)` float32 KL weight of each token: `1 + answer_weight` where a row with partly ignored
    targets (recall/copy rows) has a target (the answers), else 1."""
    return 1.0 + answer_weight * (targets != IGNORE_INDEX).float() * _has_sparse_targets(targets)


def _has_sparse_targets(targets: torch.Tensor) -> torch.Tensor:
    """`(B, 1)` 1.0 for rows whose targets are partly ignored (recall/copy rows), 0.0 for plain text."""
    return (targets == IGNORE_INDEX).any(dim=1, keepdim=True).float()


def _regress_loss(
    model: nn.Module, gates: EvictionGates, ids: torch.Tensor, args: GateTrainArgs
) -> tuple[torch.Tensor, float, float]:
    """MSE between each gate logit and the log attention mass of its token under the dense model."""
    records = attention_mass(model, ids, gates.window)
    losses = []
    for layer, (keys_pre, mass) in enumerate(records):
        logit = gates.logits(layer, keys_pre)
        mask = evictable(ids.shape[1], gates.window, gates.sinks, ids.device)
        goal = torch.log(mass + 1e-4)
        losses.append(F.mse_loss(logit[:, :, mask], goal[:, :, mask]))
    loss = torch.stack(losses).mean()
    return loss, float(loss.detach()), float("nan")


@torch.no_grad()
def attention_mass(model: nn.Module, ids: torch.Tensor, window: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the pre-RoPE keys `(B, G, T, D)` and each token's largest attention weight `(B, G, T)`
    from a query at distance `>= window` (over the KV group's query heads) in the dense model."""
    records: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [block.attn.register_forward_hook(_mass_hook(records, window)) for block in model.transformer.h]
    try:
        model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return records


def _mass_hook(records: list, window: int) -> Callable:
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        x, cos, sin = inputs[0], inputs[1], inputs[2]
        q, k, _ = module._qkv(x, cos, sin)
        b, h, t, hs = q.shape
        g = k.shape[1]
        scores = torch.matmul(q.view(b, g, h // g * t, hs), k.transpose(2, 3)).float() * module.scale
        idx = torch.arange(t, device=q.device)
        scores = scores.view(b, g, h // g, t, t).masked_fill(idx[None, :] > idx[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        far = (idx[:, None] - idx[None, :]) >= window  # (query, key)
        mass = probs.masked_fill(~far, 0.0).amax(dim=(2, 3))  # (B, G, T)
        records.append((unrotate_keys(k, cos, sin, module.config.rope_n_elem), mass))

    return hook
