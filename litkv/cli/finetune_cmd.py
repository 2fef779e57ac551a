"""`litkv finetune`: LoRA or full fine-tuning with gradients through the KV cache, on Lightning Fabric.

`finetune` is the command (its signature is the CLI, through jsonargparse); `run` is the body that
every process executes once Fabric is launched (tests call it with their own `Fabric`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.strategies import ModelParallelStrategy
from tqdm.auto import tqdm

from litkv.checkpoints.checkpoint import (
    check_checkpoint_dir,
    default_checkpoint_dir,
    load_model,
    load_tokenizer,
    remove_stale_temp_files,
)
from litkv.checkpoints.download import known_checkpoint_dir
from litkv.checkpoints.runtime import precision_dtype
from litkv.cli.common import close_fabric, launching_rank
from litkv.core.atomic import check_output_dir, mark_output_dir
from litkv.core.validation import is_int, require_int
from litkv.finetune.checkpoint_dirs import (
    TrainingState,
    capture_rng,
    checkpoint_name,
    load_training_state,
    restore_model,
    restore_rng,
    save_checkpoint,
    yaml_safe,
)
from litkv.finetune.data import DataArgs, DataOrder, Example, load_examples, split_examples
from litkv.finetune.gate_training import GateTrainArgs
from litkv.finetune.learn_eviction import learn_eviction as run_learn_eviction
from litkv.finetune.loop import EvalArgs, TrainArgs, TrainingRun, fit
from litkv.finetune.lora import LoRAArgs, apply_lora, mark_only_lora_as_trainable
from litkv.finetune.sharding import (
    check_sharded_resume,
    check_strategy,
    fsdp_strategy,
    full_weights,
    load_shards,
    move_shards_into,
    save_shards,
)
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.model import GPT
from litkv.modeling.quant_weights import model_quant, parse_quantize, quantize_model

__all__ = ["FinetuneArgs", "finetune", "run", "MODES", "TRAINING_PRECISIONS"]

#: This command, read by litkv/__main__.py from the source (never imported for it): `CommandSpec`.
COMMAND = {"name": "finetune", "function": "finetune", "checkpoint_positional": True}

#: `--mode` values (checked explicitly: jsonargparse's error for a `Literal` does not list the choices).
MODES = ("lora", "full")

#: Supported `--precision` values: `litkv.checkpoints.runtime.PRECISIONS`' parameter dtypes, and ``bf16-mixed``
#: (float32 parameters and optimizer state, products in bfloat16 under autocast; the caches hold what
#: the projections give). ``16-mixed`` is not offered: its loss scaling would not reach the gradient
#: engine's own backward calls.
TRAINING_PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed")
_MIXED = {"bf16-mixed": torch.float32}


def parameter_dtype(precision: str) -> torch.dtype:
    """The parameters' dtype of a training precision (float32 for ``bf16-mixed``)."""
    if precision in _MIXED:
        return _MIXED[precision]
    return precision_dtype(precision, TRAINING_PRECISIONS)


_DEFAULT_DATA = DataArgs()
_DEFAULT_KV_CACHE = KVCacheConfig(policy="h2o", cache_length=512)
FINETUNE_CHUNK_SIZE = 128  # tokens per chunk when `kv_cache.chunk_size` is unset (generation's default is 256)
_DEFAULT_TRAIN = TrainArgs()
_DEFAULT_EVAL = EvalArgs()
_DEFAULT_LORA = LoRAArgs()
_DEFAULT_LEARN = GateTrainArgs()


@dataclass
class FinetuneArgs:
    """All settings of a fine-tuning run (what `hyperparameters.yaml` records)."""

    checkpoint_dir: Path
    mode: str
    data: DataArgs
    kv_cache: KVCacheConfig
    train: TrainArgs
    eval: EvalArgs
    lora: LoRAArgs
    out_dir: Path
    precision: str
    devices: int
    seed: int
    resume: Path | None
    strategy: str = "auto"
    activation_checkpointing: bool = True
    num_nodes: int = 1
    quantize: str = "none"

    @property
    def world_size(self) -> int:
        """Processes in all: ``devices`` per node times ``num_nodes``."""
        return self.devices * self.num_nodes

    def __post_init__(self) -> None:
        _check_mode(self.mode)
        if self.precision not in _MIXED:
            precision_dtype(self.precision, TRAINING_PRECISIONS, " (16-mixed: use bf16-mixed or 16-true)")
        require_int("devices", self.devices, 1)
        require_int("num_nodes", self.num_nodes, 1)
        check_strategy(self.strategy, self.world_size, self.mode, learn_eviction=False)
        if self.data.path is None:
            raise ValueError("no fine-tuning data: pass --data.path (a .json instruction file or a text file)")
        if parse_quantize(self.quantize).mode != "none" and self.mode != "lora":
            raise ValueError(f"--quantize {self.quantize} trains LoRA adapters over frozen weights: needs --mode lora")

    def to_hparams(self) -> dict[str, Any]:
        """A YAML-safe dict that `litkv finetune --config` accepts."""
        return {f.name: yaml_safe(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _check_mode(mode: object) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")


def default_precision() -> str:
    """``bf16-true`` on a CUDA device that supports it, else ``32-true``."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-true"
    return "32-true"


def finetune(
    checkpoint_dir: Path | None = None,
    mode: str = "lora",
    data: DataArgs = _DEFAULT_DATA,
    kv_cache: KVCacheConfig = _DEFAULT_KV_CACHE,
    train: TrainArgs = _DEFAULT_TRAIN,
    eval: EvalArgs = _DEFAULT_EVAL,
    lora: LoRAArgs = _DEFAULT_LORA,
    out_dir: Path = Path("out/finetune"),
    precision: str | None = None,
    devices: int = 1,
    seed: int = 1337,
    resume: Path | None = None,
    learn_eviction: bool = False,
    learn: GateTrainArgs = _DEFAULT_LEARN,
    strategy: str = "auto",
    activation_checkpointing: bool = True,
    num_nodes: int = 1,
    quantize: str = "none",
    overwrite: bool = False,
) -> None:
    """Fine-tune a model on long sequences with its KV cache policy in place (gradients through the cache).

    Every step runs each sequence chunk by chunk through the cache (`--kv_cache.*`) and takes the exact
    gradient of that computation (`litkv.gradient.chunked_loss_backward`), so the model learns to live
    with the policy's evictions. Checkpoints go to `out_dir/step-XXXXXX/` and `out_dir/final/`; each
    is a checkpoint directory that `litkv generate` and `litkv evaluate` load (LoRA adapters merged
    in; the base's `recall_format.json` and its filler file are copied along).

    Args:
        checkpoint_dir: Base checkpoint (`model_config.yaml`, `model.safetensors` or `lit_model.pth`,
            tokenizer files). Default: the small model shipped with litkv (`litkv/assets/default`).
        mode: ``lora``: train low-rank adapters only; ``full``: train every parameter.
        data: Fine-tuning data.
        kv_cache: The cache the model is fine-tuned with; its chunk size, when unset, is
            ``min(128, cache_length)``.
        train: Optimisation.
        eval: Validation.
        lora: LoRA adapters (``mode=lora``).
        out_dir: Where checkpoints and logs (`logs/`) go.
        precision: ``32-true``, ``bf16-true``, ``16-true`` or ``bf16-mixed`` (float32 weights, bfloat16
            products). Default: ``bf16-true`` on a GPU that supports it, else ``32-true``.
        devices: Number of devices (processes); more than one runs data parallel (DDP).
        seed: Random seed (LoRA initialisation, train/validation split, data order).
        resume: A checkpoint directory of an earlier run (`out_dir/step-XXXXXX`) to continue from: its
            weights, optimizer state, step and data order are restored.
        learn_eviction: Train eviction gates for the `learned` policy instead (needs
            `--kv_cache.policy learned`; the backbone stays frozen unless `--learn.lora true` trains LoRA
            adapters (`--lora.*`) with the gates; `mode`, `train`, `eval`, `precision` and `devices` do not
            apply; `--kv_cache.*` are the caches the gates train through,
            `--resume` a `step-XXXXXX` of an earlier gate-training run). Writes `out_dir/final/` with the base's
            weights and `eviction_gates.safetensors` (docs/learned.md).
        learn: Gate training (`--learn_eviction true`).
        strategy: ``auto`` (one device, or data parallel over several), ``ddp`` (data parallel: every
            process holds the whole model and optimizer) or ``fsdp`` (weights, gradients and optimizer
            state sharded over the ``devices`` processes; ``mode=full``; docs/finetune.md).
        activation_checkpointing: With ``strategy=fsdp``: recompute each block's MLP in the backward instead
            of keeping its activations.
        num_nodes: Machines of a multi-node run (``devices`` processes on each; started by a launcher
            such as ``torchrun`` or SLURM: docs/finetune.md).
        quantize: QLoRA (``mode=lora``, CPU): the frozen base's linear weights quantised at load, ``int8``,
            ``int4`` or ``int4-gN`` (a stored quantised checkpoint is used as it is); the saved checkpoints
            hold the dequantised weights with the adapters folded in (float). Default ``none``.
        overwrite: Write into an `out_dir` that an earlier `litkv finetune` wrote (its marker file
            `.litkv-output.json`) without `--resume`; its `step-*`/`final` are replaced as the run writes
            them. Any other non-empty `out_dir` is refused whatever this says.
    """
    _check_mode(mode)
    if learn_eviction is True and precision is not None:  # an option that would be ignored is refused
        raise ValueError(
            f"--precision {precision} does not apply to --learn_eviction true (the gates train in float32 on "
            "the checkpoint's weights as stored); drop --precision"
        )
    require_int("num_nodes", num_nodes, 1)
    check_strategy(strategy, devices * num_nodes if is_int(devices) else devices, mode, learn_eviction)
    args = FinetuneArgs(
        checkpoint_dir=check_checkpoint_dir(
            default_checkpoint_dir()
            if checkpoint_dir is None
            else (known_checkpoint_dir(checkpoint_dir) or checkpoint_dir)
        ),
        mode=mode,
        data=data,
        kv_cache=kv_cache
        if kv_cache.chunk_size is not None
        else replace(kv_cache, chunk_size=min(FINETUNE_CHUNK_SIZE, kv_cache.cache_length)),
        train=train,
        eval=eval,
        lora=lora,
        out_dir=Path(out_dir),
        precision=default_precision() if precision is None else precision,
        devices=devices,
        seed=seed,
        resume=None if resume is None else Path(resume),
        strategy=strategy,
        activation_checkpointing=activation_checkpointing,
        num_nodes=num_nodes,
        quantize=quantize,
    )
    if launching_rank():  # before anything is written (the other ranks find rank 0's marker)
        check_output_dir(args.out_dir, "finetune", [args.checkpoint_dir], overwrite, reuse=args.resume is not None)
    if learn_eviction or args.kv_cache.policy == "learned":
        _learn(args, learn_eviction, learn)
        return
    if args.strategy == "fsdp":
        fabric_strategy: str | ModelParallelStrategy = fsdp_strategy(args.world_size, args.activation_checkpointing)
    else:
        fabric_strategy = "ddp" if args.world_size > 1 else "auto"
    fabric = Fabric(
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=fabric_strategy,
        precision=args.precision,  # type: ignore[arg-type]
        loggers=CSVLogger(root_dir=args.out_dir / "logs", name="finetune"),
    )
    fabric.launch()
    run(fabric, args)
    close_fabric(fabric)


def _learn(args: FinetuneArgs, learn_eviction: bool, learn: GateTrainArgs) -> None:
    """The `--learn_eviction true` branch: train the gates (backbone frozen), write `out_dir/final`."""
    if learn_eviction is not True or args.kv_cache.policy != "learned":
        raise ValueError(
            "training eviction gates needs both --learn_eviction true and --kv_cache.policy learned, got "
            f"learn_eviction={learn_eviction!r}, kv_cache.policy={args.kv_cache.policy!r} (the other policies "
            "are fine-tuned through the cache without --learn_eviction)"
        )
    protected = learn.window + learn.sinks
    if protected >= args.data.seq_length:
        raise ValueError(
            f"--learn.window + --learn.sinks ({learn.window} + {learn.sinks}) must be < --data.seq_length "
            f"({args.data.seq_length}): no token would be outside the window for the gates to learn on"
        )
    device = "cuda" if torch.cuda.is_available() else None
    mark_output_dir(args.out_dir, "finetune")
    path = run_learn_eviction(
        args.checkpoint_dir, args.data, learn, args.out_dir, device, args.kv_cache, args.resume, args.lora
    )
    tqdm.write(f"saved {path}")


def run(fabric: Fabric, args: FinetuneArgs) -> GPT:
    """Fine-tune on every process of a launched `fabric`; returns the trained (unmerged) model."""
    fabric.seed_everything(args.seed)
    if fabric.is_global_zero:
        remove_stale_temp_files(args.out_dir)  # left by a run killed while writing a checkpoint
        mark_output_dir(args.out_dir, "finetune")
    state = None if args.resume is None else load_training_state(args.resume, args.mode)
    resume_shards = args.resume is not None and check_sharded_resume(args.resume, args.strategy, args.world_size)
    data_seed = args.seed if state is None else state.data_seed
    train_set, val_set = _load_data(args, data_seed)
    if state is not None and state.num_train_examples != len(train_set):
        raise ValueError(
            f"cannot resume from {str(args.resume)!r}: it was trained on {state.num_train_examples} examples, "
            f"the data now gives {len(train_set)} (same --data.* settings are needed)"
        )
    sharded = args.strategy == "fsdp"
    model = _build_model(fabric, args)
    if sharded:
        model = fabric.setup_module(model).module  # the blocks sharded in place (the engine takes the GPT)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=args.train.lr, weight_decay=args.train.weight_decay, betas=(args.train.beta1, args.train.beta2)
    )
    if state is not None:
        if resume_shards:
            load_shards(fabric, args.resume, state.step, model, optimizer)
        else:
            _restore_optimizer(optimizer, state, args.resume)
        restore_rng(state.rng)
    fabric.print(
        f"{args.mode} fine-tuning: {sum(p.numel() for p in params):,} trainable parameters, "
        f"{len(train_set)} training and {len(val_set)} validation sequences, {fabric.world_size} process(es), "
        f"cache {args.kv_cache.policy} with {args.kv_cache.cache_length} slots"
    )
    training = TrainingRun(
        fabric=fabric,
        model=model,
        optimizer=optimizer,
        train_set=train_set,
        val_set=val_set,
        order=DataOrder(len(train_set), args.train.global_batch_size, data_seed),
        kv_cache=args.kv_cache,
        train=args.train,
        eval=args.eval,
        save=lambda step, final: _save(fabric, args, model, optimizer, step, final, data_seed, len(train_set)),
        log=tqdm.write if fabric.is_global_zero else (lambda message: None),
        step=0 if state is None else state.step,
        sharded=sharded,
    )
    fit(training)
    for logger in fabric.loggers:
        logger.finalize("success")
    return model


def _restore_optimizer(optimizer: torch.optim.Optimizer, state: TrainingState, resume: Path | None) -> None:
    """`optimizer.load_state_dict`, with a ValueError naming the checkpoint if the state does not fit."""
    try:
        optimizer.load_state_dict(state.optimizer)
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as err:
        raise ValueError(
            f"cannot resume from {str(resume)!r}: its optimizer state does not fit this model's trainable "
            f"parameters (same --mode and --lora.* settings are needed): {err}"
        ) from err


def _load_data(args: FinetuneArgs, data_seed: int) -> tuple[list[Example], list[Example]]:
    tokenizer = load_tokenizer(args.checkpoint_dir)
    examples = load_examples(args.data, tokenizer, seed=data_seed, checkpoint_dir=args.checkpoint_dir)
    return split_examples(examples, args.data.val_fraction, data_seed)


def _build_model(fabric: Fabric, args: FinetuneArgs) -> GPT:
    """The base model on this process's device, adapters applied, trained weights restored on resume."""
    model = load_model(args.checkpoint_dir, device=fabric.device, dtype=parameter_dtype(args.precision))
    model = quantize_model(model, parse_quantize(args.quantize))  # type: ignore[assignment]
    if args.mode != "lora" and model_quant(model) is not None:
        raise ValueError(f"{args.checkpoint_dir} holds quantised weights, which are frozen: use --mode lora")
    if args.mode == "lora":
        apply_lora(model, args.lora)
        mark_only_lora_as_trainable(model)
    else:
        model.requires_grad_(True)
    if args.resume is not None:
        restore_model(model, args.resume, args.mode)
    if fabric.world_size > 1 and args.strategy != "fsdp":
        # Every process starts from rank 0's trainable parameters (LoRA initialisation included).
        for p in model.parameters():
            if p.requires_grad:
                torch.distributed.broadcast(p.data, src=0)
    return model.train()


def _save(
    fabric: Fabric,
    args: FinetuneArgs,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    step: int,
    final: bool,
    data_seed: int,
    num_train_examples: int,
) -> None:
    name = checkpoint_name(step, final)
    extra = None
    if args.strategy == "fsdp":  # collectives: every process takes part
        shards, save_id = save_shards(fabric, args.out_dir, name, step, model, optimizer)
        extra = move_shards_into(shards, args.world_size, step, save_id)
        model = full_weights(model)  # type: ignore[assignment]
    if fabric.is_global_zero:
        saved_optimizer = {"state": {}, "param_groups": []} if extra is not None else optimizer.state_dict()
        state = TrainingState(args.mode, step, data_seed, num_train_examples, saved_optimizer, capture_rng())
        path = save_checkpoint(
            args.out_dir / name,
            model,
            args.checkpoint_dir,
            args.to_hparams(),
            state,
            prompt_style=args.data.prompt_style if args.data.is_json else None,
            extra=extra,
        )
        tqdm.write(f"saved {path}")
    fabric.barrier()
