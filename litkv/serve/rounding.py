"""Rounding classes: which row counts of a decode step round a row's result the same, measured.

A CPU matmul may round a row differently with the number of rows `M` it is computed with (a kernel per
block of rows, another for a remainder): a CPU may give, say, one result for `M = 1`, another for
`M = 2..15` and a third for `M >= 16` (the classes depend on the CPU, the shapes and the dtype), though
within a class the result does not depend on the row's place or its neighbours. A server whose steps all
run a row count of one class gives every row the result it gets alone in that class; running the smallest
count of the class that holds the active rows (not every row of the batch) makes a lone conversation as
cheap as the class allows.

`probe_rounding_classes` measures the classes for a model's own matrix products (every distinct linear
layer: its type, shapes, dtype, device and weights' kernel), on random inputs with a fixed seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["RoundingClasses", "matmul_layers", "probe_rounding_classes"]


@dataclass(frozen=True)
class RoundingClasses:
    """Row counts `1..max_rows` grouped by how a row's result rounds.

    Attributes:
        classes: the groups, each sorted, in order of their smallest count; two counts in one group give
            every row bitwise the same result, at any place among any neighbours.
        place_dependent: counts at which a row's result depends on its place or its neighbours (each is
            also a group of its own): a batch of that many rows is not exact.
    """

    classes: tuple[tuple[int, ...], ...]
    place_dependent: tuple[int, ...] = ()

    @property
    def max_rows(self) -> int:
        return max(max(c) for c in self.classes)

    def class_of(self, rows: int) -> tuple[int, ...]:
        """The group holding `rows` (ValueError outside `1..max_rows`)."""
        for group in self.classes:
            if rows in group:
                return group
        raise ValueError(f"{rows} rows were not probed (1..{self.max_rows})")

    def step_rows(self, active: int, batch_rows: int) -> int:
        """Rows a step runs with `active` rows in use, in a batch of `batch_rows` rows whose steps all keep
        the rounding of `batch_rows` rows: the smallest count of that class that is >= `active`."""
        if not 0 <= active <= batch_rows:
            raise ValueError(f"active rows must be in [0, {batch_rows}], got {active}")
        return min(r for r in self.class_of(batch_rows) if r >= active)

    def describe(self) -> str:
        """E.g. `1 / 2-15 / 16`."""
        parts = []
        for group in self.classes:
            runs: list[list[int]] = []
            for r in group:
                if runs and r == runs[-1][-1] + 1:
                    runs[-1].append(r)
                else:
                    runs.append([r])
            parts.append(",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs))
        return " / ".join(parts)


def matmul_layers(model: nn.Module) -> list[nn.Module]:
    """One module of each distinct matrix product of `model`: its linear layers (plain or quantised) told
    apart by type, `in_features`, `out_features`, bias and weight dtype."""
    seen: dict[tuple, nn.Module] = {}
    for module in model.modules():
        n_in, n_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if not isinstance(n_in, int) or not isinstance(n_out, int):
            continue
        weight = next(iter(module.parameters(recurse=False)), None)
        weight = weight if weight is not None else next(iter(module.buffers(recurse=False)), None)
        if weight is None:
            continue
        bias = getattr(module, "bias", None) is not None
        seen.setdefault((type(module), n_in, n_out, bias, weight.dtype), module)
    return list(seen.values())


@torch.inference_mode()
def probe_rounding_classes(
    model: nn.Module, max_rows: int, dtype: torch.dtype | None = None, seed: int = 0
) -> RoundingClasses:
    """Measure which row counts `1..max_rows` round alike for `model`'s matrix products.

    For every layer of `matmul_layers(model)` and every count `M`, the layer is applied to `M` random rows
    `X[:M]` (in `dtype`, default the model's, on its device) and to the same rows rolled by one place.
    Two counts are alike when every layer gives bitwise the same result for the rows they share; a count
    is place-dependent when rolling the rows changes a row's result.

    Args:
        model: the model (its weights are read, not changed).
        max_rows: the largest count probed (a server: its `--max_batch`).
        dtype: the activations' dtype (default: the lm head's weight dtype, else float32).
        seed: the random inputs' seed.
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be an int >= 1, got {max_rows!r}")
    layers = matmul_layers(model)
    if not layers:
        raise ValueError("the model has no linear layers to probe")
    first = next(model.parameters())
    dtype = dtype or (first.dtype if first.dtype.is_floating_point else torch.float32)
    gen = torch.Generator().manual_seed(seed)
    outputs: dict[int, list[torch.Tensor]] = {m: [] for m in range(1, max_rows + 1)}
    place_dependent = set()
    for layer in layers:
        x = torch.randn(max_rows, layer.in_features, generator=gen).to(device=first.device, dtype=dtype)
        for m in range(1, max_rows + 1):
            y = layer(x[:m])
            rolled = layer(torch.roll(x[:m], 1, dims=0))
            if not torch.equal(torch.roll(y, 1, dims=0), rolled):
                place_dependent.add(m)
            outputs[m].append(y)
    classes: list[list[int]] = []
    for m in range(1, max_rows + 1):
        if m in place_dependent:
            classes.append([m])
            continue
        for group in classes:
            if group[0] not in place_dependent and _alike(outputs[group[-1]], outputs[m]):
                group.append(m)
                break
        else:
            classes.append([m])
    return RoundingClasses(tuple(tuple(g) for g in classes), tuple(sorted(place_dependent)))


def _alike(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Every layer's results bitwise equal on the rows both have."""
    for x, y in zip(a, b, strict=True):
        n = min(x.shape[0], y.shape[0])
        if not torch.equal(x[:n], y[:n]):
            return False
    return True
