"""The one-shot compression: a component the layer cache composes beside its policy, and the wrappers
`one_shot(policy)` and (in `adakv.py`) `adakv(policy)`.

In one-shot mode a cache keeps every prompt token (it must have room for the whole prompt), then
`compress()` keeps `budget` tokens per (row, KV head), scored by the policy's `oneshot_scores()`, and moves
them before `num_filled`, right-aligned in each head (`compact_slots`: each head's tokens and the ones decoding
appends form one run of slots, attended without a mask); decoding then fills the freed slots without eviction
(the policy's continuous eviction resumes only if the cache fills up again). `compress()` runs at the end of the prompt
(`KVCaches.end_prefill`, which `generate` calls after the prefill), or when a caller invokes it (before a
question that must not be compressed, as kvpress's pipeline does; `compress_all(caches)`).

Who runs what:

- the policy ranks: `oneshot_scores()` `(B, G, L)` (highest kept; `inf`: always kept) and, for a policy whose
  layers rank against each other, `compresses_across_layers()`;
- the compression (`OneShot`, composed by `SlotMachine` as `cache.one_shot` when the policy's options ask for
  it: `options.one_shot_budget(cache_length)` is not `None`) keeps the whole prompt (`check_room`), chooses the
  kept slots (`select_keep`: per head by default, AdaKV's allocation in `adakv.AdaKV`), compacts them,
  and carries the host flag `"row.one_shot_compressed"` in the cache's state;
- which compression a policy runs is its class's `compression` (`OneShot` for every `KVCache`);
  `one_shot(policy, compression)` makes a policy class that runs one-shot only, with that compression.

`KVCacheConfig(policy, options={"mode": "one-shot", "budget": N})` runs exactly what
`one_shot(policy_class)` with `budget=N` runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import field, make_dataclass
from typing import Any, ClassVar

import torch

from litkv.kvcache.call_checks import check_no_nan
from litkv.kvcache.candidates import keep_highest
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.options import PolicyOptions
from litkv.kvcache.policy import Policy

__all__ = ["OneShot", "compact_slots", "compress_all", "compress_layers", "keep_across_layers", "one_shot"]


class OneShot:
    """The one-shot compression of one layer cache (`cache.one_shot`): keep the prompt, then `budget` tokens
    per (row, KV head), the highest `policy.oneshot_scores()`.

    Subclass it to change which slots are kept (`select_keep`; `adakv.AdaKV`) or to add options
    (`option_fields`, checked by `check_options`), and run it with `one_shot(policy, YourCompression)`.

    Attributes:
        cache: the layer cache (`SlotMachine`) it compresses; `policy` is the cache's.
        budget: tokens kept per (row, KV head).
        compressed: whether the compression ran (saved with the state as `"row.one_shot_compressed"`).
    """

    #: options the compression adds to its policy's (`one_shot` puts them in the wrapped class's `Options`):
    #: `(name, type, default)` each
    option_fields: ClassVar[tuple[tuple[str, type, Any], ...]] = ()

    def __init__(self, cache: SlotMachine, budget: int) -> None:
        self.cache = cache
        self.budget = budget
        self.compressed = False

    @classmethod
    def check_options(cls, options: PolicyOptions) -> None:
        """Raise naming the option if one of `option_fields` is not usable (nothing to check by default)."""

    @property
    def policy(self) -> Policy:
        """The cache's policy, which ranks the slots (`oneshot_scores`)."""
        return self.cache.policy

    @property
    def options(self) -> PolicyOptions:
        """The policy's options (with this compression's `option_fields` when built by `one_shot`)."""
        return self.cache.config.policy_options

    def compress(self) -> None:
        """Keep the `budget` best-scored tokens of each (row, KV head), compacted (`compact_slots`)."""
        name = self.cache.name
        if self.policy.compresses_across_layers():
            raise RuntimeError(
                f"{name} compresses every layer at once (compresses_across_layers(): across_layers=True, or gates "
                "on one scale): call KVCaches.end_prefill() (generate and evaluate do) or "
                "litkv.kvcache.one_shot.compress_all(caches), not compress() of a layer"
            )
        self.cache.check_idle("compress()")
        scores = self.policy.oneshot_scores().to(torch.float32)
        check_no_nan(scores, f"{name}.oneshot_scores")  # once per prompt
        compact_slots(self.cache, self.select_keep(scores, self.cache.positions))
        self.compressed = True

    def select_keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`(B, G, L)` bool: the `budget` highest float32 `scores` of each (row, KV head) among the filled
        slots, equal scores broken by position (`keep_highest`: not by the slots the tokens sit in)."""
        rank = scores.masked_fill(positions < 0, float("-inf"))
        top = keep_highest(rank, positions, min(self.budget, self.cache.cache_length))
        return torch.zeros_like(positions, dtype=torch.bool).scatter_(2, top, True) & (positions >= 0)

    def end_prefill(self) -> None:
        """The end of the prompt: compress (once)."""
        if not self.compressed:
            self.compress()

    def check_room(self, input_pos: torch.Tensor) -> None:
        """The whole prompt must fit before the compression."""
        over = None if self.compressed else self.cache.overflow(input_pos, self.cache.cache_length)
        if over is not None:
            row, held, need = over
            raise ValueError(
                f"{self.cache.name} in mode='one-shot' keeps the whole prompt until it is compressed: "
                f"cache_length={self.cache.cache_length}, row {row} holds {held} tokens, {need - held} more do "
                "not fit. Use cache_length >= prompt length (the budget sets what is kept)"
            )

    def flags(self) -> dict[str, bool]:
        """Whether the cache compressed (`"row.one_shot_compressed"` in the state)."""
        return {"one_shot_compressed": self.compressed}

    def set_flags(self, flags: Mapping[str, bool]) -> None:
        self.compressed = flags["one_shot_compressed"]


def one_shot(policy: type[Policy], compression: type[OneShot] = OneShot, module: str | None = None) -> type[Policy]:
    """`policy` (a class with a one-shot mode: options `mode` and `budget`) run one-shot only, compressed by
    `compression`: a class named `<compression><policy>` (`OneShotSnapKV`, `AdaKVSnapKV`) whose `mode` defaults
    to `"one-shot"` (`"continuous"` is refused) and whose options add `compression.option_fields`.

    Use it by path as any policy (`KVCacheConfig("my.module:OneShotSnapKV", options={"budget": 64})`), or
    register it (`register_kv_cache("snapkv-1shot")(one_shot(SnapKVKVCache))`). Without a custom compression it
    is the same as `options={"mode": "one-shot", "budget": ...}` on `policy` itself. `module`: the module the
    class is found in by path (default: the policy's)."""
    if not (isinstance(policy, type) and issubclass(policy, Policy)):
        raise TypeError(f"one_shot expects a policy class (a KVCache subclass), got {policy!r}")
    if not (isinstance(compression, type) and issubclass(compression, OneShot)):
        raise TypeError(f"one_shot expects a OneShot subclass as compression, got {compression!r}")
    base = policy.Options
    if not {"mode", "budget"} <= {f.name for f in dataclasses.fields(base)}:
        raise TypeError(f"one_shot needs a policy with a one-shot mode (options mode, budget), got {policy.__name__}")
    name = f"{compression.__name__}{policy.__name__.removesuffix('KVCache')}"

    def check(self: Any, cache_length: int) -> None:
        base.check(self, cache_length)
        compression.check_options(self)
        if self.mode != "one-shot":
            raise ValueError(f"{name} runs one-shot only: mode must be 'one-shot', got {self.mode!r}")

    fields = [("mode", str, field(default="one-shot"))]
    fields += [(n, t, field(default=d)) for n, t, d in compression.option_fields]
    module = policy.__module__ if module is None else module
    options = make_dataclass(f"{name}Options", fields, bases=(base,), namespace={"check": check, "__module__": module})
    doc = f"{policy.__name__} run one-shot only, compressed by {compression.__name__} (`one_shot`)."
    namespace = {"Options": options, "compression": compression, "__module__": module, "__doc__": doc}
    cls = type(name, (policy,), namespace)
    cls.__annotations__ = {"Options": ClassVar[type[PolicyOptions]], "compression": ClassVar[type[OneShot]]}
    return cls


def compact_slots(cache: SlotMachine, keep: torch.Tensor) -> None:
    """Move the slots marked in `keep` `(B, G, L)` before `num_filled`, the largest kept count, in slot order
    and right-aligned: a (row, KV head) that keeps `n` tokens holds them in slots `[num_filled - n, num_filled)`,
    so that with the tokens a decode step appends at `num_filled` they are one run of slots (attended without a
    mask: `SlotMachine.head_starts`, set here). The other slots are emptied (position `-1`)."""
    length = cache.cache_length
    if cache.journal is not None:
        cache.journal(cache, torch.arange(length, device=keep.device).expand(keep.shape))
    order = torch.sort((~keep).to(torch.int8), dim=2, stable=True).indices  # kept slots first
    counts = keep.sum(dim=2)  # (B, G)
    filled = int(counts.max()) if keep.numel() else 0
    starts = filled - counts  # empty slots before each head's kept ones
    order = order.gather(2, (torch.arange(length, device=keep.device) - starts[..., None]) % length)
    kept = keep.gather(2, order)
    tensors = {}
    for name, tensor in cache.state_tensors().items():
        if name == "positions" or name.startswith(("storage.", "slot.")):
            index = order.view(*order.shape, *[1] * (tensor.dim() - 3)).expand(*order.shape, *tensor.shape[3:])
            tensor = tensor.gather(2, index)
        tensors[name] = tensor.clone()
    tensors["positions"] = tensors["positions"].masked_fill(~kept, -1)
    cache.load_state_tensors(tensors, filled)
    cache.head_starts = (starts.tolist(), starts)


def compress_all(caches: Sequence[object]) -> None:
    """Compress every one-shot cache of `caches` (one per layer) that has not compressed yet: the end of the
    prompt (what `KVCaches.end_prefill` does; `generate` calls it after the prefill). The caches whose policy
    ranks across layers (`compresses_across_layers`) are compressed together (`compress_layers` on their
    `oneshot_scores()`), the others each by its `end_prefill`. Other caches are left alone."""
    machines = [c for c in caches if isinstance(c, SlotMachine) and c.one_shot is not None]
    across = [c for c in machines if c.policy.compresses_across_layers() and not c.one_shot.compressed]
    if across:
        for cache in across:
            cache.check_idle("compress_all()")
        compress_layers(across, torch.stack([c.policy.oneshot_scores().to(torch.float32) for c in across]))
    for cache in machines:
        if not any(cache is c for c in across):
            cache.end_prefill()


def keep_across_layers(
    scores: torch.Tensor, positions: torch.Tensor, budget: int, layerwise: bool = False, n_sink: int = 0
) -> torch.Tensor:
    """`(n_layers, B, G, L)` bool: the kept slots from `scores` `(n_layers, B, G, L)` (highest kept, positions
    below `n_sink` first, slots at position `-1` never): per row the `budget x G x n_layers` best over all
    layers and heads, or with `layerwise` the `budget x G` best of each layer."""
    n, b, g, length = scores.shape
    rank = scores.to(torch.float32).masked_fill((positions >= 0) & (positions < n_sink), float("inf"))
    rank = rank.masked_fill(positions < 0, float("-inf"))
    if layerwise:
        flat = rank.reshape(n, b, g * length)
        top = torch.topk(flat, min(budget * g, g * length), dim=2).indices
        keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(2, top, True)
    else:
        flat = rank.permute(1, 0, 2, 3).reshape(b, n * g * length)
        top = torch.topk(flat, min(budget * g * n, n * g * length), dim=1).indices
        keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, top, True)
        keep = keep.view(b, n, g, length).permute(1, 0, 2, 3)
    return keep.reshape(n, b, g, length) & (positions >= 0)


def compress_layers(
    caches: Sequence[SlotMachine], scores: torch.Tensor, layerwise: bool = False, n_sink: int = 0
) -> None:
    """Compress the layers' one-shot caches together by `scores` `(n_layers, B, G, L)` (`keep_across_layers`
    with their common `budget`): the kept slots are compacted in each head (`compact_slots`)."""
    if not caches:
        raise ValueError("compress_layers needs at least one one-shot cache")
    compressions = [c.one_shot for c in caches]
    if any(one is None for one in compressions):
        raise ValueError(
            f"compress_layers: every layer needs a one-shot cache, got {[c.name for c in caches]} "
            f"(one-shot: {[one is not None for one in compressions]})"
        )
    budgets = {one.budget for one in compressions}  # type: ignore[union-attr]
    if len(budgets) != 1:
        raise ValueError(f"compress_layers: every layer needs one one-shot budget, got {sorted(budgets)}")
    positions = torch.stack([c.positions for c in caches])
    keep = keep_across_layers(scores, positions, budgets.pop(), layerwise, n_sink)
    for cache, layer_keep in zip(caches, keep, strict=True):
        compact_slots(cache, layer_keep)
        cache.one_shot.compressed = True  # type: ignore[union-attr]
