"""`litkv finetune --strategy fsdp`: weights, gradients and optimizer state sharded over the processes
with Lightning Fabric's `ModelParallelStrategy` (PyTorch's FSDP2 `fully_shard`; gloo on CPU, NCCL on GPUs).

Each transformer block is one FSDP unit (its weights gathered for its forward and backward only), and,
with activation checkpointing, its MLP (the widest activations) is recomputed in the backward instead
of keeping its activations (`torch.distributed._composable.checkpoint`: the parameter names stay those
of `GPT`); the attention is not, since recomputing it would write its cache a second time. The gradient
engine (`chunked_loss_backward`) runs on the sharded model as it is: every forward gathers, every
`backward` reduce-scatters (averaging over the processes) and accumulates into the sharded gradients.

A checkpoint directory of a sharded run is a plain checkpoint (`model.safetensors` with the full weights,
gathered on rank 0, that `litkv generate` loads) plus `sharded/rank-R.safetensors` (each process's shard
of the weights and the AdamW state, tensors only: nothing is unpickled on resume) and `sharding.json`
(the process count, the step and the save's id), which `--resume` needs: a sharded checkpoint resumes
with the same `--devices`. Each shard records in its safetensors metadata whose it is (rank, process
count, step, the save's id); a resume checks every process's file against them and its weights against
the slice of `model.safetensors` this rank holds, so swapped, missing or mixed shards are refused in one
line naming the file, on every process alike (the ranks agree before anyone raises: none is left waiting).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from litkv.checkpoints.checkpoint import load_state_dict
from litkv.core.atomic import TMP_PREFIX, write_atomic, write_text_atomic
from litkv.modeling.model import GPT

__all__ = [
    "SHARDED_DIR",
    "SHARDING_FILE",
    "STRATEGIES",
    "check_sharded_resume",
    "check_strategy",
    "fsdp_strategy",
    "full_weights",
    "load_shards",
    "move_shards_into",
    "read_sharding",
    "reshard",
    "save_shards",
    "sharded_nbytes",
    "shard_model",
]

STRATEGIES = ("auto", "ddp", "fsdp")
SHARDED_DIR = "sharded"
SHARDING_FILE = "sharding.json"


def check_strategy(strategy: str, devices: int, mode: str, learn_eviction: bool) -> None:
    """ValueError (one line saying what to do) for a strategy the run cannot use; `devices`: the processes
    in all (``--devices`` x ``--num_nodes``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
    if strategy != "fsdp":
        return
    if devices < 2:
        raise ValueError(
            f"--strategy fsdp shards over processes and needs --devices >= 2 (times --num_nodes), got {devices} "
            "process (drop --strategy for one device)"
        )
    if learn_eviction:  # before --mode: --learn_eviction's own --mode default is not what the user gave
        raise ValueError(
            "--learn_eviction true trains the gates on one process, got --strategy fsdp: drop --strategy fsdp and "
            "--devices"
        )
    if mode != "full":
        raise ValueError(
            f"--strategy fsdp trains --mode full, got --mode {mode!r}: LoRA's adapters are small, use --strategy ddp"
        )


def shard_model(model: GPT, mesh: object, activation_checkpointing: bool) -> GPT:
    """Each block an FSDP unit (its MLP recomputed in the backward with `activation_checkpointing`), the rest
    (embeddings, final norm, head) the root unit; in place, returned. `mesh`: Fabric's device mesh."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    data_mesh = mesh["data_parallel"]  # type: ignore[index]
    for block in model.transformer.h:
        if activation_checkpointing:  # the MLP only: a recomputed attention would write its cache again
            checkpoint(block.mlp)
        fully_shard(block, mesh=data_mesh)
    fully_shard(model, mesh=data_mesh)
    return model


def fsdp_strategy(devices: int, activation_checkpointing: bool) -> ModelParallelStrategy:
    """Fabric's FSDP2 strategy over `devices` processes (pure data parallel: no tensor parallelism)."""
    return ModelParallelStrategy(
        parallelize_fn=partial(shard_model, activation_checkpointing=activation_checkpointing),
        data_parallel_size=devices,
        tensor_parallel_size=1,
        save_distributed_checkpoint=True,
    )


def full_weights(model: GPT) -> GPT | None:
    """The sharded `model`'s full weights as an unsharded `GPT` on the CPU on rank 0, `None` elsewhere
    (a collective: every process calls it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if torch.distributed.get_rank() != 0:
        return None
    with torch.device("meta"):
        full = GPT(model.config)
    full.load_state_dict(state, strict=True, assign=True)
    return full


def reshard(model: GPT) -> None:
    """Give every FSDP unit of `model` its sharded parameters back (frees what a forward gathered and left:
    the root unit keeps its gathered weights after a forward without backward, a validation pass, and then
    `model.parameters()` are not the sharded ones the optimizer holds). Not a collective."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def save_shards(
    fabric: Fabric, out_dir: Path, name: str, step: int, model: GPT, optimizer: torch.optim.Optimizer
) -> tuple[Path, str]:
    """Write every process's shard of `model`'s weights and `optimizer`'s state into a temporary directory
    of `out_dir` (named with `TMP_PREFIX`, so that an interrupted run's leftover is removed), one
    safetensors file per process (`rank-R.safetensors`: no pickle, its metadata saying whose shard it is:
    rank, process count, `step`, the save's id); returns the directory and the save's id. Collective."""
    tmp = out_dir / f"{TMP_PREFIX}{name}-{SHARDED_DIR}"
    save_id = fabric.broadcast(uuid.uuid4().hex if fabric.is_global_zero else None, src=0)
    if fabric.is_global_zero:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    fabric.barrier()
    reshard(model)  # the parameters the optimizer holds, whatever the last forward left gathered
    tensors = {f"model.{n}": _cpu_copy(p) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        if id(param) not in names:
            raise RuntimeError("an optimizer parameter is not a sharded parameter of the model (not resharded?)")
        for key, value in state.items():
            tensors[f"optimizer.{names[id(param)]}.{key}"] = _cpu_copy(value)
    identity = _identity(fabric.global_rank, fabric.world_size, step, save_id)
    file = tmp / f"rank-{fabric.global_rank}.safetensors"
    write_atomic(file, lambda path: save_file(tensors, str(path), metadata=identity))
    fabric.barrier()
    return tmp, save_id


def _identity(rank: int, world_size: int, step: int, save_id: str) -> dict[str, str]:
    """A shard file's metadata: whose shard it is (safetensors metadata holds strings only)."""
    return {"rank": str(rank), "world_size": str(world_size), "step": str(step), "save_id": save_id}


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of a tensor's local shard (its own storage: safetensors refuses shared ones)."""
    return _local(t).detach().to("cpu", copy=True).contiguous()


def load_shards(fabric: Fabric, resume_dir: Path, step: int, model: GPT, optimizer: torch.optim.Optimizer) -> None:
    """Restore this process's shard of the weights and the optimizer state that `save_shards` wrote into
    `resume_dir` (a checkpoint of `step` with the same process count). Every process checks its file first:
    it must exist, say it is this rank's shard of `step` and of the save `sharding.json` names, hold every
    tensor in this rank's shape, and its weights must be this rank's slice of `model.safetensors` (which
    `model` holds now); any process's failure is raised as the same one-line ValueError on every process,
    naming the file. Collective."""
    save_id = read_sharding(resume_dir).get("save_id")
    file = resume_dir / SHARDED_DIR / f"rank-{fabric.global_rank}.safetensors"
    saved: dict[str, torch.Tensor] = {}
    try:
        saved = _read_shard(file, fabric.global_rank, fabric.world_size, step, save_id, model)
        problem = ""
    except ValueError as err:
        problem = str(err)
    except Exception as err:  # any other failure too: the other processes must not wait for this one
        problem = f"cannot resume from {str(file)!r}: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
    problems = [""] * fabric.world_size
    torch.distributed.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise ValueError(first)
    with torch.no_grad():
        for n, p in model.named_parameters():
            local = _local(p)
            local.copy_(saved[f"model.{n}"])
            moments = {key: _like(p, saved[f"optimizer.{n}.{key}"].to(local.device, local.dtype)) for key in _MOMENTS}
            optimizer.state[p] = {"step": saved[f"optimizer.{n}.step"].clone(), **moments}


_MOMENTS = ("exp_avg", "exp_avg_sq")


def _read_shard(
    file: Path, rank: int, world_size: int, step: int, save_id: object, model: GPT
) -> dict[str, torch.Tensor]:
    """This rank's shard file, checked (see `load_shards`); ValueError (one line naming `file`) otherwise."""
    where = f"cannot resume from {str(file)!r}"
    if not file.is_file():
        raise ValueError(f"{where}: it does not exist (a sharded checkpoint needs the file of each of its processes)")
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:  # safetensors' own error type for a truncated or foreign file
        raise ValueError(f"{where}: not a valid safetensors file ({' '.join(str(err).split())[:200]})") from err
    expected = _identity(rank, world_size, step, str(save_id))
    if not isinstance(save_id, str) or set(meta) != set(expected):
        raise ValueError(
            f"{where}: it does not say whose shard it is (written by an older litkv?); start a new run with "
            "--checkpoint_dir on its directory (full weights, no optimizer state)"
        )
    if meta != expected:
        raise ValueError(
            f"{where}: it holds rank {meta['rank']}'s shard of {meta['world_size']} processes at step {meta['step']} "
            f"(save {meta['save_id'][:8]}), this is rank {rank} of {world_size} resuming step {step} "
            f"(save {save_id[:8]} in {SHARDING_FILE}): shard files swapped or mixed from other checkpoints"
        )
    saved = load_state_dict(file)
    for n, p in model.named_parameters():
        local = _local(p)
        weights = _expect(saved, f"model.{n}", tuple(local.shape), file)
        if not torch.equal(weights.to(local.device, local.dtype), local.detach()):
            raise ValueError(f"{where}: its {n} is not rank {rank}'s slice of model.safetensors beside it")
        for key in _MOMENTS:
            _expect(saved, f"optimizer.{n}.{key}", tuple(local.shape), file)
        _expect(saved, f"optimizer.{n}.step", (), file)
    return saved


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor sharded as `param` is."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return local


def _expect(saved: dict[str, torch.Tensor], key: str, shape: tuple[int, ...], file: Path) -> torch.Tensor:
    if key not in saved or tuple(saved[key].shape) != shape:
        got = tuple(saved[key].shape) if key in saved else "nothing"
        raise ValueError(f"cannot resume from {str(file)!r}: {key} should have shape {shape}, got {got}")
    return saved[key]


def move_shards_into(shards: Path, devices: int, step: int, save_id: str) -> Callable[[Path], None]:
    """A `save_checkpoint` extra writer: moves the `shards` directory into the checkpoint being written
    (one rename) and records the process count, the step and the save's id in `sharding.json`."""
    record = {"strategy": "fsdp", "devices": devices, "step": step, "save_id": save_id}

    def write(tmp: Path) -> None:
        os.rename(shards, tmp / SHARDED_DIR)
        write_text_atomic(tmp / SHARDING_FILE, json.dumps(record) + "\n")

    return write


def read_sharding(resume_dir: Path) -> dict[str, object]:
    """`resume_dir`'s `sharding.json` as a dict; ValueError (one line) when it is unreadable."""
    file = resume_dir / SHARDING_FILE
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot resume from {str(resume_dir)!r}: unreadable {SHARDING_FILE} ({err})") from err
    if not isinstance(saved, dict) or "devices" not in saved:
        raise ValueError(f"cannot resume from {str(resume_dir)!r}: {SHARDING_FILE} has no process count")
    return saved


def check_sharded_resume(resume_dir: Path, strategy: str, devices: int) -> bool:
    """Whether `resume_dir` holds shards to load; ValueError (one line) when this run cannot resume it.
    `devices`: the run's processes in all (``--devices`` x ``--num_nodes``, as `sharding.json` counts)."""
    file = resume_dir / SHARDING_FILE
    if not file.is_file():
        if strategy == "fsdp":
            raise ValueError(
                f"cannot resume from {str(resume_dir)!r} with --strategy fsdp: it was not written by a sharded run "
                "(resume it with its own strategy, or start a new run with --checkpoint_dir on it)"
            )
        return False
    saved_devices = read_sharding(resume_dir)["devices"]
    if strategy != "fsdp" or saved_devices != devices:
        raise ValueError(
            f"cannot resume from {str(resume_dir)!r}: its shards were written by --strategy fsdp over {saved_devices} "
            f"processes, this run is --strategy {strategy} over {devices}; resume with --strategy fsdp and "
            f"{saved_devices} processes (--devices x --num_nodes), or start a new run with --checkpoint_dir on it"
        )
    if not (resume_dir / SHARDED_DIR).is_dir():
        raise FileNotFoundError(f"cannot resume from {str(resume_dir)!r}: it has no {SHARDED_DIR}/ directory")
    return True


def sharded_nbytes(model: GPT, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this process holds of the parameters and the optimizer state (local shards only)."""
    total = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += _local(value).numel() * value.element_size()
    return total
