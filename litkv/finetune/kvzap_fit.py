"""A KVzap fit that spans sessions: gates regressed on log KVzip+ per (layer, KV head), from the key (litkv's
gate) or from the layer's hidden state (KVzap's input), window by window, with the sums saved after each.

The target is KVzap's (Jegou et al. 2025; kvpress `kvzap/data.py`): the log of the KVzip+ score of each
token (`litkv.finetune.kvzip_target.kvzip_records`), a quantity on one scale in every layer by
construction (an attention weight of the reconstruction pass times `||W_o v|| / ||x||`). Both inputs are
linear least squares with the ridge of `litkv.finetune.lstsq`; their sums (`KVzapSums`, float64) grow by
one window at a time and are written to a safetensors file with the list of windows they hold, so a fit
stopped anywhere resumes from its last window.

The key-input solution is `EvictionGates` (what `learned` runs; marked `target="kvzip"`: its logits are on
one scale, so `learned` ranks across layers by default). The hidden-state solution is the KVzap
surrogate itself, `(n_layer, G, C)` weights and `(n_layer, G)` biases, measured beside it; `learned` cannot
run it (its gate reads the key).

Calibration (`affine_calibration`): per (layer, KV head), the least-squares affine map of the gate logits
onto the target on other windows; `calibrated` folds it into the gates. `scale_report` measures whether
the logits are on one scale: the Spearman correlation with the target per (layer, KV head) and pooled over
all of them (a pooled value as high as the per-head ones: a global top-k ranks as the target does).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from litkv.core.atomic import write_atomic
from litkv.finetune.lstsq import RIDGE, NormalEquations
from litkv.gates.gate import EvictionGates

__all__ = ["KVzapSums", "ScaleReport", "affine_calibration", "calibrated", "scale_report", "spearman"]

_FORMAT = "litkv-kvzap-sums"


class KVzapSums:
    """The least-squares sums of both inputs over the windows added so far.

    Attributes:
        keys: `NormalEquations` of the key input (`(L, G, D+1, D+1)` ...).
        hxtx: `(L, C+1, C+1)` float64 `X^T X` of the hidden input `[x / sqrt(C), 1]` (shared by the heads).
        hxty: `(L, G, C+1)` float64 `X^T y`.
        windows: indices of the windows added, in order.
    """

    def __init__(self, n_layer: int, n_kv_heads: int, head_size: int, n_embd: int) -> None:
        self.keys = NormalEquations(n_layer, n_kv_heads, head_size)
        self.hxtx = torch.zeros(n_layer, n_embd + 1, n_embd + 1, dtype=torch.float64)
        self.hxty = torch.zeros(n_layer, n_kv_heads, n_embd + 1, dtype=torch.float64)
        self.windows: list[int] = []

    def add(self, layer: int, keys_pre: torch.Tensor, hidden: torch.Tensor, goal: torch.Tensor) -> None:
        """Add the tokens of one layer: pre-RoPE keys `(B, G, N, D)`, hidden states `(B, N, C)`, targets
        `(B, G, N)`."""
        self.keys.add(layer, keys_pre, goal)
        x = _with_one(hidden)
        self.hxtx[layer] += torch.einsum("bnc,bne->ce", x, x)
        self.hxty[layer] += torch.einsum("bnc,bgn->gc", x, goal.detach().to("cpu", torch.float64))

    def solve_hidden(self, ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden-input minimiser: weight `(L, G, C)` (applied to `x`, no scaling) and bias `(L, G)`."""
        eye = torch.eye(self.hxtx.shape[-1], dtype=torch.float64)
        scale = self.hxtx.diagonal(dim1=-2, dim2=-1).mean(dim=-1).clamp_min(1e-12)
        a = self.hxtx + ridge * scale[:, None, None] * eye
        theta = torch.linalg.solve(a, self.hxty.transpose(1, 2)).transpose(1, 2)  # (L, G, C+1)
        c = theta.shape[-1] - 1
        return theta[..., :-1] / math.sqrt(c), theta[..., -1]

    def hidden_mse(self, weight: torch.Tensor, bias: torch.Tensor) -> float:
        """Mean squared error over every token added, of the hidden surrogate `(weight (L, G, C), bias (L, G))`,
        averaged over (layer, KV head) (as `NormalEquations.mse` for the keys)."""
        theta = torch.cat([weight * math.sqrt(weight.shape[-1]), bias[..., None]], dim=-1)  # (L, G, C+1)
        quad = torch.einsum("lgc,lce,lge->lg", theta, self.hxtx, theta)
        sse = self.keys.yty - 2 * (theta * self.hxty).sum(dim=-1) + quad
        return float((sse / self.keys.count.clamp_min(1)).mean())

    def minus(self, other: KVzapSums) -> KVzapSums:
        """The sums of the windows in `self` and not in `other` (`other`'s windows a prefix of `self`'s): a
        held-out split without running the model again."""
        if self.windows[: len(other.windows)] != other.windows:
            raise ValueError(f"windows {other.windows} are not a prefix of {self.windows}")
        out = KVzapSums(
            self.keys.xtx.shape[0], self.keys.xty.shape[1], self.keys.xty.shape[2] - 1, self.hxtx.shape[-1] - 1
        )
        for name in ("xtx", "xty", "yty", "count"):
            setattr(out.keys, name, getattr(self.keys, name) - getattr(other.keys, name))
        out.hxtx, out.hxty = self.hxtx - other.hxtx, self.hxty - other.hxty
        out.windows = self.windows[len(other.windows) :]
        return out

    def gates(self, window: int, sinks: int) -> EvictionGates:
        """The key-input solution as gates on one scale (`target="kvzip"`)."""
        weight, bias = self.keys.solve()
        return EvictionGates(weight.float(), bias.float(), window, sinks, target="kvzip")

    def hidden_gates(self, window: int, sinks: int) -> EvictionGates:
        """The hidden-input solution as gates on one scale (`input="hidden"`, `target="kvzip"`): weight `(L, G, C)`
        read as `x . w / sqrt(C) + b`, the logits of `solve_hidden`."""
        weight, bias = self.solve_hidden()
        weight = weight * math.sqrt(weight.shape[-1])
        return EvictionGates(weight.float(), bias.float(), window, sinks, target="kvzip", input="hidden")

    def save(self, path: Path) -> None:
        """Write the sums and the window list atomically (safetensors)."""
        from safetensors.torch import save_file

        k = self.keys
        tensors = {"xtx": k.xtx, "xty": k.xty, "yty": k.yty, "count": k.count, "hxtx": self.hxtx, "hxty": self.hxty}
        meta = {"format": _FORMAT, "windows": json.dumps(self.windows)}
        write_atomic(path, lambda tmp: save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), meta))

    @classmethod
    def load(cls, path: Path) -> KVzapSums:
        """Read what `save` wrote (ValueError naming the file when it is not such a file)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != _FORMAT:
                raise ValueError(f"{str(path)!r} is not a KVzap fit state (format {meta.get('format')!r})")
            t = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safe_open is not iterable)
        n_layer, g, d1 = t["xty"].shape
        sums = cls(n_layer, g, d1 - 1, t["hxtx"].shape[-1] - 1)
        sums.keys.xtx, sums.keys.xty, sums.keys.yty, sums.keys.count = t["xtx"], t["xty"], t["yty"], t["count"]
        sums.hxtx, sums.hxty = t["hxtx"], t["hxty"]
        sums.windows = [int(i) for i in json.loads(meta["windows"])]
        return sums


def _with_one(hidden: torch.Tensor) -> torch.Tensor:
    """`[x / sqrt(C), 1]` `(B, N, C+1)` float64 of hidden states `(B, N, C)`."""
    x = hidden.detach().to("cpu", torch.float64)
    x = x / math.sqrt(x.shape[-1])
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


def hidden_logits(weight: torch.Tensor, bias: torch.Tensor, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """`(B, G, N)` float64 logits of the hidden-input surrogate (`KVzapSums.solve_hidden`) for hidden
    states `(B, N, C)` of layer `layer`."""
    x = hidden.detach().to("cpu", torch.float64)
    return torch.einsum("bnc,gc->bgn", x, weight[layer]) + bias[layer][None, :, None]


def affine_calibration(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (layer, KV head), the least-squares `(a, c)` of `targets ~ a * logits + c`; `logits`, `targets`
    `(L, G, N)`. Returns `a`, `c` `(L, G)` float64 (a head whose logits do not vary: `a = 0`)."""
    z, y = logits.double(), targets.double()
    zc = z - z.mean(dim=-1, keepdim=True)
    yc = y - y.mean(dim=-1, keepdim=True)
    var = (zc * zc).sum(dim=-1)
    a = torch.where(var > 0, (zc * yc).sum(dim=-1) / var.clamp_min(1e-300), torch.zeros_like(var))
    return a, y.mean(dim=-1) - a * z.mean(dim=-1)


def calibrated(gates: EvictionGates, a: torch.Tensor, c: torch.Tensor) -> EvictionGates:
    """`gates` whose logits are `a * logit + c` per (layer, KV head) (`affine_calibration`)."""
    weight = gates.weight.double() * a[..., None]
    bias = gates.bias.double() * a + c
    return EvictionGates(weight.float(), bias.float(), gates.window, gates.sinks, gates.weights, gates.target)


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors (ties: average ranks)."""
    return float(torch.corrcoef(torch.stack([_ranks(x), _ranks(y)]))[0, 1])


def _ranks(v: torch.Tensor) -> torch.Tensor:
    """Average ranks (1-based) of a 1-D tensor, float64."""
    v = v.double().flatten()
    order = torch.argsort(v, stable=True)
    sorted_v = v[order]
    ranks = torch.empty_like(v)
    ranks[order] = torch.arange(1, len(v) + 1, dtype=torch.float64)
    _, inverse, counts = torch.unique_consecutive(sorted_v, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, ranks[order])
    ranks[order] = (sums / counts)[inverse]
    return ranks


class ScaleReport(dict):
    """`mse` (mean over heads of the per-head mean squared error), `per_head` (mean over heads of the
    per-head Spearman), `per_head_min`, `pooled` (the Spearman over every token of every head)."""


def scale_report(logits: torch.Tensor, targets: torch.Tensor) -> ScaleReport:
    """How well `logits` `(L, G, N)` rank and fit `targets` `(L, G, N)` per head and pooled."""
    z, y = logits.double(), targets.double()
    heads = [spearman(z[i, j], y[i, j]) for i in range(z.shape[0]) for j in range(z.shape[1])]
    return ScaleReport(
        mse=float(((z - y) ** 2).mean(dim=-1).mean()),
        per_head=sum(heads) / len(heads),
        per_head_min=min(heads),
        pooled=spearman(z.flatten(), y.flatten()),
    )
