"""Quality of KV cache policies against a dense cache, on the same model and text.

For each (policy, cache budget): perplexity of the text, mean KL(dense || policy) per predicted
token, top-1 agreement with dense (all from `forward_chunked` logits), and accuracy on the pass-key
recall task (`litkv.recall`) at several needle depths, decided by greedy `generate`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from litkv.config import KVCacheConfig
from litkv.generate import forward_chunked, generate
from litkv.model import GPT, check_integer_tensor
from litkv.recall import RecallExample

__all__ = [
    "DENSE",
    "PolicyResult",
    "cache_config",
    "evaluate_policies",
    "recall_accuracy",
    "text_windows",
]

DENSE = "dense"


@dataclass
class PolicyResult:
    """Metrics of one (policy, budget). `cache_length` is the window length for the dense reference."""

    policy: str
    cache_length: int
    perplexity: float = math.nan
    kl: float = math.nan
    top1: float = math.nan
    recall: dict[float, float] = field(default_factory=dict)
    cache_bytes: int = 0

    @property
    def recall_mean(self) -> float:
        return sum(self.recall.values()) / len(self.recall) if self.recall else math.nan

    def to_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["recall"] = {f"{depth:g}": acc for depth, acc in self.recall.items()}
        out["recall_mean"] = self.recall_mean
        return out


def cache_config(template: KVCacheConfig, policy: str, cache_length: int) -> KVCacheConfig:
    """`template` with `policy` and `cache_length` (chunk sizes clipped to it; qh2o on int4 by default)."""
    _check_template(template)
    storage = "int4" if policy == "qh2o" and template.storage == "float" else template.storage
    prefill = template.prefill_length
    return dataclasses.replace(
        template,
        policy=policy,
        cache_length=cache_length,
        chunk_size=min(template.chunk_length, cache_length),
        prefill_length=None if prefill is None else min(prefill, cache_length),
        storage=storage,
    )


def _check_template(template: object) -> None:
    if not isinstance(template, KVCacheConfig):
        raise TypeError(
            "the kv_cache template must be a KVCacheConfig (policy and cache_length are set per run), "
            f"got {type(template).__name__} {template!r:.80}"
        )


def _check_batch_size(batch_size: object) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")


def text_windows(ids: torch.Tensor, length: int, num_windows: int) -> torch.Tensor:
    """`num_windows` non-overlapping windows of `length + 1` tokens spread evenly over `ids` `(N,)`.

    Returns:
        `(num_windows, length + 1)` int64: inputs are `[:, :-1]`, targets `[:, 1:]`.
    """
    check_integer_tensor("ids", ids)
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if num_windows < 1 or length < 1:
        raise ValueError(f"num_windows and length must be >= 1, got {num_windows} and {length}")
    n = ids.numel()
    if n < num_windows * (length + 1):
        raise ValueError(
            f"the text has {n} tokens, fewer than {num_windows} windows of {length + 1} tokens: "
            "use a longer text, fewer windows or a shorter window"
        )
    stride = (n - (length + 1)) // max(num_windows - 1, 1)
    return torch.stack([ids[i * stride : i * stride + length + 1] for i in range(num_windows)]).long()


@dataclass
class _Sums:
    nll: float = 0.0
    kl: float = 0.0
    agree: float = 0.0
    count: int = 0

    def add(self, logits: torch.Tensor, ref_logp: torch.Tensor, targets: torch.Tensor) -> None:
        """`logits`, `ref_logp`: `(B, T, V)`; `targets`: `(B, T)`."""
        logp = F.log_softmax(logits.float(), dim=-1)
        self.nll += float(F.nll_loss(logp.flatten(0, 1), targets.flatten(), reduction="sum"))
        self.kl += float(F.kl_div(logp, ref_logp, log_target=True, reduction="sum"))
        self.agree += float((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
        self.count += targets.numel()


def _quality(
    model: GPT, windows: torch.Tensor, configs: dict[tuple[str, int], KVCacheConfig], batch_size: int, bar: tqdm
) -> dict[tuple[str, int], _Sums]:
    """Perplexity/KL/top-1 sums for each config; the dense reference is computed once per batch."""
    device = model.lm_head.weight.device
    sums = {key: _Sums() for key in configs}
    length = windows.shape[1] - 1
    dense = cache_config(next(iter(configs.values())), DENSE, length)
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        ref_logp = F.log_softmax(forward_chunked(model, inputs, dense).float(), dim=-1)
        for key, cfg in configs.items():
            logits = ref_logp if key[0] == DENSE and key[1] >= length else forward_chunked(model, inputs, cfg)
            sums[key].add(logits, ref_logp, targets)
            bar.update(1)
    return sums


def recall_accuracy(
    model: GPT, examples: Sequence[RecallExample], kv_cache: KVCacheConfig, batch_size: int = 8
) -> dict[float, float]:
    """Share of examples whose answer greedy decoding reproduces exactly, per needle depth."""
    _check_batch_size(batch_size)
    device = model.lm_head.weight.device
    hits: dict[float, list[bool]] = {}
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        prompts = [torch.tensor(ex.prompt, dtype=torch.long, device=device) for ex in batch]
        new = max(len(ex.answer) for ex in batch)
        outputs = generate(model, prompts, new, kv_cache, temperature=0.0)
        for ex, out in zip(batch, outputs, strict=True):
            hits.setdefault(ex.depth, []).append(out[: len(ex.answer)].tolist() == ex.answer)
    return {depth: sum(h) / len(h) for depth, h in hits.items()}


@torch.inference_mode()
def evaluate_policies(
    model: GPT,
    windows: torch.Tensor,
    policies: Sequence[str],
    budgets: Sequence[int],
    examples: Sequence[RecallExample] = (),
    template: KVCacheConfig | None = None,
    batch_size: int = 4,
    progress: bool = False,
) -> list[PolicyResult]:
    """Evaluate every (policy, budget) against the dense reference.

    Args:
        model: the GPT (eval mode).
        windows: `(N, W + 1)` token windows (`text_windows`): quality on predicting tokens 1..W.
        policies: policy names; ``"dense"`` adds the reference row (cache as long as the window).
        budgets: cache lengths (slots per row, KV head and layer).
        examples: recall examples (all of one length); none: recall is not measured.
        template: other cache settings (chunk size, sinks, storage, ...); default `KVCacheConfig()`.
        batch_size: rows per forward.
        progress: show a progress bar.

    Returns:
        The dense reference first (always), then one result per (policy, budget) in order.
    """
    template = KVCacheConfig() if template is None else template
    _check_template(template)
    _check_batch_size(batch_size)
    check_integer_tensor("windows", windows)
    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"windows must have shape (N >= 1, W + 1 >= 2), got {tuple(windows.shape)}")
    if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets):
        raise ValueError(f"budgets must be a non-empty list of ints >= 1, got {list(budgets)}")
    if not policies:
        raise ValueError("policies must be a non-empty list of policy names")
    length = windows.shape[1] - 1
    configs = {(DENSE, length): cache_config(template, DENSE, length)}
    for policy in policies:
        if policy != DENSE:
            configs.update({(policy, b): cache_config(template, policy, b) for b in budgets})
    n_batches = math.ceil(windows.shape[0] / batch_size)
    with tqdm(total=n_batches * len(configs) + len(configs), desc="evaluate", disable=not progress) as bar:
        sums = _quality(model, windows, configs, batch_size, bar)
        results = []
        for key, cfg in configs.items():
            s = sums[key]
            kl = max(s.kl / s.count, 0.0)  # >= 0 up to rounding
            res = PolicyResult(key[0], key[1], math.exp(s.nll / s.count), kl, s.agree / s.count)
            res.cache_bytes = _cache_bytes(model, cfg)
            if examples:
                recall_cfg = cfg
                if key[0] == DENSE:
                    needed = max(len(ex.ids) for ex in examples)
                    recall_cfg = cache_config(template, DENSE, max(needed, length))
                res.recall = recall_accuracy(model, examples, recall_cfg, batch_size)
            results.append(res)
            bar.update(1)
    return results


def _cache_bytes(model: GPT, kv_cache: KVCacheConfig) -> int:
    """Bytes of keys and values held by one row's caches over all layers."""
    with torch.inference_mode():
        return sum(cache.nbytes() for cache in model.build_kv_caches(kv_cache, batch_size=1))
