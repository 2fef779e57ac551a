"""How the next token is picked: one `Sampling` value (options, checked once) and the draw (`sample`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from litkv.core.validation import is_int, is_number, require_int

__all__ = ["TEMPERATURE_FLOOR", "Sampling", "check_sampling", "sample"]

TEMPERATURE_FLOOR = 1e-6
"""Below it a temperature samples greedily: float32 logits then only break ties within their own
rounding, and a temperature that underflows in float32 (1e-300, 5e-324) would divide by zero."""


@dataclass(frozen=True)
class Sampling:
    """How `litkv.generate` picks each new token (the default: greedy, no stop token).

    Args:
        temperature: 0 (or below `TEMPERATURE_FLOOR`): greedy; else the softmax temperature.
        top_k: sample among the k most likely tokens only (None: all).
        top_p: nucleus threshold in (0, 1] (None: no nucleus).
        stop_tokens: a row stops after producing one of these (it is included in the output).
        generator: the random generator of the draws (advanced by them), or None ...
        seed: ... or a seed: each `generate` call draws from a new generator seeded with it, on the
            model's device (so one `Sampling` gives the same tokens at every call). Not both.

    TypeError/ValueError naming the value for a NaN/inf/negative temperature, a bad top_k, top_p, stop
    token or seed.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_tokens: tuple[int, ...] = ()
    generator: torch.Generator | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_options(self.temperature, self.top_k, self.top_p)
        if isinstance(self.stop_tokens, (str, bytes, torch.Tensor)) or not isinstance(self.stop_tokens, Sequence):
            raise TypeError(f"stop_tokens must be a sequence of token ids, got {type(self.stop_tokens).__name__}")
        for token in self.stop_tokens:
            require_int("a stop token", token, 0, 2**63 - 1)  # token ids are int64
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(self.generator).__name__}")
        if self.seed is not None:
            require_int("seed", self.seed, -(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
            if self.generator is not None:
                raise ValueError("give Sampling a generator or a seed, not both")

    @property
    def greedy(self) -> bool:
        """Whether the pick is the argmax (temperature below `TEMPERATURE_FLOOR`)."""
        return self.temperature < TEMPERATURE_FLOOR

    def picker(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """`(B, V)` logits -> `(B,)` tokens, drawing from `generator` or from a new one seeded with `seed`
        on `device` (one picker per generation)."""
        generator = self.generator
        if self.seed is not None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
        return lambda logits: sample(logits, self.temperature, self.top_k, self.top_p, generator)


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next tokens `(B,)` from `(B, V)` logits: greedy at a temperature below `TEMPERATURE_FLOOR` (0
    included), else top-k/top-p sampling in float32 with the row's largest logit shifted to 0 before the
    division (so a huge temperature or a tiny top-p never makes a NaN; the nucleus keeps at least the top
    token). A NaN logit is never drawn; a row with no finite logit falls back to its argmax."""
    _check_options(temperature, top_k, top_p)
    if temperature < TEMPERATURE_FLOOR:
        return logits.argmax(dim=-1)
    x = logits.float().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))
    top = x.amax(dim=-1, keepdim=True)
    finite = torch.isfinite(top)
    if top_k is not None:  # on the logits: a huge temperature makes ties of every scaled logit
        kth = torch.topk(x, min(top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    x = ((x - torch.where(finite, top, 0.0)) / temperature).nan_to_num(nan=float("-inf"))  # <= 0, no NaN
    if top_p is not None and top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        remove_sorted = (p.cumsum(dim=-1) - p) >= top_p
        remove_sorted[..., 0] = False  # a top_p that rounds to 0 in float32 still keeps the top token
        x = x.masked_fill(torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted), float("-inf"))
    # Exponential race (Gumbel-max in another form): argmax of p / E with E ~ Exp(1) draws from p, with
    # device ops only (torch.multinomial reads the host), so a sampling decode step never syncs.
    probs = torch.softmax(x, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    drawn = (probs / race).argmax(dim=-1)
    first_not_nan = (~logits.isnan()).float().argmax(dim=-1)  # no finite logit: all -inf tie, the first one
    return torch.where(finite.squeeze(-1), drawn, first_not_nan)


def _check_options(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError/TypeError naming the value for a NaN/inf/negative temperature, bad top_k or top_p."""
    if not is_number(temperature):
        raise TypeError(f"temperature must be a float >= 0, got {type(temperature).__name__} {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite float >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None:
        if not is_int(top_k):
            raise TypeError(f"top_k must be an int >= 1 or None, got {type(top_k).__name__} {top_k!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None:
        if not is_number(top_p):
            raise TypeError(f"top_p must be a float in (0, 1] or None, got {type(top_p).__name__} {top_p!r}")
        if not 0.0 < top_p <= 1.0:  # also refuses NaN
            raise ValueError(f"top_p must be a float in (0, 1] or None, got {top_p!r}")


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """The checks of `max_new_tokens` and `Sampling`'s options, for commands that make them before loading
    a model."""
    require_int("max_new_tokens", max_new_tokens, 0)
    _check_options(temperature, top_k, top_p)
