"""Quality of KV cache policies against a dense cache, on the same model and text.

For each (policy, cache budget): perplexity of the text, mean KL(dense || policy) per predicted
token, top-1 agreement with dense (all from `forward_chunked` logits), and accuracy on the pass-key
recall task (`litkv.eval.recall`) at several needle depths, decided by greedy `generate`; optionally the
multi-key recall task (one of several needles asked) and the decode speed (tokens/s of the decode
steps of a short greedy generation after the first window, prefill excluded).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from litkv.eval.answers import AnswerStore, RulerPlan, ruler_scores
from litkv.eval.oneshot import KVZIP, check_compress, is_one_shot
from litkv.eval.parallel import answer_units
from litkv.eval.recall import RecallExample
from litkv.eval.ruler import METRICS as RULER_METRICS
from litkv.eval.ruler import TASKS as RULER_TASKS
from litkv.eval.ruler import RulerSample
from litkv.inference.generate import forward_chunked, generate
from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.model import GPT, check_integer_tensor

if TYPE_CHECKING:
    from lightning.fabric import Fabric

__all__ = [
    "DENSE",
    "PolicyResult",
    "RulerResult",
    "cache_config",
    "decode_speed",
    "evaluate_policies",
    "evaluate_ruler",
    "plan_ruler",
    "recall_accuracy",
    "ruler_score",
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
    multikey: float = math.nan
    decode_tps: float = math.nan

    @property
    def recall_mean(self) -> float:
        return sum(self.recall.values()) / len(self.recall) if self.recall else math.nan

    def to_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["recall"] = {f"{depth:g}": acc for depth, acc in self.recall.items()}
        out["recall_mean"] = self.recall_mean
        return out


def cache_config(
    template: KVCacheConfig, policy: str, cache_length: int, options: dict[str, Any] | None = None
) -> KVCacheConfig:
    """`template` with `policy`, `cache_length` and the policy's `options` (chunk sizes clipped to it).

    The template's storage is passed through as is (qh2o switches float storage to int4 itself).
    """
    _check_template(template)
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options of policy {policy!r} must be a dict, got {type(options).__name__} {options!r:.80}")
    prefill = template.prefill_length
    return dataclasses.replace(
        template,
        policy=policy,
        cache_length=cache_length,
        chunk_size=min(template.chunk_length, cache_length),
        prefill_length=None if prefill is None else min(prefill, cache_length),
        options=dict(options or {}),
    )


def _check_template(template: object) -> None:
    if not isinstance(template, KVCacheConfig):
        raise TypeError(
            "the kv_cache template must be a KVCacheConfig (policy and cache_length are set per run), "
            f"got {type(template).__name__} {template!r:.80}"
        )
    if template.options:
        raise ValueError(
            "the kv_cache template must not hold policy options (it is shared by all policies), got "
            f"options={template.options!r}; pass them per policy instead, e.g. "
            '--policy_options \'{"keydiff": {"recent": 64}}\' or --policy_options.keydiff.recent 64'
        )


def _check_policy_options(policy_options: object, policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`policy_options` as a dict of dicts whose keys are among `policies`."""
    if policy_options is None:
        return {}
    if not isinstance(policy_options, dict) or not all(isinstance(v, dict) for v in policy_options.values()):
        raise TypeError(
            'policy_options must map policy names to dicts of options, e.g. {"keydiff": {"recent": 64}}, '
            f"got {policy_options!r:.120}"
        )
    unknown = [name for name in policy_options if name not in policies]
    if unknown:
        raise ValueError(f"policy_options names policies {unknown} that are not evaluated; policies: {list(policies)}")
    return policy_options


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
    dense = configs[(DENSE, length)]  # the reference: a dense cache as long as the window
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
        outputs = generate(model, prompts, new, kv_cache)
        for ex, out in zip(batch, outputs, strict=True):
            hits.setdefault(ex.depth, []).append(out[: len(ex.answer)].tolist() == ex.answer)
    return {depth: sum(h) / len(h) for depth, h in hits.items()}


def decode_speed(
    model: GPT, prompt: torch.Tensor, kv_cache: KVCacheConfig, new_tokens: int = 32, repeats: int = 3
) -> float:
    """Tokens per second of the decode steps of a greedy generation after `prompt` `(T,)` (one row).

    Wall-clock (`time.perf_counter`) from the first new token, picked from the prefill's logits, to the
    last: `new_tokens - 1` decode steps; the prefill is excluded. No stop tokens, so every step runs.
    The fastest of `repeats` generations counts (the least disturbed by other work on the machine).
    """
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an int >= 2 (one step after the prefill's token), got {new_tokens!r}")
    times: list[float] = []

    def stamp(tokens: torch.Tensor) -> None:
        if tokens.device.type == "cuda":
            torch.cuda.synchronize(tokens.device)
        times.append(time.perf_counter())

    best = math.inf
    for _ in range(max(repeats, 1)):
        times.clear()
        generate(model, [prompt], new_tokens, kv_cache, on_tokens=stamp)
        best = min(best, times[-1] - times[0])
    return (new_tokens - 1) / max(best, 1e-9)


def _check_inputs(windows: torch.Tensor, policies: Sequence[str], budgets: Sequence[int], decode_tokens: int) -> None:
    check_integer_tensor("windows", windows)
    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"windows must have shape (N >= 1, W + 1 >= 2), got {tuple(windows.shape)}")
    if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets):
        raise ValueError(f"budgets must be a non-empty list of ints >= 1, got {list(budgets)}")
    if not policies:
        raise ValueError("policies must be a non-empty list of policy names")
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or decode_tokens == 1 or decode_tokens < 0:
        raise ValueError(f"decode_tokens must be 0 (no timing) or an int >= 2, got {decode_tokens!r}")


def _configs(
    template: KVCacheConfig,
    policies: Sequence[str],
    budgets: Sequence[int],
    length: int,
    policy_options: dict[str, dict[str, Any]],
) -> dict[tuple[str, int], KVCacheConfig]:
    """The dense reference (cache as long as the window), then each (policy, budget) with its options."""
    configs = {(DENSE, length): cache_config(template, DENSE, length, policy_options.get(DENSE))}
    for policy in policies:
        if policy != DENSE:
            opts = policy_options.get(policy)
            configs.update({(policy, b): cache_config(template, policy, b, opts) for b in budgets})
    return configs


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
    policy_options: dict[str, dict[str, Any]] | None = None,
    multikey_examples: Sequence[RecallExample] = (),
    decode_tokens: int = 0,
) -> list[PolicyResult]:
    """Evaluate every (policy, budget) against the dense reference.

    Args:
        model: the GPT (eval mode).
        windows: `(N, W + 1)` token windows (`text_windows`): quality on predicting tokens 1..W.
        policies: policy names; ``"dense"`` adds the reference row (cache as long as the window).
        budgets: cache lengths (slots per row, KV head and layer).
        examples: pass-key recall examples (all of one length); none: recall is not measured.
        template: other cache settings (chunk size, storage, ...) shared by all policies, without
            policy options; default `KVCacheConfig()`.
        batch_size: rows per forward.
        progress: show a progress bar.
        policy_options: per policy name, its options (e.g. ``{"keydiff": {"recent": 64}}``), applied to
            that policy's configs only.
        multikey_examples: multi-key recall examples (`RecallTask.multikey_examples`); none: skipped.
        decode_tokens: tokens of the timed greedy generation after the first window (0: no timing).

    Returns:
        The dense reference first (always), then one result per (policy, budget) in order.
    """
    template = KVCacheConfig() if template is None else template
    _check_template(template)
    _check_batch_size(batch_size)
    _check_inputs(windows, policies, budgets, decode_tokens)
    options = _check_policy_options(policy_options, list(dict.fromkeys([DENSE, *policies])))
    if KVZIP in policies:
        raise ValueError(
            "kvzip compresses a prompt once after a reconstruction pass: evaluate it on RULER tasks "
            "(litkv evaluate --tasks ...); here every policy evicts continuously"
        )
    length = windows.shape[1] - 1
    configs = _configs(template, policies, budgets, length, options)
    n_batches = math.ceil(windows.shape[0] / batch_size)
    with tqdm(total=n_batches * len(configs) + len(configs), desc="evaluate", disable=not progress) as bar:
        sums = _quality(model, windows, configs, batch_size, bar)
        results = []
        for key, cfg in configs.items():
            s = sums[key]
            kl = max(s.kl / s.count, 0.0)  # >= 0 up to rounding
            res = PolicyResult(key[0], key[1], math.exp(s.nll / s.count), kl, s.agree / s.count)
            res.cache_bytes = _cache_bytes(model, cfg)
            long_cfg = cfg
            if key[0] == DENSE:  # room for the longest example
                needed = max((len(ex.ids) for ex in [*examples, *multikey_examples]), default=0)
                long_cfg = cache_config(template, DENSE, max(needed, length), options.get(DENSE))
            if examples:
                res.recall = recall_accuracy(model, examples, long_cfg, batch_size)
            if multikey_examples:
                res.multikey = _mean(recall_accuracy(model, multikey_examples, long_cfg, batch_size), multikey_examples)
            if decode_tokens:
                prompt = windows[0, : max(length - decode_tokens, 1)].to(model.lm_head.weight.device)
                res.decode_tps = decode_speed(model, prompt, long_cfg, decode_tokens)
            results.append(res)
            bar.update(1)
    return results


def _mean(per_depth: dict[float, float], examples: Sequence[RecallExample]) -> float:
    """Share correct over all `examples` from per-depth shares (weighted by the examples per depth)."""
    counts: dict[float, int] = {}
    for ex in examples:
        counts[ex.depth] = counts.get(ex.depth, 0) + 1
    return sum(per_depth[d] * n for d, n in counts.items()) / len(examples)


def _cache_bytes(model: GPT, kv_cache: KVCacheConfig) -> int:
    """Bytes of keys and values held by one row's caches over all layers."""
    with torch.inference_mode():
        return sum(cache.nbytes() for cache in model.build_kv_caches(kv_cache, batch_size=1))


@dataclass
class RulerResult:
    """RULER scores (string match, in [0, 1]) of one (policy, budget), per task."""

    policy: str
    cache_length: int
    scores: dict[str, float] = field(default_factory=dict)

    @property
    def mean(self) -> float:
        return sum(self.scores.values()) / len(self.scores) if self.scores else math.nan

    def to_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "cache_length": self.cache_length, "scores": self.scores, "mean": self.mean}


def ruler_score(
    model: GPT,
    tokenizer: Any,
    samples: Sequence[RulerSample],
    kv_cache: KVCacheConfig,
    batch_size: int = 8,
    on_batch: Callable[[], None] | None = None,
) -> float:
    """RULER's score of greedy answers (`generate` through `kv_cache`) to `samples` of one task
    (`on_batch`: called after each batch, for a progress bar)."""
    _check_batch_size(batch_size)
    if not samples:
        raise ValueError("ruler_score needs at least one sample")
    device = model.lm_head.weight.device
    predictions: list[str] = []
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        prompts = [torch.tensor(s.ids, dtype=torch.long, device=device) for s in batch]
        outputs = generate(model, prompts, max(s.max_new_tokens for s in batch), kv_cache)
        predictions += [tokenizer.decode(out[: s.max_new_tokens].cpu()) for s, out in zip(batch, outputs, strict=True)]
        if on_batch is not None:
            on_batch()
    metric = RULER_METRICS[RULER_TASKS[samples[0].task].metric]
    return metric(predictions, [s.references for s in samples])


def plan_ruler(
    samples: dict[str, list[RulerSample]],
    policies: Sequence[str],
    budgets: Sequence[int],
    template: KVCacheConfig | None = None,
    batch_size: int = 4,
    policy_options: dict[str, dict[str, Any]] | None = None,
    length: int = 0,
    repeat: RepeatPrompt | None = None,
    oneshot_compress: str = "context",
) -> tuple[RulerPlan, list[tuple[str, int]]]:
    """The units' plan of `evaluate_ruler` (arguments as there) and the rows of its table, in order."""
    template = KVCacheConfig() if template is None else template
    _check_template(template)
    _check_batch_size(batch_size)
    if not samples or any(not v for v in samples.values()):
        raise ValueError(f"samples must map task names to non-empty lists, got {list(samples)}")
    if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets):
        raise ValueError(f"budgets must be a non-empty list of ints >= 1, got {list(budgets)}")
    options = _check_policy_options(policy_options, list(dict.fromkeys([DENSE, *policies])))
    context_only = check_compress(oneshot_compress) == "context"
    longest = max(length, *(len(s.ids) + s.max_new_tokens for task in samples.values() for s in task))
    one_shot = [p for p in dict.fromkeys(policies) if p != DENSE and is_one_shot(p, options.get(p))]
    configs = _configs(template, [p for p in policies if p not in one_shot], budgets, longest, options)
    per_policy = {}
    for policy in one_shot:
        opts = {**options.get(policy, {}), "mode": "one-shot"}
        per_policy[policy] = {b: cache_config(template, policy, longest, {**opts, "budget": b}) for b in budgets}
    plan = RulerPlan(samples, configs, per_policy, batch_size, repeat, context_only)
    order = [(DENSE, longest)] + [(p, b) for p in policies if p != DENSE for b in budgets]
    return plan, list(dict.fromkeys(order))


@torch.inference_mode()
def evaluate_ruler(
    model: GPT,
    tokenizer: Any,
    samples: dict[str, list[RulerSample]],
    policies: Sequence[str],
    budgets: Sequence[int],
    template: KVCacheConfig | None = None,
    batch_size: int = 4,
    progress: bool = False,
    policy_options: dict[str, dict[str, Any]] | None = None,
    length: int = 0,
    repeat: RepeatPrompt | None = None,
    oneshot_compress: str = "context",
    store: AnswerStore | None = None,
    fabric: Fabric | None = None,
) -> list[RulerResult]:
    """RULER scores of dense (cache as long as `length` or the longest sample) and of every (policy, budget).

    A one-shot policy (`is_one_shot`: `mode: one-shot` in its options, or `kvzip`) runs with `budget` as its
    one-shot budget and a cache as long as dense's; each batch of samples is prefilled once per policy and
    compressed per budget (`litkv.eval.oneshot`): the samples' contexts, each question fed after it
    uncompressed (`oneshot_compress="context"`, as kvpress), or the whole prompts (`"prompt"`). Continuous
    policies run the whole prompt through their cache. `repeat`: kvzip's reconstruction prompt.

    The work is cut into units of `batch_size` samples (`litkv.eval.answers`): with `store`, each unit's
    answers are written as they come and those already there are read, not recomputed; with `fabric`
    (launched), the units are shared by its processes (`litkv.eval.parallel`) and every process returns
    the whole table.

    Returns:
        The dense reference first (always), then one result per (policy, budget) in order.
    """
    plan, order = plan_ruler(
        samples, policies, budgets, template, batch_size, policy_options, length, repeat, oneshot_compress
    )
    units = plan.units()
    answers, _ = answer_units(model, plan, units, store, fabric, progress)
    scores = ruler_scores(plan, units, answers, lambda ids: tokenizer.decode(torch.tensor(ids, dtype=torch.long)))
    return [RulerResult(p, b, scores[(p, b)]) for p, b in order]
