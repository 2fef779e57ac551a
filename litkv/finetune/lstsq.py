"""`--learn.method lstsq`: eviction gates fitted in closed form (ridge regression), one forward pass per
sequence and no backward.

The objective is `regress`'s (Locret/KVzap-style): each gate logit `k_pre . w / sqrt(D) + b` should
equal `log(m + 1e-4)`, where `m` is the largest attention weight the token receives from a dense query
at distance `>= window` (`litkv.finetune.gate_training.attention_mass`). The logit is linear in `(w, b)`, so the
mean squared error over all training tokens has one minimiser per layer and KV head, found from the
normal equations accumulated over the sequences:

    [w; b] = (X^T X + lambda * mean(diag(X^T X)) * I)^-1 X^T y,   X = [k_pre / sqrt(D), 1]

(float64 sums; `lambda` = `RIDGE`, which only guards against keys that span fewer than `D`
dimensions). `regress` reaches the same minimum by Adam, many steps later; each step here costs one
dense forward pass of the batch (no gradient), which is what makes gates for a real model affordable
on a CPU. Step `s` reads the batches `batch_indices` gives `distill` and `regress`, and its log's
`fit` is the in-sample mean squared error of the gates solved from the sequences seen so far.

No optimizer state exists, so there is nothing to checkpoint mid-run: `--learn.checkpoint_interval`
and `--resume` are refused with this method (one pass over 64 sequences of 1,024 tokens takes about
half an hour on 2 CPU cores for SmolLM2-135M; docs/learned.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from litkv.finetune.gate_training import GateTrainArgs, StepLog, attention_mass, batch_indices, evictable
from litkv.finetune.kvzip_target import kvzip_records
from litkv.gates.gate import EvictionGates
from litkv.inference.kvzip_reconstruction import RepeatPrompt

__all__ = ["RIDGE", "NormalEquations", "fit_gates_lstsq"]

#: Ridge strength, relative to the mean diagonal of `X^T X` of each (layer, KV head).
RIDGE = 1e-4


class NormalEquations:
    """The sums `X^T X` `(L, G, D+1, D+1)`, `X^T y` `(L, G, D+1)`, `y^T y` and the token count `(L, G)` of
    the gates' least-squares problem, float64."""

    def __init__(self, n_layer: int, n_kv_heads: int, head_size: int) -> None:
        shape = (n_layer, n_kv_heads)
        self.xtx = torch.zeros(*shape, head_size + 1, head_size + 1, dtype=torch.float64)
        self.xty = torch.zeros(*shape, head_size + 1, dtype=torch.float64)
        self.yty = torch.zeros(shape, dtype=torch.float64)
        self.count = torch.zeros(shape, dtype=torch.float64)

    def add(self, layer: int, keys_pre: torch.Tensor, goal: torch.Tensor) -> None:
        """Add the tokens of one layer: pre-RoPE keys `(B, G, N, D)` and their targets `(B, G, N)`."""
        x = keys_pre.detach().to("cpu", torch.float64) / math.sqrt(keys_pre.shape[-1])
        x = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)  # (B, G, N, D+1)
        y = goal.detach().to("cpu", torch.float64)
        self.xtx[layer] += torch.einsum("bgnd,bgne->gde", x, x)
        self.xty[layer] += torch.einsum("bgnd,bgn->gd", x, y)
        self.yty[layer] += (y * y).sum(dim=(0, 2))
        self.count[layer] += y.shape[0] * y.shape[2]

    def solve(self, ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor]:
        """The minimiser `(w, b)`: `w` `(L, G, D)` (the gates' `weight`: the logit `k_pre . w / sqrt(D) + b` is
        `X . [w; b]`), `b` `(L, G)`, float64."""
        eye = torch.eye(self.xtx.shape[-1], dtype=torch.float64)
        scale = self.xtx.diagonal(dim1=-2, dim2=-1).mean(dim=-1).clamp_min(1e-12)
        theta = torch.linalg.solve(self.xtx + ridge * scale[..., None, None] * eye, self.xty)
        return theta[..., :-1], theta[..., -1]

    def mse(self, weight: torch.Tensor, bias: torch.Tensor) -> float:
        """Mean squared error over every token added, of the gates `(weight, bias)`, averaged over (layer,
        KV head)."""
        theta = torch.cat([weight, bias[..., None]], dim=-1)
        quad = torch.einsum("lgd,lgde,lge->lg", theta, self.xtx, theta)
        sse = self.yty - 2 * (theta * self.xty).sum(dim=-1) + quad
        return float((sse / self.count.clamp_min(1)).mean())


def fit_gates_lstsq(
    model: nn.Module,
    examples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    args: GateTrainArgs,
    progress: Callable[[StepLog], None] | None = None,
    repeat: RepeatPrompt | None = None,
) -> tuple[EvictionGates, list[StepLog]]:
    """Gates for `model` (a `litkv.GPT`, frozen) from `args.steps` batches of `examples` `(ids (T,),
    targets (T,))`, solved in closed form; one `StepLog` per batch (`fit`: in-sample MSE so far).
    With `args.target == "kvzip"` the targets are log KVzip+ scores (`kvzip_records`, reconstruction
    prompt `repeat`) instead of log far attention.

    Raises:
        ValueError: no examples, or `args.checkpoint_interval` set (nothing to checkpoint).
    """
    if not examples:
        raise ValueError("fit_gates_lstsq needs at least one example")
    if args.checkpoint_interval:
        raise ValueError(
            f"--learn.method lstsq keeps no optimizer state to checkpoint: --learn.checkpoint_interval must be 0, "
            f"got {args.checkpoint_interval}"
        )
    c = model.config
    device = next(model.parameters()).device
    sums = NormalEquations(c.n_layer, c.n_query_groups, c.head_size)
    logs: list[StepLog] = []
    for step in range(args.steps):
        batch = batch_indices(len(examples), args.batch_size, args.seed, step)
        ids = torch.stack([examples[i][0] for i in batch]).to(device)
        mask = evictable(ids.shape[1], args.window, args.sinks, ids.device)
        if args.target == "kvzip":
            if repeat is None:
                raise ValueError("target 'kvzip' needs the reconstruction prompt (repeat=RepeatPrompt.build(...))")
            for layer, (keys_pre, goal) in enumerate(kvzip_records(model, ids, repeat)):
                sums.add(layer, keys_pre[:, :, mask], goal[:, :, mask])
        else:
            for layer, (keys_pre, mass) in enumerate(attention_mass(model, ids, args.window)):
                sums.add(layer, keys_pre[:, :, mask], torch.log(mass[:, :, mask].double() + 1e-4))
        fit = sums.mse(*sums.solve())  # the log: the in-sample error of the gates solved so far
        logs.append(StepLog(step, fit, fit, float("nan"), float("nan")))
        if progress is not None:
            progress(logs[-1])
    weight, bias = sums.solve()
    return EvictionGates(weight.float(), bias.float(), args.window, args.sinks).to(device), logs
