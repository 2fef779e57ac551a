"""A RULER table answered data-parallel on Lightning Fabric: units sharded over processes, answers gathered.

`litkv evaluate --tasks ... --devices N [--num_nodes M]` launches Fabric as `litkv finetune` does (DDP: one
process per device; on a CPU, N processes of one thread each; on a GPU machine, one per GPU; several nodes
started by a launcher). Every process plans the same units (`litkv.eval.answers.RulerPlan.units`); rank 0
reads the answers a stopped run left (`AnswerStore`) and broadcasts them; the units still to answer are
shared by `shard`, a longest-first greedy split of their estimated cost that every rank computes alike; each
process writes each unit's answers as it finishes it, and at the end the answers are gathered to every rank.
Units compute the same batches in any number of processes, so the merged answers are those of one process
(with the same threads per process: the rounding of a matmul may depend on them).

Objects cross processes as UTF-8 JSON in uint8 tensors (`gather_json`), never pickled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from litkv.eval.answers import Answers, AnswerStore, RulerPlan, Unit, answer_unit, decode_answers
from litkv.modeling.model import GPT

if TYPE_CHECKING:
    from lightning.fabric import Fabric

__all__ = ["answer_units", "broadcast_json", "gather_json", "shard"]


def shard(units: Sequence[Unit], world_size: int, rank: int) -> list[Unit]:
    """The units of process `rank` of `world_size`: each unit, the costliest first (ties by key), goes to the
    process with the least cost so far (ties: the lowest rank); returned in the order given."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    load = [0.0] * world_size
    owner: dict[str, int] = {}
    for unit in sorted(units, key=lambda u: (-u.cost, u.key)):
        least = min(range(world_size), key=lambda r: (load[r], r))
        owner[unit.key] = least
        load[least] += unit.cost
    return [u for u in units if owner[u.key] == rank]


def gather_json(fabric: Fabric, obj: Any) -> list[Any]:
    """Every rank's JSON-serialisable `obj`, in rank order, on every rank."""
    import torch.distributed as dist

    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=fabric.device)
    size = torch.tensor([data.numel()], device=fabric.device)
    sizes = [torch.zeros_like(size) for _ in range(fabric.world_size)]
    dist.all_gather(sizes, size)
    longest = int(max(sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=fabric.device)
    padded[: data.numel()] = data
    rows = [torch.zeros_like(padded) for _ in range(fabric.world_size)]
    dist.all_gather(rows, padded)
    return [json.loads(bytes(row[: int(n)].tolist()).decode()) for row, n in zip(rows, sizes, strict=True)]


def broadcast_json(fabric: Fabric, obj: Any) -> Any:
    """Rank 0's JSON-serialisable `obj` on every rank."""
    return gather_json(fabric, obj if fabric.global_rank == 0 else None)[0]


def _to_json(answers: dict[str, Answers]) -> dict[str, dict[str, list[list[int]]]]:
    return {key: {str(b): outs for b, outs in per.items()} for key, per in answers.items()}


def answer_units(
    model: GPT,
    plan: RulerPlan,
    units: Sequence[Unit],
    store: AnswerStore | None = None,
    fabric: Fabric | None = None,
    progress: bool = False,
) -> tuple[dict[str, Answers], int]:
    """The answers of every unit (those in `store` read, not recomputed), and how many were read.

    With `fabric` (launched), each process answers its `shard` of the units still to answer; every process
    returns all the answers. Each unit's answers go to `store` (when given) as soon as they are computed.
    `progress`: a bar over rank 0's units.
    """
    rank, world = (0, 1) if fabric is None else (fabric.global_rank, fabric.world_size)
    done = store.read(units) if store is not None and rank == 0 else {}
    if fabric is not None:
        by_key = {u.key: u for u in units}
        sent = broadcast_json(fabric, _to_json(done))
        done = {key: decode_answers(per, by_key[key]) for key, per in sent.items()}
    pending = [u for u in units if u.key not in done]
    answers: dict[str, Answers] = {}
    desc = "ruler" if world == 1 else f"ruler (rank 0 of {world} processes)"
    for unit in tqdm(shard(pending, world, rank), desc=desc, unit="units", disable=not progress or rank != 0):
        answers[unit.key] = answer_unit(model, plan, unit)
        if store is not None:
            store.write(unit, answers[unit.key])
    if fabric is not None:
        by_key = {u.key: u for u in units}
        merged: dict[str, Answers] = {}
        for part in gather_json(fabric, _to_json(answers)):
            merged.update({key: decode_answers(per, by_key[key]) for key, per in part.items()})
        if store is not None and rank == 0:  # another node's answers, where its disk is not this one
            for key in sorted(set(merged) - set(answers)):
                if not (store.directory / f"{key}.json").is_file():
                    store.write(by_key[key], merged[key])
        answers = merged
    return {**done, **answers}, len(done)
