"""Policy options: each policy declares its own small dataclass, validated with clear errors.

`KVCacheConfig.options` (a mapping; `--kv_cache.<option>` on the command line, `options:` in YAML) is
turned into the policy's `Options` instance by `parse_options`; the cache gets it as `self.options`.
The checks of single values (`check_int`, `check_float`, `check_bool`) are `litkv.core.validation`'s,
handed on here for the policies' `Options.check`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from litkv.core.validation import check_bool, check_float, check_int

__all__ = [
    "MODES",
    "LastRecentOptions",
    "NoOptions",
    "PolicyOptions",
    "ScoreOptions",
    "check_bool",
    "check_float",
    "check_int",
    "check_mode",
    "parse_options",
]

MODES = ("continuous", "one-shot")


def check_mode(mode: object, budget: object, cache_length: int, protected: int) -> None:
    """Check `mode` and `budget`: `one-shot` needs `budget` in `[max(protected, 1), cache_length]`, `continuous`
    takes none (`protected`: tokens the policy never evicts, e.g. sinks + recent)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "continuous":
        if budget is not None:
            raise ValueError(f"budget is for mode='one-shot' only (continuous evicts to cache_length), got {budget}")
        return
    if budget is None:
        raise ValueError("mode='one-shot' needs budget: the tokens kept per KV head when the prompt is compressed")
    check_int("budget", budget, minimum=max(protected, 1))
    if budget > cache_length:
        raise ValueError(f"budget must be <= cache_length, got budget={budget}, cache_length={cache_length}")


@dataclass
class PolicyOptions:
    """Base of every policy's options. Fields need defaults; `check` validates against the cache size."""

    def check(self, cache_length: int) -> None:
        """Raise ValueError/TypeError naming the option if a value is not usable with `cache_length` slots."""

    def one_shot_budget(self, cache_length: int) -> int | None:
        """The tokens a one-shot compression keeps per (row, KV head), `None` when the cache does not run one
        (the layer cache composes one, `litkv.kvcache.one_shot.OneShot`, otherwise)."""
        return None


@dataclass
class NoOptions(PolicyOptions):
    """A policy without options."""


@dataclass
class LastRecentOptions(PolicyOptions):
    """Args:
    sinks: Number of initial tokens that are never evicted (StreamingLLM attention sinks).
    mode: `continuous` (evict at every call once full) or `one-shot` (keep the whole prompt, compress it
        to `budget` tokens at the end of prefill, then decode without eviction until the cache is full).
    budget: Tokens kept by the one-shot compression (one-shot only).
    """

    sinks: int = 0
    mode: str = "continuous"
    budget: int | None = None

    def check(self, cache_length: int) -> None:
        check_int("sinks", self.sinks, minimum=0)
        if self.sinks >= cache_length:
            raise ValueError(f"sinks must be < cache_length, got sinks={self.sinks}, cache_length={cache_length}")
        check_mode(self.mode, self.budget, cache_length, self.sinks)

    def one_shot_budget(self, cache_length: int) -> int | None:
        return self.budget if self.mode == "one-shot" else None


@dataclass
class ScoreOptions(PolicyOptions):
    """Options every score-based policy has.

    Args:
        sinks: Number of initial tokens that are never evicted.
        recent: Number of newest tokens that are never evicted. ``None``: the policy's default,
            `default_recent_fraction` of the cache (of `budget` in one-shot mode).
        mode: `continuous` (evict at every call once the cache is full) or `one-shot` (keep the whole
            prompt, compress it to `budget` tokens at the end of prefill, as kvpress does; afterwards
            decode without eviction until the cache is full, then evict as in `continuous`).
        budget: Tokens kept per (row, KV head) by the one-shot compression (one-shot only).
    """

    #: A new score policy keeps its newest eighth by default: a call's attention weights are sums over its
    #: queries (a prefill chunk's many, a decode step's one), so a rule other than a running sum scores a
    #: decoded token far below the prompt's and, unprotected, evicts it at once. Built-ins that choose what
    #: their reference implementation chooses set their own (0 for knorm, tova, learned, kvzip: as kvpress).
    default_recent_fraction: ClassVar[float] = 0.125

    sinks: int = 0
    recent: int | None = None
    mode: str = "continuous"
    budget: int | None = None

    def one_shot_budget(self, cache_length: int) -> int | None:
        return self.budget if self.mode == "one-shot" else None

    def protected_sinks(self) -> int:
        """Tokens never evicted at the start of a sequence (`sinks`)."""
        return self.sinks

    def recent_length(self, cache_length: int) -> int:
        """The recent window actually used with `cache_length` slots (`budget` slots in one-shot mode)."""
        if self.recent is not None:
            return self.recent
        size = self.budget if self.mode == "one-shot" and isinstance(self.budget, int) else cache_length
        return int(size * self.default_recent_fraction)

    def check(self, cache_length: int) -> None:
        check_int("sinks", self.sinks, minimum=0)
        if self.recent is not None:
            check_int("recent", self.recent, minimum=0)
        check_mode(self.mode, self.budget, cache_length, 0)  # the budget first: the default recent follows it
        if self.sinks + self.recent_length(cache_length) > cache_length:
            raise ValueError(
                f"sinks + recent must be <= cache_length, got sinks={self.sinks}, "
                f"recent={self.recent_length(cache_length)}, cache_length={cache_length}"
            )
        check_mode(self.mode, self.budget, cache_length, self.sinks + self.recent_length(cache_length))


def parse_options(
    options_class: type[PolicyOptions], values: Mapping[str, object], policy: str, cache_length: int
) -> PolicyOptions:
    """Build and check `options_class` from `values`; unknown names are a ValueError listing the known ones."""
    if not isinstance(values, Mapping):
        raise TypeError(f"options must be a mapping of option names to values, got {type(values).__name__}")
    known = [f.name for f in dataclasses.fields(options_class)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        listed = ", ".join(known) if known else "none"
        raise ValueError(f"policy {policy!r} has no option {', '.join(map(repr, unknown))}; its options: {listed}")
    options = options_class(**values)
    options.check(cache_length)
    return options
