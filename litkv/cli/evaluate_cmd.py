"""`litkv evaluate`: compare KV cache policies against dense; print a table, write JSON and a PNG plot."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from litkv.checkpoints.checkpoint import check_checkpoint_dir, load_tokenizer
from litkv.checkpoints.runtime import load_for_inference
from litkv.cli.common import close_fabric, launching_rank, resolve_checkpoint_dir
from litkv.core.atomic import check_output_dir, save_dir_atomic, write_atomic, write_text_atomic
from litkv.core.tokens import encode_plain
from litkv.core.validation import require_file, require_int
from litkv.eval.evaluate import DENSE, PolicyResult, RulerResult, evaluate_policies, text_windows
from litkv.eval.oneshot import KVZIP, check_compress
from litkv.eval.recall import RECALL_FILE, RecallTask
from litkv.eval.ruler import resolve_tasks
from litkv.eval.ruler_report import run_ruler
from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.registry import known_policies

if TYPE_CHECKING:
    from lightning.fabric import Fabric

__all__ = ["evaluate", "format_table", "plot_results"]

#: This command, read by litkv/__main__.py from the source (never imported for it): `CommandSpec`.
COMMAND = {
    "name": "evaluate",
    "function": "evaluate",
    "checkpoint_positional": True,
    "refused": {  # evaluate compares several policies: a policy option goes to one of them
        "--kv_cache.options": "evaluate compares several policies, so a policy option goes to one of them: use "
        "--policy_options.POLICY.{option} VALUE (e.g. --policy_options.keydiff.{option}), got {token}"
    },
}

DEFAULT_POLICIES = ("last-recent", "h2o", "qh2o")
DEFAULT_BUDGETS = (64, 128, 256, 512)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
ALL = "all"
_DEFAULT_KV_CACHE = KVCacheConfig(chunk_size=64)  # never mutated; policy and cache_length are set per run


def evaluate(
    checkpoint_dir: Path | None = None,
    text_file: Path | None = None,
    policies: list[str] | str | None = None,
    budgets: list[int] | None = None,
    window: int | None = None,
    num_windows: int = 4,
    recall_depths: list[float] | None = None,
    recall_cases: int = 10,
    multikey_cases: int = 10,
    multikey_keys: int = 4,
    decode_tokens: int = 32,
    kv_cache: KVCacheConfig = _DEFAULT_KV_CACHE,
    policy_options: dict[str, Any] | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    out_dir: Path = Path("out/evaluate"),
    precision: str | None = None,
    device: str | None = None,
    num_threads: int | None = None,
    tasks: str | None = None,
    task_samples: int = 8,
    quantize: str = "none",
    chat_template: bool | None = None,
    oneshot_compress: str = "context",
    overwrite: bool = False,
    devices: int = 1,
    num_nodes: int = 1,
    resume: bool = False,
) -> list[PolicyResult] | list[RulerResult]:
    """Quality of KV cache policies against a dense cache on the same model and text.

    Per (policy, budget): perplexity, mean KL(dense || policy) per token, top-1 agreement with dense,
    pass-key recall accuracy at several needle depths (when the checkpoint has recall_format.json),
    optionally multi-key recall, and decode tokens/s (wall-clock).

    Args:
        checkpoint_dir: Checkpoint directory. Default: the model shipped with litkv.
        text_file: Text to score (with --tasks: the word list of the RULER haystacks). Default: the
            checkpoint's heldout.txt; RULER tasks whose haystack needs no text (niah_single_1, fwe) run
            without one.
        policies: Policies to compare (default: last-recent, h2o, qh2o; "all": every registered
            policy); dense is always the reference.
        budgets: Cache lengths to try (default: 64, 128, 256, 512).
        window: Tokens per scored window. Default: the recall task's context length, else the model's.
        num_windows: Number of windows, spread evenly over the text.
        recall_depths: Needle depths in [0, 1] (default: 0, 0.25, 0.5, 0.75, 1).
        recall_cases: Recall examples per depth (0: skip the recall task).
        multikey_cases: Multi-key recall examples (several needles, one asked; 0: skip). The shipped
            model was trained on single pass-keys only: dense's figure is the ceiling.
        multikey_keys: Needles per multi-key example.
        decode_tokens: Tokens of the timed greedy generation per (policy, budget) (0: no timing);
            tokens/s counts the decode steps only, not the prefill.
        kv_cache: Cache settings shared by all policies (chunk_size, prefill_length, storage, ...);
            policy and cache_length are set per run; no policy options here (see policy_options).
        policy_options: Options per policy, applied to that policy's runs only, e.g.
            '{"keydiff": {"recent": 64}}' or --policy_options.keydiff.recent 64.
        batch_size: Sequences per forward (default 4; with --tasks: --task_samples, one batch per task). With
            --tasks a batch of samples is the unit of work that processes share and that a run resumes by.
        seed: Seed of the recall examples.
        out_dir: Where to write evaluate.json and evaluate.png (or ruler.json and ruler.png): a new or
            empty directory, or (with --overwrite) one an earlier `litkv evaluate` wrote; checked before the
            run, written whole at its end.
        precision: "32-true", "bf16-true", ... Default: bf16 on CUDA, else 32.
        device: "cpu", "cuda", ... Default: CUDA if available.
        num_threads: CPU threads for torch. Default: torch's choice (one per core).
        tasks: Run the offline RULER tasks instead (docs/ruler.md): "ruler" for all, or names separated by
            commas (niah_single_1,vt,...); at `window` tokens (default: the model's context); writes ruler.json
            and ruler.png.
        task_samples: Samples per RULER task (generated as one batch, or batch_size rows when larger).
        quantize: Weight-only quantisation of the linear layers at load (CPU only): "none", "int8"
            (per output channel), "int4" (groups of 32 input columns) or "int4-gN" (N = 64, 128, 256).
        chat_template: RULER tasks only: each prompt as a user message in the checkpoint's chat template
            (with the generation prompt), as an instruct model is used: true, false (the prompt's text
            alone), or unset: when the checkpoint has one.
        oneshot_compress: RULER tasks only, one-shot policies (kvzip, `mode: one-shot`): "context" compresses
            each sample's context, then feeds its question uncompressed (kvpress's pipeline); "prompt"
            compresses the whole prompt, question included.
        overwrite: Replace an `out_dir` that an earlier `litkv evaluate` wrote (its marker file); any
            other non-empty directory is refused whatever this says.
        devices: With --tasks: processes answering the table data-parallel on Lightning Fabric (units of
            --batch_size samples sharded, answers gathered; docs/ruler.md): on a CPU, processes of one
            thread each (unless --num_threads), on a GPU machine one per GPU.
        num_nodes: With --tasks: machines of a multi-node run (--devices processes on each, started by a
            launcher, as `litkv finetune`).
        resume: With --tasks: go on with the answers that a stopped run of the same settings left in
            `out_dir/answers` (each unit's answers are written as soon as they are computed).
    """
    ckpt = check_checkpoint_dir(resolve_checkpoint_dir(checkpoint_dir))
    check_compress(oneshot_compress)
    require_int("--devices", devices, 1)
    require_int("--num_nodes", num_nodes, 1)
    if batch_size is not None:
        require_int("--batch_size", batch_size, 1)
    if tasks is not None:
        require_int("--task_samples", task_samples, 1)
        resolve_tasks(tasks)  # an unknown name is named before the output directory is
        world = devices * num_nodes
        cpu = device == "cpu" or (device is None and not torch.cuda.is_available())
        ruler_settings = {
            "length": window, "num_samples": task_samples, "seed": seed, "kv_cache": kv_cache,
            "policy_options": _nest_policy_options(policy_options),
            "batch_size": task_samples if batch_size is None else batch_size,
            "text_file": text_file, "out_dir": out_dir, "precision": precision, "device": device,
            "num_threads": 1 if num_threads is None and world > 1 and cpu else num_threads, "quantize": quantize,
            "chat_template": chat_template, "oneshot_compress": oneshot_compress, "resume": resume is True,
        }  # fmt: skip
        budget_list = list(DEFAULT_BUDGETS if budgets is None else budgets)
        if launching_rank():  # before the run, not after it
            check_output_dir(out_dir, "evaluate", [ckpt], overwrite, reuse=resume is True, replace=resume is not True)
        fabric = None if world == 1 else launch_fabric(devices, num_nodes, cpu)
        results = run_ruler(ckpt, tasks, _resolve_policies(policies), budget_list, ruler_settings, fabric)
        if fabric is not None:
            close_fabric(fabric)
        return results
    if devices != 1 or num_nodes != 1 or resume:
        raise ValueError(
            "--devices, --num_nodes and --resume apply to RULER tables (--tasks); the perplexity and recall run "
            "is one process"
        )
    batch_size = 4 if batch_size is None else batch_size
    policy_options = _nest_policy_options(policy_options)
    for name, value in (("recall_cases", recall_cases), ("multikey_cases", multikey_cases)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0 (0: skip that task), got {value!r}")
    check_output_dir(out_dir, "evaluate", [ckpt], overwrite, replace=True)  # before the run, not after it
    settings = {
        "policies": _resolve_policies(policies, continuous=True),
        "budgets": list(DEFAULT_BUDGETS if budgets is None else budgets),
    }
    model, dev = load_for_inference(ckpt, precision, device, num_threads, quantize)
    tokenizer = load_tokenizer(ckpt)
    task = RecallTask.from_checkpoint(ckpt, tokenizer) if (ckpt / RECALL_FILE).is_file() else None
    if window is None:
        window = min(task.fmt.context_length if task else model.config.block_size, model.config.block_size)
    text_path = _text_path(ckpt, text_file, task)
    ids = torch.tensor(encode_plain(tokenizer, text_path.read_text(encoding="utf-8")), dtype=torch.long)
    windows = text_windows(ids, window, num_windows)
    depths = list(DEFAULT_DEPTHS if recall_depths is None else recall_depths)
    examples, multikey = [], []
    if task is not None:
        examples = task.examples(window, depths, recall_cases, seed) if recall_cases > 0 else []
        multikey = task.multikey_examples(window, multikey_cases, multikey_keys, seed) if multikey_cases > 0 else []
    else:
        print(
            f"note: {ckpt / RECALL_FILE} not found: the recall task is skipped (and the multi-key task)",
            file=sys.stderr,
        )
    start = time.perf_counter()
    results = evaluate_policies(
        model, windows, settings["policies"], settings["budgets"], examples, kv_cache, batch_size, True,
        policy_options, multikey, decode_tokens,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    print(format_table(results))
    print(
        f"{num_windows} windows of {window} tokens from {text_path.name}; {len(examples)} recall examples, "
        f"{len(multikey)} multi-key; chunk_size {kv_cache.chunk_length}; {elapsed:.0f} s"
    )
    if decode_tokens:
        print(
            f"tok/s: greedy decode steps of {decode_tokens} tokens after the first window, one row, best of 3, prefill "
            f"excluded; wall-clock on {'a shared CPU' if dev.type == 'cpu' else dev.type}: compare within a run only"
        )
    settings.update(
        checkpoint_dir=str(ckpt), text_file=str(text_path), window=window, num_windows=num_windows,
        recall_depths=depths, recall_cases=recall_cases, recall_examples=len(examples),
        multikey_cases=multikey_cases, multikey_keys=multikey_keys, decode_tokens=decode_tokens,
        batch_size=batch_size, seed=seed, device=str(dev), dtype=str(model.lm_head.weight.dtype).removeprefix("torch."),
        num_threads=torch.get_num_threads(), policy_options=policy_options or {},
        kv_cache_template=_template_dict(kv_cache), elapsed_s=round(elapsed, 1),
    )  # fmt: skip
    _write_outputs(Path(out_dir), results, _run_info(settings))
    return results


def launch_fabric(devices: int, num_nodes: int, cpu: bool) -> Fabric:
    """A launched Fabric of `devices` processes per node on `num_nodes` nodes (DDP: gloo on the CPU, NCCL on
    GPUs), as `litkv finetune` launches one; this process becomes rank 0 and starts the others."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu" if cpu else "cuda", devices=devices, num_nodes=num_nodes, strategy="ddp")
    fabric.launch()
    return fabric


def _nest_policy_options(options: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """`{"keydiff.recent": 64}` (from `--policy_options.keydiff.recent 64`) -> `{"keydiff": {"recent": 64}}`;
    nested dicts are kept (merged with dotted keys of the same policy)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f'policy_options must be a dict like {{"keydiff": {{"recent": 64}}}}, got {options!r:.120}')
    out: dict[str, dict[str, Any]] = {}
    for key, value in options.items():
        policy, dot, option = str(key).partition(".")
        policy = _dashed(policy)
        if dot:
            out.setdefault(policy, {})[option] = value
        elif isinstance(value, dict):
            out.setdefault(policy, {}).update(value)
        else:
            raise ValueError(
                f"policy_options[{key!r}] must be a dict of that policy's options, got {value!r:.80}; "
                f'e.g. --policy_options \'{{"{key}": {{"recent": 64}}}}\' or --policy_options.{key}.recent 64'
            )
    return out


def _dashed(policy: str) -> str:
    """`last_recent` -> `last-recent` when only the dashed name is registered (the command line turns
    dashes in option names into underscores, `--policy_options.last-recent.sinks` included)."""
    known = known_policies()
    dashed = policy.replace("_", "-")
    return dashed if policy not in known and dashed in known else policy


def _resolve_policies(policies: list[str] | str | None, continuous: bool = False) -> list[str]:
    """The default list, every registered policy for "all" (with `continuous`, for the perplexity and recall
    run where every policy evicts continuously: all but `kvzip`, which compresses once after a
    reconstruction pass and runs on RULER tasks), a single name, or the list as given."""
    if policies is None:
        return list(DEFAULT_POLICIES)
    if policies == ALL:
        return [p for p in known_policies() if not (continuous and p == KVZIP)]
    if isinstance(policies, str):
        return [policies]
    if ALL in policies:
        raise ValueError(f'"all" must be given alone (--policies all), got {policies}')
    return list(policies)


def _text_path(ckpt: Path, text_file: Path | None, task: RecallTask | None) -> Path:
    if text_file is not None:
        return require_file("--text_file", text_file)
    path = ckpt / (task.fmt.filler_file if task else "heldout.txt")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint directory {str(ckpt)!r} has no {path.name}: pass --text_file")
    return path


def _template_dict(kv_cache: KVCacheConfig) -> dict[str, object]:
    return {
        f.name: getattr(kv_cache, f.name)
        for f in dataclasses.fields(kv_cache)
        if f.name not in ("policy", "cache_length")
    }


def _run_info(settings: dict[str, object]) -> dict[str, object]:
    """The exact command line, versions, and the resolved settings (also at the top level, as before)."""
    try:
        version = importlib.metadata.version("litkv")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),  # the interpreter and `-m litkv` too
        "litkv_version": version,
        "torch_version": torch.__version__,
        **settings,
    }


def _write_outputs(out_dir: Path, results: Sequence[PolicyResult], info: dict[str, object]) -> None:
    """`evaluate.json` and `evaluate.png` as the directory `out_dir`, whole or not at all (checked before
    the run by `check_output_dir`; `save_dir_atomic`)."""
    data = {**info, "results": [r.to_dict() for r in results]}
    json_path, png_path = out_dir / "evaluate.json", out_dir / "evaluate.png"
    plotted = []

    def fill(tmp: Path) -> None:
        write_text_atomic(tmp / json_path.name, json.dumps(data, indent=2) + "\n")
        try:
            plot_results(results, tmp / png_path.name)
            plotted.append(True)
        except ImportError:
            print("note: matplotlib is not installed: no plot (pip install 'litkv[plot]')", file=sys.stderr)

    save_dir_atomic(out_dir, fill, "evaluate", overwrite=True)
    print(f"wrote {json_path} and {png_path}" if plotted else f"wrote {json_path}")


def format_table(results: Sequence[PolicyResult]) -> str:
    """A fixed-width table: one row per (policy, budget), recall per depth and its mean, multi-key
    recall and decode tokens/s (columns present only when measured)."""
    depths = sorted({d for r in results for d in r.recall})
    multikey = any(not math.isnan(r.multikey) for r in results)
    speed = any(not math.isnan(r.decode_tps) for r in results)
    head = ["policy", "budget", "cache MiB", "ppl", "KL", "top-1"]
    head += [f"rec@{d:g}" for d in depths] + (["recall"] if depths else [])
    head += (["multikey"] if multikey else []) + (["tok/s"] if speed else [])
    rows = []
    for r in results:
        budget = f"{r.cache_length} (full)" if r.policy == DENSE else str(r.cache_length)
        row = [r.policy, budget, f"{r.cache_bytes / 2**20:.2f}", f"{r.perplexity:.3f}", f"{r.kl:.3g}", f"{r.top1:.3f}"]
        row += [_fmt(r.recall.get(d, math.nan)) for d in depths] + ([_fmt(r.recall_mean)] if depths else [])
        row += ([_fmt(r.multikey)] if multikey else []) + ([_fmt(r.decode_tps, "{:.0f}")] if speed else [])
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    return "\n".join(_align(row, widths) for row in [head, *rows])


def _align(cells: Sequence[str], widths: Sequence[int]) -> str:
    """First cell left-aligned, the others right-aligned."""
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))


def _fmt(x: float, spec: str = "{:.2f}") -> str:
    return "-" if math.isnan(x) else spec.format(x)


def plot_results(results: Sequence[PolicyResult], path: Path) -> None:
    """Quality against cache budget, one line per policy (dense: dashed reference). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("perplexity", "perplexity"), ("kl", "KL(dense || policy) per token"), ("top1", "top-1 agreement")]
    if any(r.recall for r in results):
        metrics.append(("recall_mean", "pass-key recall (mean over depths)"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), squeeze=False)
    dense = next((r for r in results if r.policy == DENSE), None)
    budgets = sorted({r.cache_length for r in results if r.policy != DENSE})
    for ax, (attr, title) in zip(axes[0], metrics, strict=True):
        for policy in dict.fromkeys(r.policy for r in results if r.policy != DENSE):
            rows = sorted((r for r in results if r.policy == policy), key=lambda r: r.cache_length)
            ax.plot([r.cache_length for r in rows], [getattr(r, attr) for r in rows], marker="o", label=policy)
        if dense is not None:
            ax.axhline(getattr(dense, attr), color="black", linestyle="--", linewidth=1, label="dense")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("cache budget (slots per layer and KV head)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
