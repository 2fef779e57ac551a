"""The memory-bandwidth bound of decoding: bytes a decode step must read, and how fast this machine reads.

A decode step of a memory-bound model reads every weight once and every cached key and value once,
so `bandwidth / bytes_per_step` is an upper bound on decode steps per second (`batch` tokens each).
The benchmarks (`litkv bench`, `scripts/bench_policies.py`) print each row's bound and the fraction
of it reached, with the bandwidth measured in the same run and the same thread count.
"""

from __future__ import annotations

import time

import torch

from litkv.core.validation import require_int

__all__ = [
    "bound_tokens_per_s",
    "bytes_per_step",
    "kv_bytes_per_token",
    "measure_bandwidth",
    "weight_bytes",
]


def _positive_int(name: str, value: object) -> int:
    return require_int(name, value, 1)


def measure_bandwidth(nbytes: int = 2**30, repeats: int = 5, threads: int | None = None) -> float:
    """Memory read bandwidth in bytes/s: the best of `repeats` timed `sum`s of an `nbytes` float32 tensor.

    Args:
        nbytes: size of the tensor read (default 1 GiB; far larger than any CPU cache).
        repeats: timed reads after one untimed warm-up; the fastest counts.
        threads: torch threads during the measurement (restored afterwards); default: the current setting.
    """
    _positive_int("nbytes", nbytes)
    _positive_int("repeats", repeats)
    if threads is not None:
        _positive_int("threads", threads)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        data = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        float(data.sum())  # warm-up: pages touched, kernels loaded
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            float(data.sum())  # the float() waits for the result
            best = min(best, time.perf_counter() - start)
        return data.nbytes / best
    finally:
        torch.set_num_threads(before)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters, a shared parameter once (tied embedding and LM head: once)."""
    return sum(p.nbytes for p in module.parameters())  # parameters() yields a shared one once


def kv_bytes_per_token(n_layer: int, n_kv_heads: int, head_size: int, element_size: int) -> int:
    """Bytes of one token's keys and values over all layers and KV heads (float storage)."""
    for name, value in (("n_layer", n_layer), ("n_kv_heads", n_kv_heads), ("head_size", head_size)):
        _positive_int(name, value)
    _positive_int("element_size", element_size)
    return 2 * n_layer * n_kv_heads * head_size * element_size


def bytes_per_step(weights: int, kv_per_token: float, cached_tokens: float, batch: int = 1) -> float:
    """Bytes one decode step reads: the weights once, plus every row's cached keys and values.

    Args:
        weights: bytes of the weights (`weight_bytes`).
        kv_per_token: bytes of one cached token over all layers (`kv_bytes_per_token`, or a quantised
            cache's bytes per slot).
        cached_tokens: tokens each row attends to at that step.
        batch: rows decoded together.
    """
    if weights < 0 or kv_per_token < 0 or cached_tokens < 0:
        raise ValueError(
            f"weights, kv_per_token and cached_tokens must be >= 0, got {weights!r}, {kv_per_token!r}, "
            f"{cached_tokens!r}"
        )
    _positive_int("batch", batch)
    return weights + batch * kv_per_token * cached_tokens


def bound_tokens_per_s(bandwidth: float, step_bytes: float, batch: int = 1) -> float:
    """Tokens/s if a decode step took only the time to read `step_bytes` at `bandwidth` bytes/s."""
    if not bandwidth > 0 or not step_bytes > 0:
        raise ValueError(f"bandwidth and step_bytes must be > 0, got {bandwidth!r} and {step_bytes!r}")
    _positive_int("batch", batch)
    return batch * bandwidth / step_bytes
