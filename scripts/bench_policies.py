"""Decode and prefill speed of the KV cache policies, eager and compiled, against the memory-bandwidth
bound and Hugging Face `transformers`, SmolLM2-135M architecture.

Random weights (LM head tied to the embedding, as in SmolLM2), float32 on CPU, written once in both
formats by `litkv.eval.peers.prepare_weights` so that the `transformers` row (`hf-dynamic`:
`LlamaForCausalLM`, its default `DynamicCache`, not compiled) runs on the same weights; a preset that
is not Llama-family (or `--no-hf`) runs without it. For each configuration (batch x prompt length)
every (mode, policy) generation runs `litkv.generate` on the same prompts (greedy) with streamed steps
timed: prefill is the time to the first token; decode tokens/s is `batch x steps` over the steps' time;
end-to-end is prefill plus every step. `compiled` is `generate(..., compile=True)` after one untimed
warm-up call with the same shapes (it compiles the decode step; the prefill is not compiled). All the
generations of a configuration (both modes and the `transformers` row) run interleaved, one decode step
of each in turn (each in its own thread on its own copy of the model sharing the weights, handing over
at every streamed token), so that all of them see the same load on a shared machine; a step's time runs
from its generation's turn to its token.

Bytes a decode step reads: the weights once, plus every row's cached keys and values (`cache_length`
slots for an evicting policy, counted from the cache's own `nbytes()` so that int4/int8 scales and
offsets count; the tokens cached halfway through the decode for dense and `transformers`). The
machine's memory bandwidth is measured in the same run with the same thread count
(`litkv.eval.bandwidth.measure_bandwidth`: best of five sums of a 1 GiB tensor, before and after each
configuration; the better of the two counts). Each row shows:

- `prefill tok/s`: batch x prompt over the prefill time (eager run);
- `byte bound`: dense's bytes per step over the policy's (the speed-up that reading fewer bytes
  allows); `MB/step`; `bound tok/s` = bandwidth / bytes per step (x batch); `cache MiB`;
- per mode (`eager`, `compiled`): decode tok/s, `vs last-recent` and `vs dense` (decode tok/s over
  theirs in the same mode), `of bound` (`vs dense` over `byte bound`), `of bw` (decode tok/s over
  `bound tok/s`).

With `--repeats N` every configuration runs N rounds (all its generations again, interleaved as before): each
round's speeds are scaled by last-recent's median over its own (the machine's drift between rounds taken out),
the table shows each row's median, so its ratio to last-recent is the median of its rounds' ratios (what the
targets below read), and a line per policy gives that ratio in each round. Below each table: end-to-end time and
prefill tok/s of dense (each mode) against `transformers`. At the
end: one line per target of issue 23 (decode ratios per mode, the byte bound, end-to-end and prefill
against `transformers`), met or missed, with the figure of each configuration it applies to.

    nice python scripts/bench_policies.py                      # 1x2048, 1x4096, 4x4096, 1x16384, every policy
    nice python scripts/bench_policies.py --configs 1x4096     # one configuration
    nice python scripts/bench_policies.py --modes eager        # no compiled runs
    nice python scripts/bench_policies.py --compiled-policies dense,last-recent,h2o   # fewer compiled ones
    nice python scripts/bench_policies.py --configs 1x4096 --modes eager --repeats 3  # median of 3 rounds
    python scripts/bench_policies.py --quick                   # a smoke test (about a minute)

`--quick`: SmolLM2-135M with 2 layers, batch 2 x 96 tokens, 6 new tokens, 64 slots, chunks of 32; the
compiled mode for dense, last-recent and h2o only (compiling the decode step takes 10-20 s per policy on
a CPU). `--modes compiled` replaces the former `--compile` flag.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from litkv import GPT, Config, KVCacheConfig, generate
from litkv.eval.bandwidth import bound_tokens_per_s, bytes_per_step, measure_bandwidth, weight_bytes
from litkv.eval.peers import hf_generate, load_hf, load_lit, prepare_weights
from litkv.gates import EvictionGates
from litkv.modeling.weight_layout import columns_contiguous

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a script beside its report module
from policy_report import (  # noqa: E402
    HF,
    MODES,
    PolicyRun,
    e2e_lines,
    evaluate_targets,
    format_table,
    format_targets,
    median_rounds,
    round_ratio_lines,
)

POLICIES = (
    "dense", "last-recent", "h2o", "qh2o", "tova", "knorm", "keydiff", "snapkv", "expected-attention", "learned",
    "h2o-int8",
)  # fmt: skip
# h2o with int8 (above) / int4 storage (qh2o also weighs the quantisation error)
EXTRA_POLICIES = ("h2o-int4",)
QUANTIZED = {"qh2o": ("qh2o", "int4"), "h2o-int4": ("h2o", "int4"), "h2o-int8": ("h2o", "int8")}
# name: (batch, prompt length, new tokens)
CONFIGS = {
    "1x2048": (1, 2048, 64), "1x4096": (1, 4096, 128), "4x4096": (4, 4096, 64), "1x16384": (1, 16384, 32)
}  # fmt: skip
QUICK_CONFIGS = {"2x96": (2, 96, 6)}
QUICK_LAYERS = 2
QUICK_COMPILED = ("dense", "last-recent", "h2o")  # compiling every policy takes minutes
WARMUP_TOKENS = 4  # new tokens of a compiled generation's untimed warm-up call


def policy_config(name: str, args: argparse.Namespace, prompt: int, new: int, head_size: int) -> KVCacheConfig:
    """The cache of policy `name`: dense holds the whole sequence (one prefill chunk), the others
    `cache_length` slots (prefill in chunks of `chunk_size`)."""
    chunk = min(args.chunk_size, args.cache_length)
    group = min(args.quant_group_size, head_size)
    if name == "dense":
        return KVCacheConfig("dense", cache_length=prompt + new, chunk_size=chunk, prefill_length=prompt)
    if name == "last-recent":
        return KVCacheConfig(name, cache_length=args.cache_length, chunk_size=chunk, options=dict(sinks=4))
    if name in QUANTIZED:
        policy, storage = QUANTIZED[name]
        return KVCacheConfig(
            policy, cache_length=args.cache_length, chunk_size=chunk, storage=storage, quant_group_size=group
        )
    return KVCacheConfig(name, cache_length=args.cache_length, chunk_size=chunk)


def cached_tokens(config: KVCacheConfig, prompt: int, new: int) -> float:
    """Tokens a row's step attends to, halfway through the decode."""
    return float(min(config.cache_length, prompt + new / 2))


class Turns:
    """Round-robin turns between the threads of `n` generations: one runs while the others wait."""

    def __init__(self, n: int) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.active = set(range(n))
        self.n = n

    def wait(self, i: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == i)

    def hand_over(self, i: int, finished: bool = False) -> None:
        """Give the turn to the next active generation after `i` (`finished`: `i` leaves the round)."""
        with self.cond:
            if finished:
                self.active.discard(i)
            following = [(i + k) % self.n for k in range(1, self.n + 1)]
            self.turn = next((j for j in following if j in self.active), -1)
            self.cond.notify_all()


@dataclass
class Timing:
    """One generation's prefill seconds and decode step seconds (each from its turn to its token)."""

    prefill_s: float = 0.0
    steps: list[float] = field(default_factory=list)


Runner = Callable[[Callable[[torch.Tensor], None]], object]


def _worker(i: int, turns: Turns, run: Runner, out: list[Timing | BaseException | None]) -> None:
    """Thread body: run generation `i` in its turns, timing the prefill and each step's own time."""
    timing = Timing()
    clock = {"start": 0.0, "resumed": 0.0}

    def on_tokens(tokens: torch.Tensor) -> None:
        now = time.perf_counter()
        if clock["resumed"] == 0.0:
            timing.prefill_s = now - clock["start"]
        else:
            timing.steps.append(now - clock["resumed"])
        turns.hand_over(i)
        turns.wait(i)
        clock["resumed"] = time.perf_counter()

    try:
        turns.wait(i)
        clock["start"] = time.perf_counter()
        run(on_tokens)
        out[i] = timing
    except BaseException as exc:  # re-raised by `interleaved`
        out[i] = exc
    finally:
        turns.hand_over(i, finished=True)


def interleaved(runs: list[Runner]) -> list[Timing]:
    """Run generations one streamed step each in turn; `runs[i](on_tokens)` runs generation `i`."""
    turns = Turns(len(runs))
    out: list[Timing | BaseException | None] = [None] * len(runs)
    threads = [threading.Thread(target=_worker, args=(i, turns, run, out)) for i, run in enumerate(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in out:
        if isinstance(result, BaseException):
            raise result
    return out  # type: ignore[return-value]


def policy_model(model: GPT) -> GPT:
    """A copy of `model` with its own modules and state, sharing the weights (one per policy thread)."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def step_bytes_of(model: GPT, config: KVCacheConfig, batch: int, prompt: int, new: int) -> tuple[int, float]:
    """(bytes the caches hold, bytes a decode step reads) for policy `config` on `batch` rows."""
    with torch.inference_mode():
        cache_bytes = sum(c.nbytes() for c in model.build_kv_caches(config, batch))
    per_slot = cache_bytes / (batch * config.cache_length)
    return cache_bytes, bytes_per_step(weight_bytes(model), per_slot, cached_tokens(config, prompt, new), batch)


# -- tables and targets (pure functions of the runs) ----------------------------------------------

# -- options, models and the runs -----------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M", help="LitGPT config name (random weights)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated BATCHxPROMPT among {list(CONFIGS)} or any other BxT (default: all of them)",
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="override every configuration's new tokens")
    parser.add_argument("--cache-length", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256, help="prefill chunk size of the evicting policies")
    parser.add_argument("--quant-group-size", type=int, default=64, help="int4/int8 group size (<= head size)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"among {list(POLICIES + EXTRA_POLICIES)}")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated among eager, compiled (generate(..., compile=True) after one untimed warm-up "
        "call with the same shapes); default both, side by side",
    )
    parser.add_argument(
        "--compiled-policies",
        default=None,
        help=f"policies of the compiled mode (default: every one of --policies; --quick: {list(QUICK_COMPILED)})",
    )
    parser.add_argument("--no-hf", action="store_true", help="no transformers row")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (and for the bandwidth measurement)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of each configuration (all its generations again, interleaved); the table shows each row's "
        "median round, its ratio to last-recent the median of its rounds', and a line per policy each round's",
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write the runs and targets as JSON here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: {list(QUICK_CONFIGS)}, 64 slots, chunks of 32, {QUICK_LAYERS} layers unless --layers "
        f"is given, compiled mode for {list(QUICK_COMPILED)} unless --compiled-policies is given",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.cache_length, args.chunk_size = 64, 32
        args.layers = QUICK_LAYERS if args.layers is None else args.layers
        if args.compiled_policies is None:
            args.compiled_policies = ",".join(p for p in QUICK_COMPILED if p in args.policies.split(","))
        if args.configs == parser.get_default("configs"):
            args.configs = ",".join(QUICK_CONFIGS)
    return args


def _parse_configs(text: str, new_tokens: int | None) -> dict[str, tuple[int, int, int]]:
    configs = {}
    for name in text.split(","):
        known = {**CONFIGS, **QUICK_CONFIGS}
        if name in known:
            b, t, new = known[name]
        else:
            b_str, _, t_str = name.partition("x")
            if not (b_str.isdigit() and t_str.isdigit() and int(b_str) > 0 and int(t_str) > 0):
                raise ValueError(f"--configs entries must be BATCHxPROMPT like 1x4096, got {name!r}")
            b, t, new = int(b_str), int(t_str), 64
        configs[name] = (b, t, new_tokens if new_tokens is not None else new)
        if configs[name][2] < 2:
            raise ValueError(f"--new-tokens must be >= 2 (a decode speed needs two steps), got {configs[name][2]}")
    return configs


def _policies(text: str, option: str) -> list[str]:
    policies = text.split(",") if text else []
    unknown = [p for p in policies if p not in POLICIES + EXTRA_POLICIES]
    if unknown:
        raise ValueError(f"{option}: unknown policies {unknown}; choose from {list(POLICIES + EXTRA_POLICIES)}")
    return policies


def resolve(args: argparse.Namespace) -> tuple[dict[str, tuple[int, int, int]], dict[str, list[str]]]:
    """The configurations `{name: (batch, prompt, new tokens)}` and the policies of each mode asked for
    (`{mode: policies}`); ValueError naming a bad option."""
    configs = _parse_configs(args.configs, args.new_tokens)
    policies = _policies(args.policies, "--policies")
    compiled = policies if args.compiled_policies is None else _policies(args.compiled_policies, "--compiled-policies")
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"--modes must be distinct entries among {list(MODES)}, got {args.modes!r}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    if "compiled" in modes and "compile" not in inspect.signature(generate).parameters:
        raise ValueError("--modes compiled: litkv.generate has no compile option in this version")
    plan = {m: compiled if m == "compiled" else policies for m in MODES if m in modes}
    return configs, {m: p for m, p in plan.items() if p}


def model_config(args: argparse.Namespace) -> Config:
    return Config.from_name(args.model, **({} if args.layers is None else {"n_layer": args.layers}))


def with_gates(model: GPT, seed: int) -> GPT:
    """Random eviction gates for `learned` (its speed does not depend on what they learned)."""
    torch.manual_seed(seed)
    c = model.config
    gates = EvictionGates.create(c.n_layer, c.n_query_groups, c.head_size, window=16, sinks=4)
    gates.weight.normal_()
    model.eviction_gates = gates
    return model


def build_model(config: Config, seed: int) -> GPT:
    """Random weights, LM head tied to the embedding (SmolLM2 ties them; where the shapes differ, untied)."""
    torch.manual_seed(seed)
    model = GPT(config).eval()
    if model.lm_head.weight.shape == model.transformer.wte.weight.shape:
        model.lm_head.weight = model.transformer.wte.weight
    return with_gates(columns_contiguous(model), seed)


def load_models(args: argparse.Namespace, workdir: Path) -> tuple[GPT, torch.nn.Module | None, str]:
    """(litkv model, the transformers twin on the same weights or None, why there is none)."""
    config = model_config(args)
    if args.no_hf:
        return build_model(config, args.seed), None, "--no-hf"
    try:
        hf_dir, lit_dir = prepare_weights(config, args.seed, workdir)
    except (ValueError, ImportError) as exc:  # not a Llama-family preset; no transformers
        return build_model(config, args.seed), None, str(exc)
    model = load_lit(config, lit_dir, GPT)
    assert isinstance(model, GPT)
    return with_gates(columns_contiguous(model), args.seed), load_hf(hf_dir), ""


class _OnTokens:
    """A transformers streamer that hands each new token to `on_tokens` (its first `put` is the prompt)."""

    def __init__(self, on_tokens: Callable[[torch.Tensor], None]) -> None:
        self.on_tokens, self.prompt_seen = on_tokens, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.on_tokens(value)
        self.prompt_seen = True

    def end(self) -> None:
        pass


Generation = tuple[str, str, Runner]  # (policy, mode, runner)


def generations(
    model: GPT, hf_model: torch.nn.Module | None, prompts: torch.Tensor, new: int,
    configs: dict[str, KVCacheConfig], plan: dict[str, list[str]],
) -> list[Generation]:  # fmt: skip
    """The runners of one configuration: each (mode, policy) of `plan` on its own model copy (compiled
    ones after their warm-up call), then the transformers row."""
    out: list[Generation] = []
    for mode, policies in plan.items():
        for policy, config in ((p, configs[p]) for p in policies):
            m, options = policy_model(model), {"compile": True} if mode == "compiled" else {}
            if options:
                print(f"  compiling {policy} (warm-up call) ...", file=sys.stderr, flush=True)
                generate(m, list(prompts), min(new, WARMUP_TOKENS), config, **options)

            def run(on_tokens: Callable, m: GPT = m, config: KVCacheConfig = config, options: dict = options) -> None:
                generate(m, list(prompts), new, config, on_tokens=on_tokens, **options)

            out.append((policy, mode, run))
    if hf_model is not None:
        out.append((HF, "eager", lambda on_tokens: hf_generate(hf_model, prompts, new, _OnTokens(on_tokens))))
    return out


def run_config(
    model: GPT, hf_model: torch.nn.Module | None, spec: tuple[int, int, int], plan: dict[str, list[str]],
    args: argparse.Namespace,
) -> list[PolicyRun]:  # fmt: skip
    """Every (mode, policy) of `plan` and the transformers row on the same prompts of configuration `spec` =
    (batch, prompt, new tokens), interleaved (`bound_tok_s` left 0: `with_bound` sets it)."""
    b, t, new = spec
    prompts = torch.randint(0, model.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(args.seed))
    policies = dict.fromkeys(p for ps in plan.values() for p in ps)
    configs = {p: policy_config(p, args, t, new, model.config.head_size) for p in policies}
    gens = generations(model, hf_model, prompts, new, configs, plan)
    timings = interleaved([run for _, _, run in gens])
    dense = policy_config("dense", args, t, new, model.config.head_size)  # transformers holds what dense holds
    sizes = {p: step_bytes_of(model, c, b, t, new) for p, c in {**configs, HF: dense}.items()}
    runs = []
    for (policy, mode, _), timing in zip(gens, timings, strict=True):
        if not timing.steps:
            raise RuntimeError(f"{policy} ({mode}) generated 1 token; a decode speed needs 2 or more")
        cache_bytes, step = sizes[policy]
        decode_s = sum(timing.steps)
        tok_s = b * len(timing.steps) / decode_s
        runs.append(PolicyRun(policy, mode, b, t, new, timing.prefill_s, decode_s, tok_s, cache_bytes, step))
    return runs


def with_bound(runs: list[PolicyRun], bandwidth: float) -> list[PolicyRun]:
    """Set each run's bound tokens/s from the measured `bandwidth` (bytes/s)."""
    for r in runs:
        r.bound_tok_s = bound_tokens_per_s(bandwidth, r.step_bytes, r.batch)
    return runs


def _allow_recompiles(n: int) -> None:
    """Every policy copy (and shape) compiles the decode step anew: raise dynamo's recompile limits."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), n))


def run_json(r: PolicyRun) -> dict:
    return {**asdict(r), "prefill_tok_s": r.prefill_tok_s, "e2e_s": r.e2e_s}


def measure(
    model: GPT, hf_model: torch.nn.Module | None, configs: dict[str, tuple[int, int, int]],
    plan: dict[str, list[str]], args: argparse.Namespace, bandwidth: float, gib: int,
) -> tuple[dict[str, list[PolicyRun]], dict[str, float]]:  # fmt: skip
    """Each configuration in turn, its table and end-to-end lines printed as it ends."""
    results, bandwidths = {}, {}
    for name, spec in configs.items():
        what = ", ".join(f"{len(p)} {m}" for m, p in plan.items())
        print(f"{name}: {what} generations, interleaved ...", file=sys.stderr, flush=True)
        rounds = [run_config(model, hf_model, spec, plan, args) for _ in range(args.repeats)]
        runs = median_rounds(rounds)
        after = measure_bandwidth(gib, threads=args.threads)
        bandwidths[name] = max(bandwidth, after)  # best of the measurements before and after the config
        results[name] = with_bound(runs, bandwidths[name])
        bandwidth = after
        b, t, new = spec
        print(
            f"\nbatch {b} x {t} tokens, {new} new tokens; memory bandwidth {bandwidths[name] / 1e9:.1f} GB/s "
            "(best of the measurements before and after):\n"
        )
        print(format_table(results[name]))
        for line in e2e_lines(results[name]):
            print(line)
        if args.repeats > 1:
            print(f"\nDecode against last-recent in each of {args.repeats} rounds:")
            for line in round_ratio_lines(rounds):
                print(line)
        sys.stdout.flush()
    return results, bandwidths


def main(argv: list[str] | None = None) -> dict[str, list[PolicyRun]]:
    args = parse_args(argv)
    configs, plan = resolve(args)
    torch.set_num_threads(args.threads)
    if "compiled" in plan:
        _allow_recompiles(4 * len(plan["compiled"]) * len(configs) + 8)
    gib = 2**28 if args.quick else 2**30
    with tempfile.TemporaryDirectory() as tmp:
        model, hf_model, no_hf = load_models(args, Path(tmp))
        bandwidth = measure_bandwidth(gib, threads=args.threads)
        print(
            f"{args.model}{'' if args.layers is None else f' ({model.config.n_layer} layers)'} (random weights, "
            f"tied LM head, float32, {model.lm_head.weight.device.type}, {args.threads} threads, modes {list(plan)}): "
            f"cache_length {args.cache_length} (dense: the whole sequence, one prefill chunk), prefill chunks of "
            f"{min(args.chunk_size, args.cache_length)}; weights {weight_bytes(model) / 1e6:.0f} MB; memory "
            f"bandwidth before the runs {bandwidth / 1e9:.1f} GB/s (sum of {gib // 2**20} MiB, best of 5); "
            + (f"no transformers row ({no_hf})" if no_hf else "transformers row: hf-dynamic on the same weights")
        )
        results, bandwidths = measure(model, hf_model, configs, plan, args, bandwidth, gib)
    targets = evaluate_targets(results)
    summary = format_targets(targets)
    print("\nTargets (issue 23):")
    for line in summary:
        print(f"- {line}")
    if args.json_out is not None:
        out = {
            "bandwidth": bandwidths,
            "plan": plan,
            "configs": {k: [run_json(r) for r in v] for k, v in results.items()},
            "targets": [{**asdict(t), "met": t.met} for t in targets],
            "summary": summary,
        }
        args.json_out.write_text(json.dumps(out, indent=2))
    return results


if __name__ == "__main__":
    main()
