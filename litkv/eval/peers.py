"""The decode benchmark's peers: litkv (dense cache), Hugging Face `transformers` and LitGPT, each
loaded on the same random weights and timed the same way (the command is `litkv.cli.bench_cmd`).

The same random weights (a Llama-family LitGPT preset, SmolLM2-135M by default) are written once in
both formats (`prepare_weights`; `hf_llama_config` maps the LitGPT config to a `LlamaConfig`); each
(peer, prompt length) then runs greedy decoding in a fresh subprocess (`worker_main`), so peak memory
(the process's resident high-water mark, reset after loading the weights) is measured alone.

Every peer is timed the same way: a timestamp before the call and one at each streamed token
(`on_tokens` for litkv, a streamer for transformers, the generator for LitGPT). Prefill is the time
to the first token; decode tokens/s is the steps between the first and the last token over the time
between them. Compiled peers (`litkv-compile`: `generate(..., compile=True)`; `hf-static-compile`:
transformers with a `StaticCache` and `torch.compile` of the forward, the Hugging Face tutorial's
setup) first make one untimed warm-up call with the same prompt and cache shapes; `compile s` is
that call's time minus what the timed call took for the same work.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from litkv.checkpoints.runtime import apply_num_threads
from litkv.core.atomic import save_dir_atomic, write_atomic, write_text_atomic
from litkv.eval.bandwidth import bound_tokens_per_s

if TYPE_CHECKING:
    from litgpt.config import Config
    from transformers import LlamaConfig

__all__ = [
    "COMPILED",
    "PEERS",
    "BenchResult",
    "PeerUnavailable",
    "hf_generate",
    "hf_llama_config",
    "load_hf",
    "load_lit",
    "prepare_weights",
    "run_peer",
    "worker_main",
]

PEERS = ("litkv", "litkv-compile", "hf", "hf-static-compile", "litgpt")
COMPILED = ("litkv-compile", "hf-static-compile")
WARMUP_TOKENS = 4  # new tokens of a compiled peer's untimed warm-up call


@dataclass
class BenchResult:
    """One (peer, prompt length) measurement."""

    peer: str
    prompt_len: int
    new_tokens: int
    prefill_s: float
    decode_tok_s: float
    peak_mb: float
    generation_mb: float
    tokens: list[int]
    compile_s: float | None = None  # compiled peers: warm-up call minus the timed call's same work
    step_bytes: float = 0.0  # bytes one decode step reads (weights + cached keys and values)
    bandwidth: float = 0.0  # bytes/s measured in the same run
    note: str = ""  # why a peer did not run ("not available: ..."); its figures are then 0
    quantize: str = "none"  # litkv's rows: the weight quantisation (`litkv.modeling.quant_weights`); peers: "none"

    @property
    def available(self) -> bool:
        return not self.note

    @property
    def end_to_end_s(self) -> float:
        """Seconds from the call to the last token: the prefill and `new_tokens - 1` decode steps (0 when the peer
        did not run)."""
        if not self.available or self.decode_tok_s <= 0:
            return 0.0
        return self.prefill_s + (self.new_tokens - 1) / self.decode_tok_s

    @property
    def bound_tok_s(self) -> float:
        """Decode tokens/s if a step only read `step_bytes` at `bandwidth` (0 when either is unknown)."""
        if self.step_bytes <= 0 or self.bandwidth <= 0:
            return 0.0
        return bound_tokens_per_s(self.bandwidth, self.step_bytes)


class PeerUnavailable(RuntimeError):
    """A peer that cannot run in this installation (reported as a row, not an error)."""


def _config(model: str | Config) -> Config:
    """The LitGPT config of preset name `model`, or `model` itself (a preset with overrides)."""
    from litgpt.config import Config

    return Config.from_name(model) if isinstance(model, str) else model


def hf_llama_config(config: Config, tie: bool) -> LlamaConfig:
    """The `LlamaConfig` of a Llama-style LitGPT config (`tie`: the LM head shares the embedding)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.padded_vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_query_groups,
        head_dim=config.head_size,
        hidden_act="silu",
        max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_base)},
        tie_word_embeddings=tie,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def prepare_weights(model_name: str | Config, seed: int, workdir: Path) -> tuple[Path, Path]:
    """Write random weights for preset `model_name` (a name or a `Config`) as a HF model dir and a LitGPT
    safetensors file."""
    from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    config = _config(model_name)
    if config.mlp_class_name != "LLaMAMLP" or config.norm_class_name != "RMSNorm" or config.bias:
        raise ValueError(f"the decode benchmark supports Llama-family presets, got {config.name!r}")
    hf_config = hf_llama_config(config, tie=True)
    torch.manual_seed(seed)
    hf_model = LlamaForCausalLM(hf_config)
    hf_dir, lit_dir = workdir / "hf", workdir / "litgpt"
    save_dir_atomic(hf_dir, hf_model.save_pretrained)
    state_dict: dict[str, torch.Tensor] = {}
    hf_weights = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    copy_weights_hf_llama(config, {}, state_dict, hf_weights)
    state_dict = {k: v.contiguous().clone() for k, v in state_dict.items()}
    lit_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(lit_dir / "model.safetensors", lambda tmp: save_file(state_dict, str(tmp)))
    return hf_dir, lit_dir


_BASELINE_MB: list[float] = []


def _reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark of this process (Linux); remember the RSS."""
    write_text_atomic("/proc/self/clear_refs", "5")  # a kernel file: written in place
    _BASELINE_MB.append(_status_mb("VmRSS"))


def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmHWM: peak resident set, VmRSS: current), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def load_lit(model_name: str | Config, lit_dir: Path, cls: type[torch.nn.Module]) -> torch.nn.Module:
    """The weights `prepare_weights` wrote under `lit_dir` in a `cls` (litkv's or LitGPT's `GPT`), eval mode."""
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = cls(_config(model_name))
    model.load_state_dict(load_file(str(lit_dir / "model.safetensors")), assign=True)
    # Share the embedding with the LM head where they are equal (tied weights), as HF does.
    if torch.equal(model.lm_head.weight, model.transformer.wte.weight):
        model.lm_head.weight = model.transformer.wte.weight
    return model.eval()


Timed = tuple[list[float], list[int]]


@dataclass
class _Warmup:
    """Timestamps of a compiled peer's untimed warm-up call (before the call, then one per token)."""

    stamps: list[float]


def _litkv_compile_available() -> bool:
    from litkv.inference.generate import generate

    return "compile" in inspect.signature(generate).parameters


def _time_litkv(
    model_name: str | Config, lit_dir: Path, prompt: torch.Tensor, new: int, chunk: int, compile: bool,
    warmups: list[_Warmup], quantize: str,
) -> Timed:  # fmt: skip
    from litkv.inference.generate import generate
    from litkv.kvcache.config import KVCacheConfig
    from litkv.modeling.model import GPT
    from litkv.modeling.quant_weights import parse_quantize, quantize_model
    from litkv.modeling.weight_layout import columns_contiguous

    if compile and not _litkv_compile_available():
        raise PeerUnavailable("not available: litkv.generate has no compile option in this version")
    model = columns_contiguous(quantize_model(load_lit(model_name, lit_dir, GPT), parse_quantize(quantize)))
    cfg = KVCacheConfig(cache_length=prompt.numel() + new, chunk_size=min(chunk, prompt.numel() + new))
    options = {"compile": True} if compile else {}
    _reset_peak_rss()  # compiled: before the warm-up, so that the peak includes compilation
    if compile:  # same prompt and cache shapes as the timed call, fewer new tokens
        warm = [time.perf_counter()]
        generate(
            model,
            [prompt],
            min(new, WARMUP_TOKENS),
            cfg,
            on_tokens=lambda t: warm.append(time.perf_counter()),
            **options,
        )
        warmups.append(_Warmup(warm))
    stamps = [time.perf_counter()]
    out = generate(model, [prompt], new, cfg, on_tokens=lambda t: stamps.append(time.perf_counter()), **options)
    return stamps, out[0].tolist()


def _time_litgpt(model_name: str, lit_dir: Path, prompt: torch.Tensor, new: int) -> Timed:
    from litgpt.generate.base import generate_fn
    from litgpt.model import GPT as LitGPT

    model = load_lit(model_name, lit_dir, LitGPT)
    model.cos, model.sin = model.rope_cache(device=torch.device("cpu"))  # non-persistent buffers
    model.max_seq_length = prompt.numel() + new
    with torch.device("cpu"):
        model.set_kv_cache(batch_size=1)
    _reset_peak_rss()
    stamps, tokens = [time.perf_counter()], []
    max_returned = prompt.numel() + new
    for token in generate_fn(model, prompt, max_returned, temperature=0.0, include_prompt=False, include_eos=True):
        stamps.append(time.perf_counter())
        tokens.extend(token.view(-1).tolist())
    return stamps, tokens


class _Stamps:
    """A transformers streamer that keeps a timestamp per `put` and the generated tokens.

    `generate` puts the prompt first (before the prefill), then each new token.
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())
        if len(self.stamps) > 1:
            self.tokens.extend(value.view(-1).tolist())

    def end(self) -> None:
        pass


class Streamer(Protocol):
    """What transformers' `generate` calls: `put` with the prompt first (before the prefill), then each
    new token; `end` once done."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


def load_hf(hf_dir: Path, static_compile: bool = False, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The `LlamaForCausalLM` that `prepare_weights` wrote under `hf_dir` (float32, eval mode) on `device`;
    with `static_compile`, its forward goes through `torch.compile` (see `_time_hf`; "reduce-overhead",
    CUDA graphs, on a CUDA device)."""
    from transformers import LlamaForCausalLM

    # use_kernels=False: transformers 5.25 kernelizes by default, which needs the `kernels` package (docs/hf.md)
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, use_kernels=False).eval().to(device)
    if static_compile:
        mode = "reduce-overhead" if model.device.type == "cuda" else None
        model.forward = torch.compile(model.forward, mode=mode, fullgraph=True, dynamic=False)
    return model


def hf_generate(
    model: torch.nn.Module, prompts: torch.Tensor, n_new: int, streamer: Streamer, static_len: int | None = None
) -> None:
    """Greedy `n_new` tokens for the equal-length `prompts` (B, T) with transformers' default (dynamic)
    cache, or a fresh `StaticCache` of `static_len` slots."""
    from transformers import StaticCache

    extra = {}
    if static_len is not None:
        extra["past_key_values"] = StaticCache(config=model.config, max_cache_len=static_len)
    with torch.inference_mode():
        model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            streamer=streamer,
            pad_token_id=0,
            **extra,
        )


def _time_hf(hf_dir: Path, prompt: torch.Tensor, new: int, static_compile: bool, warmups: list[_Warmup]) -> Timed:
    """transformers' default (dynamic) cache, or a `StaticCache` with `torch.compile` of the forward.

    The compiled setup is the Hugging Face tutorial's (`fullgraph=True`; CUDA graphs through
    `mode="reduce-overhead"` on a GPU), with `dynamic=False` so that the decode step gets its own
    static-shape graph; each call gets a fresh `StaticCache` of `prompt + new` slots, so the warm-up
    call compiles exactly the graphs the timed call uses.
    """
    model = load_hf(hf_dir, static_compile)
    static_len = prompt.numel() + new if static_compile else None
    _reset_peak_rss()  # compiled: before the warm-up, so that the peak includes compilation
    if static_compile:
        warm = _Stamps()
        hf_generate(model, prompt[None], min(new, WARMUP_TOKENS), warm, static_len)
        warmups.append(_Warmup(warm.stamps))
    timed = _Stamps()
    hf_generate(model, prompt[None], new, timed, static_len)
    return timed.stamps, timed.tokens


def _compile_seconds(warmups: list[_Warmup], prefill: float, step: float) -> float | None:
    """The warm-up call's time minus what the timed call took for the same work (prefill + its steps)."""
    if not warmups:
        return None
    stamps = warmups[-1].stamps
    return (stamps[-1] - stamps[0]) - (prefill + step * (len(stamps) - 2))


def run_peer(
    peer: str, model_name: str | Config, hf_dir: Path, lit_dir: Path, prompt_len: int, new: int, chunk: int, seed: int,
    quantize: str = "none",
) -> BenchResult:  # fmt: skip
    """Measure one peer in this process (meant to run in a fresh subprocess).

    `quantize` (`"none"`, `"int8"`, `"int4"`, `"int4-gN"`) applies to litkv's own rows only: they load
    the weights quantised (`litkv.modeling.quant_weights`); the other peers run the float weights.

    A peer that cannot run here (`litkv-compile` before `generate` has `compile`) comes back as a row
    whose `note` says why.
    """
    quant = quantize if peer in ("litkv", "litkv-compile") else "none"
    vocab = _config(model_name).vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    warmups: list[_Warmup] = []
    try:
        if peer in ("litkv", "litkv-compile"):
            compile = peer == "litkv-compile"
            stamps, tokens = _time_litkv(model_name, lit_dir, prompt, new, chunk, compile, warmups, quantize)
        elif peer == "litgpt":
            stamps, tokens = _time_litgpt(model_name, lit_dir, prompt, new)
        elif peer in ("hf", "hf-static-compile"):
            stamps, tokens = _time_hf(hf_dir, prompt, new, peer == "hf-static-compile", warmups)
        else:
            raise ValueError(f"peer must be one of {list(PEERS)}, got {peer!r}")
    except PeerUnavailable as exc:
        return BenchResult(peer, prompt_len, 0, 0.0, 0.0, 0.0, 0.0, [], note=str(exc), quantize=quant)
    peak = _status_mb("VmHWM")
    if len(stamps) < 3 or stamps[-1] <= stamps[1]:
        raise RuntimeError(f"{peer} produced {len(stamps) - 1} tokens: no decode step was timed")
    prefill = stamps[1] - stamps[0]
    step = (stamps[-1] - stamps[1]) / (len(stamps) - 2)
    return BenchResult(
        peer,
        prompt_len,
        len(stamps) - 1,
        prefill,
        1.0 / step,
        peak,
        peak - _BASELINE_MB[-1],
        tokens,
        compile_s=_compile_seconds(warmups, prefill, step),
        quantize=quant,
    )


def worker_main() -> None:
    """Subprocess entry: arguments as JSON in argv[1], the result as one JSON line on stdout."""
    args = json.loads(sys.argv[1])
    apply_num_threads(args.get("threads"))
    result = run_peer(
        args["peer"],
        args["model"],
        Path(args["hf_dir"]),
        Path(args["lit_dir"]),
        args["prompt_len"],
        args["new"],
        args["chunk"],
        args["seed"],
        args.get("quantize", "none"),
    )
    print("RESULT " + json.dumps(asdict(result)))
