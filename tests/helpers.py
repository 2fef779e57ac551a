"""Test helpers: tiny configs, random weights and an independent float64 reference forward.

Import from tests as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn as nn
from litgpt.model import RMSNorm

from litkv import GPT, Config
from litkv.gates.gate import EvictionGates
from litkv.modeling.weight_layout import columns_contiguous

__all__ = [
    "MaskFn",
    "RefOutput",
    "attach_random_gates",
    "evicts_alone",
    "band_mask",
    "causal_mask",
    "chunked_last_recent_mask",
    "float64_model",
    "forward_depth",
    "max_diff",
    "random_gates",
    "random_tokens",
    "randomize_",
    "random_gpt",
    "reference_forward",
    "rounding_bound",
    "tiny_config",
    "tiny_gpt",
]

# allowed(q_pos (T, 1), k_pos (1, T)) -> (T, T) bool, True where query q may attend to key k.
MaskFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

TINY = dict(
    n_layer=2,
    n_embd=64,
    n_head=4,
    n_query_groups=2,
    head_size=16,
    intermediate_size=128,
    vocab_size=128,
    padded_vocab_size=128,
    block_size=256,
)


# words of the serve tests' user messages (ragged turns cut from them)
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "in",
    "the",
    "beginning",
    "was",
    "the",
    "word",
    "and",
    "the",
    "passkey",
    "is",
    "12345",
]


def random_tokens(batch: int, length: int, seed: int, low: int = 0, high: int = 128) -> torch.Tensor:
    """(batch, length) int64 token ids uniform in [low, high), drawn from a generator seeded with `seed`."""
    return torch.randint(low, high, (batch, length), generator=torch.Generator().manual_seed(seed))


def tiny_config(name: str, **overrides: object) -> Config:
    """LitGPT preset `name` shrunk to 2 layers, width 64, vocabulary 128 (overridable)."""
    return Config.from_name(name, **{**TINY, **overrides})


# A recurrent layer's parameters (the last part of their names) -> the (low, high) of their uniform draws.
_RECURRENT_DRAWS = {"A_log": (-1.0, 1.0), "dt_bias": (0.5, 1.5), "D": (0.5, 1.5)}


def randomize_(module: nn.Module, seed: int) -> None:
    """Re-draw every parameter so that no weight is trivial and logits are well spread.

    Matrices (embeddings included, so that tied LM heads stay tame): N(0, 1/n_columns); norm weights:
    1 + N(0, 0.1^2); biases: N(0, 0.1^2). A recurrent layer's (Mamba-2, Gated DeltaNet) decay `A_log`:
    U(-1, 1), its `dt_bias` and skip `D`: U(0.5, 1.5), so that its state keeps a part of each token over
    several steps, differently per head.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            if name.rsplit(".", 1)[-1] in _RECURRENT_DRAWS:
                low, high = _RECURRENT_DRAWS[name.rsplit(".", 1)[-1]]
                param.copy_(low + (high - low) * torch.rand(param.shape, generator=gen, dtype=torch.float64))
            elif param.dim() >= 2:
                param.copy_(noise * param.shape[-1] ** -0.5)
            elif name.endswith("bias"):
                param.copy_(noise * 0.1)
            else:
                param.copy_(1.0 + noise * 0.1)


def random_gpt(config: Config, seed: int = 0) -> GPT:
    """A `litkv.GPT` in eval mode with `randomize_`d float32 weights."""
    model = GPT(config)
    randomize_(model, seed)
    return model.eval()


def random_gates(
    config: Config, seed: int = 0, window: int = 2, sinks: int = 1, gate_input: str = "key"
) -> EvictionGates:
    """Eviction gates for `config` with N(0, 1) weights and biases (so that the `learned` policy's
    ranking is far from trivial), drawn from a generator seeded with `seed`; `gate_input="hidden"`: gates
    of the layer's attention input (`(n_layer, G, n_embd)`)."""
    width = config.head_size if gate_input == "key" else config.n_embd
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(config.n_layer, config.n_query_groups, width, generator=gen)
    bias = torch.randn(config.n_layer, config.n_query_groups, generator=gen)
    return EvictionGates(weight, bias, window, sinks, input=gate_input)


def attach_random_gates(model: GPT, seed: int = 0, window: int = 2, sinks: int = 1, gate_input: str = "key") -> GPT:
    """`model` (returned) with `random_gates` as its `eviction_gates`, on its device."""
    gates = random_gates(model.config, seed, window, sinks, gate_input)
    model.eviction_gates = gates.to(model.lm_head.weight.device)
    return model


TINY_PRESET = "SmolLM2-135M"
#: Tiny architectures the tests parametrize over: name -> (LitGPT preset, overrides of `TINY`).
ARCHITECTURES: dict[str, tuple[str, dict[str, object]]] = {
    "smollm2": ("SmolLM2-135M", {}),  # GQA
    "pythia": ("pythia-14m", {"n_query_groups": 4, "intermediate_size": 256}),  # partial rotary, parallel
    # alternating sliding window shorter than the chunks, soft-capping
    "gemma2": (
        "gemma-2-2b",
        {"sliding_window_size": 8, "attention_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    ),
    "gemma3": ("gemma-3-1b-it", {"n_query_groups": 1, "sliding_window_size": 8}),  # per-layer RoPE base, q/k norm, MQA
}


def tiny_gpt(
    seed: int,
    dtype: torch.dtype = torch.float32,
    *,
    arch: str | None = None,
    config: str | Config = TINY_PRESET,
    overrides: Mapping[str, object] | None = None,
    gates: bool = False,
    gate_seed: int | None = None,
    window: int = 2,
    sinks: int = 1,
    device: torch.device | str = "cpu",
    weights: Mapping[str, torch.Tensor] | None = None,
) -> GPT:
    """The test model factory (conftest's `tiny_model` fixture): a fresh `random_gpt` (eval mode).

    - `arch`: a name in `ARCHITECTURES` (its preset and overrides, `overrides` on top), or
    - `config`: a LitGPT preset name shrunk by `tiny_config` (with `overrides` on top), or a `Config`;
    - `dtype`: torch.float32, or torch.float64 for `float64_model` (RMSNorm computed in float64 too);
    - `gates=True`: `attach_random_gates(model, gate_seed, window, sinks)` after the dtype (float32 gates;
      `gate_seed` defaults to `seed`);
    - `device`: where the model (and its gates) live; the weights are drawn on the CPU first;
    - `weights`: a state dict loaded (in `dtype`) in place of the random weights (`seed` unused): a parity
      test's reference weights (e.g. a transformers model's, converted).

    On the CPU the linear weights are stored column-major (`columns_contiguous`), as `load_for_inference` and
    `litkv chat` store them, so the suite runs the layout users decode with.

    Every call builds a new model, so a module-scoped fixture may mutate its own.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"tiny_gpt dtype must be torch.float32 or torch.float64, got {dtype}")
    if arch is not None:
        if config != TINY_PRESET:
            raise ValueError(f"tiny_gpt takes arch or config, not both (got {arch!r} and {config!r})")
        config, base = ARCHITECTURES[arch]
        overrides = {**base, **(overrides or {})}
    if isinstance(config, Config):
        if overrides:
            raise ValueError(f"tiny_gpt takes overrides with a preset name only, got a Config and {overrides}")
    else:
        config = tiny_config(config, **(overrides or {}))
    if not gates and (gate_seed is not None or (window, sinks) != (2, 1)):
        raise ValueError("tiny_gpt: gate_seed, window and sinks need gates=True")
    if weights is None:
        model = random_gpt(config, seed=seed)
    else:
        model = GPT(config).to(dtype).eval()
        model.load_state_dict(weights)
    if dtype == torch.float64:
        float64_model(model)
    model.to(device)  # before the gates: `attach_random_gates` puts them on the model's device
    columns_contiguous(model)  # the linear weights' layout the loaders give a model on the CPU
    if gates:
        attach_random_gates(model, seed if gate_seed is None else gate_seed, window, sinks)
    return model


class _DtypeRMSNorm(RMSNorm):
    """LitGPT's RMSNorm computed in the input's dtype (LitGPT's own casts float64 inputs to float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = (1 + self.weight) if self.add_unit_offset else self.weight
        return x * torch.rsqrt(torch.mean(x * x, dim=self.dim, keepdim=True) + self.eps) * weight.to(x.dtype)


def float64_model(model: nn.Module) -> nn.Module:
    """`model.double()` (in place, returned) with every LitGPT RMSNorm computing in float64.

    LitGPT's `RMSNorm.forward` runs in float32 whatever the input dtype, which would leave float32
    rounding in a float64 computation (in the norm weights' gradients, summed over tokens, and
    wherever an input sits near a float32 rounding boundary). Same parameters, same state_dict.
    litkv's eager attention (soft-capping, attention weights) still computes its scores in float32.
    """
    model.double()
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = _DtypeRMSNorm
    return model


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute elementwise difference (as float64)."""
    return (a.double() - b.double()).abs().max().item()


def rounding_bound(reference: torch.Tensor, depth: int, dtype: torch.dtype = torch.float32, ulps: float = 8.0) -> float:
    """Largest `max_diff` from `reference` that rounding alone explains, when the compared values
    went through a chain of `depth` accumulations rounded in `dtype` (see `forward_depth`).

    Returns `ulps * eps(dtype) * sqrt(depth) * max|reference|`. Derivation: each addition of an
    accumulation chain rounds with a relative error of at most `u = eps / 2`, the errors have random
    signs, so after `depth` of them the relative error is about `u * sqrt(depth)` (one standard
    deviation; Higham & Mary, "A new approach to probabilistic rounding error analysis", 2019), and
    relative to the largest magnitude in play, since a normalisation or a matrix product mixes every
    entry's error into every output. `ulps = 8` (16 standard deviations) covers the maximum over
    ~1e4 compared entries (4.5 sd), two independently rounded sides (x sqrt 2) and an amplification
    of up to 2.5 by the softmaxes and norms (measured on this suite: at most 0.22 of `ulps = 1`, on
    any one comparison). The bound depends on the magnitudes and the computation,
    not on the CPU: a different summation order (AVX2, AVX-512, another BLAS) changes which errors
    occur, not their size. Any logic error (a wrong mask, a lost token, a cast to a 16-bit type)
    shows up orders of magnitude above it, and for float64 (`eps = 2.2e-16`) the bound is far below
    what float32 could reach.

    Args:
        reference: the expected values (any shape); only its largest magnitude is used.
        depth: number of rounded accumulations on the longest path from inputs to the output.
        dtype: precision the compared computations ran in (the less precise of the two sides).
        ulps: multiples of `eps(dtype) * sqrt(depth)` allowed, relative to `max|reference|`.
    """
    scale = reference.detach().abs().max().item()
    return ulps * torch.finfo(dtype).eps * math.sqrt(depth) * scale


def forward_depth(config: Config, keys: int) -> int:
    """Rounded accumulations on the longest path of a forward of `config` (for `rounding_bound`).

    Per block: `n_embd` (qkv), `head_size` (q.k), `keys` (softmax sum and probs @ v), `n_head *
    head_size` (attention projection), `n_embd` and `intermediate_size` (MLP), `2 * n_embd` (the two
    norms); then `2 * n_embd` (final norm, LM head). `keys` is the largest number of keys one query
    sums over (sequence length, or cache slots + chunk).
    """
    c = config
    block = 4 * c.n_embd + c.head_size + 2 * keys + c.n_head * c.head_size + c.intermediate_size
    return c.n_layer * block + 2 * c.n_embd


def causal_mask(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Plain causal attention."""
    return k <= q


def band_mask(width: int, sinks: int = 0) -> MaskFn:
    """Causal band: key `k` visible from query `q` iff `q - k <= width - sinks` or `k < sinks`."""
    return lambda q, k: (k <= q) & ((q - k <= width - sinks) | (k < sinks))


def chunked_last_recent_mask(cache_length: int, sinks: int, starts: Sequence[int]) -> MaskFn:
    """What a last-recent cache shows a query whose chunk starts at `start`: the chunk so far, the
    `cache_length - sinks` tokens before `start` and the first `sinks` tokens."""

    def allowed(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        bounds = torch.tensor(list(starts))
        start = bounds[torch.searchsorted(bounds, q, right=True) - 1]
        return (k <= q) & ((k >= start - (cache_length - sinks)) | (k < sinks))

    return allowed


@dataclass
class RefOutput:
    logits: torch.Tensor  # (B, T, vocab) float64
    hidden: torch.Tensor  # (B, T, n_embd) float64, after the final norm
    block_inputs: list[torch.Tensor]  # input of each block, after the hook


def reference_forward(
    model: GPT,
    idx: torch.Tensor,
    masks: MaskFn | Sequence[MaskFn] = causal_mask,
    hook: Callable[[int, torch.Tensor], torch.Tensor | None] | None = None,
) -> RefOutput:
    """Float64 forward of a Llama/Pythia-style model with an explicit mask per layer.

    Attention and RoPE are written here from scratch; norms and MLPs are the model's own (LitGPT's)
    modules, run on a `float64_model` copy (RMSNorm included). Supports GQA, qkv bias, partial rotary
    and parallel residual.
    """
    c = model.config
    _check_reference_supported(c)
    ref = float64_model(copy.deepcopy(model))
    masks = [masks] * c.n_layer if callable(masks) else list(masks)
    pos = torch.arange(idx.shape[1])
    x = ref.transformer.wte(idx)
    inputs = []
    for i, block in enumerate(ref.transformer.h):
        if hook is not None:
            replaced = hook(i, x)
            x = x if replaced is None else replaced.double()
        inputs.append(x)
        allowed = masks[i](pos[:, None], pos[None, :])
        x = _reference_block(block, x, allowed, c)
    hidden = ref.transformer.ln_f(x)
    return RefOutput(ref.lm_head(hidden), hidden, inputs)


def _check_reference_supported(c: Config) -> None:
    unsupported = {
        "rope_adjustments": c.rope_adjustments,
        "norm_qk": c.norm_qk,
        "sliding_window_size": c.sliding_window_size,
        "attention_logit_softcapping": c.attention_logit_softcapping,
        "final_logit_softcapping": c.final_logit_softcapping,
        "attention_scores_scalar": c.attention_scores_scalar,
        "scale_embeddings": c.scale_embeddings,
        "post_attention_norm": c.post_attention_norm,
        "post_mlp_norm": c.post_mlp_norm,
        "rope_interleave": getattr(c, "rope_interleave", False),
        "rope_local_base_freq": c.rope_local_base_freq,
    }
    used = {k: v for k, v in unsupported.items() if v}
    if used:
        raise NotImplementedError(f"reference_forward does not support {used}")


def _reference_block(block: nn.Module, x: torch.Tensor, allowed: torch.Tensor, c: Config) -> torch.Tensor:
    h = block.norm_1(x)
    attn = _reference_attention(block.attn, h, allowed, c)
    if c.parallel_residual:
        h2 = h if c.shared_attention_norm else block.norm_2(x)
        return x + attn + block.mlp(h2)
    x = x + attn
    return x + block.mlp(block.norm_2(x))


def _reference_attention(attn: nn.Module, x: torch.Tensor, allowed: torch.Tensor, c: Config) -> torch.Tensor:
    b, t, _ = x.shape
    hs, nh, g = c.head_size, c.n_head, c.n_query_groups
    q, k, v = attn.qkv(x).split((nh * hs, g * hs, g * hs), dim=-1)
    q = _reference_rope(q.view(b, t, nh, hs), c)
    k = _reference_rope(k.view(b, t, g, hs), c)
    v = v.view(b, t, g, hs)
    group = torch.arange(nh) // (nh // g)  # query head -> its KV head
    k, v = k[:, :, group], v[:, :, group]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / hs**0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return attn.proj(y.reshape(b, t, nh * hs))


def _reference_rope(x: torch.Tensor, c: Config) -> torch.Tensor:
    """Rotate-half RoPE on the first `rope_n_elem` features of `x` `(B, T, heads, hs)`."""
    n = c.rope_n_elem
    half = n // 2
    freq = 1.0 / c.rope_base ** (torch.arange(half, dtype=torch.float64) * 2 / n)
    angle = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * freq  # (T, n/2)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    x1, x2, rest = x[..., :half], x[..., half:n], x[..., n:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def forge_entry(
    source: object, target: object, sign: bytes | None = None, token_ids: object = None, **entry: object
) -> dict:
    """Copy the state file `source` to `target` with its store entry's fields replaced by `entry` and
    the checksum recomputed, as an attacker who knows the format would (only what the entry and the
    metadata claim is then left to refuse it). The file's mac is dropped (the attacker has no key) unless
    `sign` is given: then the file is signed with that key, as a writer holding the store's key would.
    `token_ids`: the ids the file claims to cover (default: the source's). Returns the new entry."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from litkv.core.secret import mac
    from litkv.states.state_file import MAC_PURPOSE, digest

    with safe_open(str(source), framework="pt") as f:
        header = dict(f.metadata() or {})
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    meta = json.loads(header["litkv"])
    meta.pop("digest")
    meta.pop("mac", None)
    meta["entry"] = {**(meta.get("entry") or {}), **entry}
    if token_ids is not None:
        meta["token_ids"] = token_ids
    meta["digest"] = digest(meta, tensors)
    if sign is not None:
        meta["mac"] = mac(sign, MAC_PURPOSE, meta["digest"])
    header["litkv"] = json.dumps(meta)
    save_file(tensors, str(target), metadata=header)
    return meta["entry"]


def evicts_alone(policy: str) -> bool:
    """Whether `policy` with its default options evicts by itself during a run (mode `continuous`): every
    policy but `kvzip`, which is one-shot only (its compression needs a reconstruction pass of the model)."""
    from litkv.kvcache.registry import get_kv_cache_class

    return getattr(get_kv_cache_class(policy).Options(), "mode", "continuous") == "continuous"


def load_script(name: str) -> ModuleType:
    """`scripts/<name>.py` imported as module `name` (and registered in `sys.modules`, so that a script importing
    a sibling, and a test reading that sibling back, find it)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
